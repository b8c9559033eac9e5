"""The continuous engine's insertion writes the refilled rows only: each filled row's first Tp
slots take its prompt's keys and values from the store, and every other element of the cache
(other rows, the rest of a filled row) is left as it was, bit for bit (NaN included: an
unfilled row is not even read into a select); on a mesh, within each device's rows, with no
all-gather."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from hypothesis import given
from hypothesis import strategies as st
from jax.experimental.layout import Layout

from epgrpo_jax.models import Qwen2, init_cache, preset
from epgrpo_jax.parallel import sharding
from epgrpo_jax.rollout import continuous
from epgrpo_jax.rollout.sampling import Sampler, SamplingConfig
from helpers import Events

CFG = preset("test-tiny")


def oracle(cache, store, fill_S, prompt_S):
  """The literal copy: for each filled row r, slots [0, Tp) := the store's prompt prompt_S[r]."""
  tp = store["valid"].shape[1]
  k = [np.array(x) for x in cache["k"]]
  v = [np.array(x) for x in cache["v"]]
  for r in np.flatnonzero(fill_S):
    for layer in range(len(k)):
      k[layer][r, :, :, :tp] = np.asarray(store["k"][layer])[prompt_S[r]]
      v[layer][r, :, :tp] = np.asarray(store["v"][layer])[prompt_S[r]]
  return k, v


def filled_with_nan(s: int, capacity: int, p: int, tp: int, seed: int):
  """A slots cache holding NaN everywhere (what a row must not be read for), and a store of P
  prompts of random keys and values."""
  cache = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan) if x.dtype == jnp.float32 else x,
                       init_cache(CFG, s, capacity, jnp.float32))
  store = init_cache(CFG, p, tp, jnp.float32)
  keys = iter(jax.random.split(jax.random.key(seed), 2 * len(store["k"])))
  store["k"] = [jax.random.normal(next(keys), x.shape) for x in store["k"]]
  store["v"] = [jax.random.normal(next(keys), x.shape) for x in store["v"]]
  return cache, store


def same_bits(got, want):
  np.testing.assert_array_equal(np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32))


@given(st.lists(st.booleans(), min_size=1, max_size=6), st.integers(0, 2 ** 16))
def test_insertion_writes_the_filled_rows_only(fill, seed):
  s, p, tp = len(fill), 3, 4
  cache, store = filled_with_nan(s, 7, p, tp, seed)
  fill_S = np.asarray(fill)
  prompt_S = np.random.default_rng(seed).integers(0, p, s).astype(np.int32)
  k, v = jax.jit(continuous.write_prompts)(cache, store, fill_S, prompt_S)
  want_k, want_v = oracle(cache, store, fill_S, prompt_S)
  for got, want in zip(k + v, want_k + want_v):
    same_bits(got, want)


def test_insertion_literal_case():
  cache, store = filled_with_nan(3, 5, 2, 2, seed=0)
  k, v = continuous.write_prompts(cache, store, np.asarray([False, True, False]), np.asarray([0, 1, 0]))
  np.testing.assert_array_equal(k[0][1, :, :, :2], store["k"][0][1])
  np.testing.assert_array_equal(v[1][1, :, :2], store["v"][1][1])
  assert np.isnan(np.asarray(k[0])[1, :, :, 2:]).all() and np.isnan(np.asarray(v[0])[[0, 2]]).all()


def test_insertion_on_a_mesh_stays_within_each_devices_rows():
  mesh = sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=2, tensor=2))  # the 8 fake devices
  s, p, tp = 8, 3, 4
  cache, store = filled_with_nan(s, 6, p, tp, seed=1)
  cache = jax.device_put(cache, sharding.cache_shardings(cache, mesh))
  store = jax.device_put(store, sharding.replicated(mesh))
  fill_S = np.asarray([True, False, False, True, True, False, False, True])
  prompt_S = np.asarray([2, 0, 1, 0, 1, 2, 2, 1], np.int32)
  rep = sharding.replicated(mesh)
  args = (cache, store, jax.device_put(fill_S, rep), jax.device_put(prompt_S, rep))
  program = jax.jit(lambda *a: continuous.write_prompts(*a, mesh=mesh)).lower(*args).compile()
  assert "all-gather" not in program.as_text()
  k, v = program(*args)
  assert k[0].sharding.spec == cache["k"][0].sharding.spec  # the rows stay where they were
  want_k, want_v = oracle(cache, store, fill_S, prompt_S)
  for got, want in zip(k + v, want_k + want_v):
    same_bits(got, want)


def eqns(jaxpr):
  for eqn in jaxpr.eqns:
    yield eqn
    for value in eqn.params.values():
      for item in value if isinstance(value, (list, tuple)) else (value,):
        if isinstance(item, jax.extend.core.ClosedJaxpr):
          yield from eqns(item.jaxpr)
        elif isinstance(item, jax.extend.core.Jaxpr):
          yield from eqns(item)


def test_insertion_touches_the_cache_only_by_row_updates_in_a_loop_over_the_filled_rows():
  s = 5
  cache, store = filled_with_nan(s, 7, 3, 4, seed=2)
  jaxpr = jax.make_jaxpr(continuous.write_prompts)(cache, store, np.ones(s, bool), np.zeros(s, np.int32))
  whole = {(x.shape, x.dtype) for x in cache["k"] + cache["v"]}
  touching = {e.primitive.name for e in eqns(jaxpr.jaxpr)
              if any((getattr(v.aval, "shape", None), getattr(v.aval, "dtype", None)) in whole
                     for v in e.outvars)}
  assert touching == {"while", "dynamic_update_slice"}, touching
  loop = next(e for e in jaxpr.jaxpr.eqns if e.primitive.name == "while")
  updates = [e for e in eqns(loop.params["body_jaxpr"].jaxpr) if e.primitive.name == "dynamic_update_slice"]
  assert len(updates) == 2 * len(cache["k"])  # one row per layer's keys and values
  assert all(e.invars[1].aval.shape[0] == 1 for e in updates)


def test_the_engine_compiles_nothing_in_steady_state():
  # the blocks are compiled with their cache's layout picked (`continuous.lower_block`): a second
  # call of the same shapes, other keys, reuses every program and builds no executable
  model = Qwen2(CFG, rngs=nnx.Rngs(0))
  sampler = Sampler(SamplingConfig(temperature=1.0, top_p=0.95, max_new_tokens=12, continuous=True, slots=3,
                                   refill_every=2, cpu_kernels=False), eos_ids=tuple(range(1, 9)))
  prompts = [[9, 17, 33, 12], [44, 13, 50], [30, 31]]
  sampler.sample(model, prompts, 2, jax.random.key(0))
  programs = sampler.num_compilations
  with Events() as later:
    sampler.sample(model, prompts, 2, jax.random.key(1))
  assert sampler.num_compilations == programs
  assert later.compiles == 0, later.names


def test_the_engine_runs_with_its_cache_in_a_layout_other_than_the_default(monkeypatch):
  # On TPU the block's picked layout is not the default one, and a compiled program refuses a
  # committed argument in another layout: the engine copies the slots into the block's layout
  # (and into the shrink program's). Forcing a non-default layout on CPU, on a mesh (committed
  # slots, as on TPU), runs that path; the tokens and log-probs must not change.
  from epgrpo_jax.models import param_rules
  mesh = sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=1, tensor=1), devices=jax.devices()[:2])
  graphdef, state = nnx.split(Qwen2(CFG, rngs=nnx.Rngs(0)))
  state = jax.device_put(state, sharding.state_shardings(state, mesh, param_rules(CFG)))
  config = SamplingConfig(temperature=1.0, top_p=0.95, max_new_tokens=12, continuous=True, slots=4,
                          refill_every=2, cpu_kernels=False)
  prompts = [[9, 17, 33, 12], [44, 13, 50], [30, 31], [7, 8, 9]]
  want = Sampler(config, eos_ids=tuple(range(1, 9)), mesh=mesh).sample((graphdef, state), prompts, 2,
                                                                        jax.random.key(3))
  monkeypatch.setattr(continuous, "KV_LAYOUT", Layout(major_to_minor=(3, 2, 1, 0)))
  sampler = Sampler(config, eos_ids=tuple(range(1, 9)), mesh=mesh)
  got = sampler.sample((graphdef, state), prompts, 2, jax.random.key(3))
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_array_equal(got.logp, want.logp)
  blocks = [p for p in sampler._programs.values() if len(p.input_formats[0]) > 4]
  assert blocks and all(p.input_formats[0][4].cache["k"][0].layout.major_to_minor == (3, 2, 1, 0)
                        for p in blocks)  # the forced layout was the blocks' own
