"""The rollout engine: a fixed amount of work per decode step (no data-dependent loop inside a
step, the threshold equal to the earlier early-stopping bisection bit for bit), the stop
test once per block, and continuous batching giving each request the static sampler's
completion."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given
from hypothesis import strategies as st
from jax import lax

from epgrpo_jax.io.errors import UserError
from epgrpo_jax.models import LoraConfig, Qwen2, preset
from epgrpo_jax.rollout import strategies
from epgrpo_jax.rollout.sampling import Sampler, SamplingConfig
from helpers import assert_same_completions

_INT_MAX = np.iinfo(np.int32).max


def early_stopping_threshold(values_BxV, weights_BxV, target_B):
  """The oracle: the bisection `largest_threshold` was before (a while loop that snaps both
  ends of its bracket to values of the row and stops when they are neighbours)."""
  values_BxV = values_BxV.astype(jnp.float32)
  inf = jnp.float32(jnp.inf)
  lo_B = strategies._to_key(jnp.min(values_BxV, axis=-1))
  hi_B = strategies._to_key(jnp.max(values_BxV, axis=-1)) + 1

  def body(carry):
    lo_B, hi_B = carry
    mid_B = (lo_B | hi_B) - ((lo_B ^ hi_B) >> 1)
    above_BxV = values_BxV >= strategies._from_key(mid_B)[:, None]
    mass_B = jnp.sum(jnp.where(above_BxV, weights_BxV, 0), axis=-1)
    first_above_B = jnp.min(jnp.where(above_BxV, values_BxV, inf), axis=-1)
    last_below_B = jnp.max(jnp.where(above_BxV, -inf, values_BxV), axis=-1)
    ok_B = mass_B >= target_B
    return (jnp.where(ok_B, strategies._to_key(first_above_B), lo_B),
            jnp.where(ok_B, hi_B, strategies._to_key(last_below_B) + 1))

  lo_B, _ = lax.while_loop(lambda c: jnp.any(c[1] - 1 > c[0]), body, (lo_B, hi_B))
  return strategies._from_key(lo_B)


ORACLE = jax.jit(early_stopping_threshold)
FIXED = jax.jit(strategies.largest_threshold)


def assert_same_bits(values, weights, target):
  want = np.asarray(ORACLE(values, weights, target))
  got = np.asarray(FIXED(values, weights, target))
  np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32))


def test_fixed_trip_threshold_equals_the_early_stopping_bisection():
  rng = np.random.default_rng(0)
  for trial in range(40):  # one shape: two compilations
    x = (rng.normal(size=(6, 257)) * rng.choice([0.1, 3.0, 30.0])).astype(np.float32)
    if trial % 3 == 0:
      x = np.round(x)  # ties, and -0.0 next to 0.0
    if trial % 5 == 0:
      x[:, : int(rng.integers(1, 257))] = x[:, :1]
    p = np.exp(x - x.max(1, keepdims=True))
    p = (p / p.sum(1, keepdims=True)).astype(np.float32)  # tiny probabilities: denormals
    assert_same_bits(p, p, jnp.asarray(rng.uniform(0.01, 1.0, 6), jnp.float32))  # top-p
    assert_same_bits(x, np.ones_like(x), jnp.asarray(rng.integers(1, 258, 6), jnp.float32))  # top-k


def test_threshold_literal_cases():
  values = jnp.asarray([[0.5, 0.25, 0.25, 0.0], [-0.0, 0.0, 1.0, -1.0]], jnp.float32)
  got = FIXED(values, jnp.abs(values), jnp.asarray([0.6, 5.0], jnp.float32))
  np.testing.assert_array_equal(np.asarray(got).view(np.int32),
                                np.asarray([0.25, -1.0], np.float32).view(np.int32))


@given(st.lists(st.sampled_from([-3.0, -0.5, -0.0, 0.0, 1e-40, 0.25, 0.5, 2.0, 7.0]), min_size=64,
                max_size=64),
       st.floats(0.01, 1.0), st.integers(1, 16))
def test_threshold_property(row, top_p, k):
  x = np.asarray(row, np.float32).reshape(4, 16)
  p = np.abs(x) / np.abs(x).sum(1, keepdims=True).clip(1e-30)
  assert_same_bits(p.astype(np.float32), p.astype(np.float32), jnp.full((4,), top_p, jnp.float32))
  assert_same_bits(x, np.ones_like(x), jnp.full((4,), k, jnp.float32))


# ---------------------------------------------------------------------------
# The decode program.


@functools.cache
def tiny_model():
  m = Qwen2(preset("test-tiny"), rngs=nnx.Rngs(0))
  m.lm_head[...] = m.lm_head[...] * 3.0
  return m


@pytest.fixture(scope="module")
def model():
  return tiny_model()


PROMPTS = [[9, 17, 33, 12], [44, 13, 50, 12, 17, 27, 21], [30, 31], [40, 41, 42, 43, 44, 45]]
EOS = tuple(range(1, 9))  # 8 of 97 ids stop: completions of varied lengths


def subjaxprs(eqn):
  for value in eqn.params.values():
    for item in value if isinstance(value, (list, tuple)) else (value,):
      if isinstance(item, jax.extend.core.ClosedJaxpr):
        yield item.jaxpr
      elif isinstance(item, jax.extend.core.Jaxpr):
        yield item


def eqns(jaxpr):
  """Every equation of `jaxpr`, nested ones included."""
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in subjaxprs(eqn):
      yield from eqns(sub)


def decode_loops(sampler, model, kernels: bool = False):
  """The while loops at the top of the static sampler's program (one per decode segment)."""
  graphdef, state = nnx.split(model)
  ids, mask = sampler.prepare_prompts(PROMPTS)
  p, g, n = len(PROMPTS), 2, 16
  fn = functools.partial(sampler._generate, num_samples=g, gen_len=n,
                         prompt_len=ids.shape[1], native=kernels)
  jaxpr = jax.make_jaxpr(fn)(sampler.prepared(graphdef, state), ids, mask, jax.random.key(0), jnp.full((p * g,), n, jnp.int32),
                             jnp.asarray(EOS, jnp.int32))
  return [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "while"]


@pytest.mark.parametrize("cfg", [SamplingConfig(temperature=1.0, top_p=0.95, top_k=20),
                                 SamplingConfig(greedy=True)], ids=["top-k-top-p", "greedy"])
def test_no_data_dependent_loop_inside_a_decode_step(model, cfg):
  loops = decode_loops(Sampler(cfg.replace(max_new_tokens=16, decode_segments=2)), model)
  assert len(loops) == 2  # the segments' "all done" tests, once per block
  for loop in loops:
    inner = [e.primitive.name for e in eqns(loop.params["body_jaxpr"].jaxpr)]
    assert "while" not in inner, "a data-dependent loop runs inside a decode block"
    assert "scan" in inner  # the block: a fixed-trip loop of decode steps


def test_weights_are_prepared_outside_the_decode_loop(model):
  loops = decode_loops(Sampler(SamplingConfig(greedy=True, max_new_tokens=16)), model)
  d = model.cfg.hidden_size
  for loop in loops:
    concats = [e for e in eqns(loop.params["body_jaxpr"].jaxpr) if e.primitive.name == "concatenate"
               and any(getattr(v.aval, "shape", ())[:1] == (d,) and len(v.aval.shape) == 2
                       for v in e.invars)]
    assert not concats, "weights concatenated inside the decode loop"
  # the model does concatenate q/k/v and gate/up when its weights are not prepared
  loops = decode_loops(Sampler(SamplingConfig(greedy=True, max_new_tokens=16, packed_weights=False)), model)
  assert any(e.primitive.name == "concatenate" for e in eqns(loops[0].params["body_jaxpr"].jaxpr))


def test_the_decoding_programs_take_the_weights_prepared_once():
  # A LoRA model: the weights' own program merges the adapters and concatenates q/k/v and
  # gate/up once a call; the sampling program takes them ready and holds no kernel as it was.
  cfg = preset("test-tiny")
  lora = Qwen2(cfg, lora=LoraConfig(rank=3, targets=("q", "k", "v", "o", "gate", "up", "down")),
               rngs=nnx.Rngs(0))
  sampler = Sampler(SamplingConfig(greedy=True, max_new_tokens=16, cpu_kernels=False))
  graphdef, state = nnx.split(lora)
  weights = sampler.prepared(graphdef, state)
  d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
  qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * hd
  assert [w.shape for w in weights.groups] == [(d, qkv), (cfg.num_heads * hd, d), (d, 2 * f), (f, d)] * 2
  assert not [p for p, _ in nnx.to_flat_state(weights.state) if p[-1] == "kernel"]
  assert len(weights.absent) == 7 * cfg.num_layers  # stand-ins for the kernels, shapes only
  with pytest.raises(TypeError):
    weights.model().layers[0].attn.q.base.kernel[...]
  ids, mask = sampler.prepare_prompts(PROMPTS)
  fn = functools.partial(sampler._generate, num_samples=2, gen_len=16, prompt_len=ids.shape[1],
                         native=False)
  jaxpr = jax.make_jaxpr(fn)(weights, ids, mask, jax.random.key(0), jnp.full((8,), 16, jnp.int32),
                             jnp.asarray(EOS, jnp.int32))
  everywhere = list(eqns(jaxpr.jaxpr))
  assert not [e for e in everywhere if e.primitive.name == "concatenate"  # of a kernel [d, n]
              and any(getattr(v.aval, "shape", ())[:1] == (d,) and v.aval.ndim == 2 for v in e.invars)]
  assert not [e for e in everywhere if e.primitive.name == "dot_general"  # no adapter [d, 3] or [3, n]
              and any(getattr(v.aval, "ndim", 0) == 2 and 3 in v.aval.shape for v in e.invars)]


def sample(model, cfg, key=1, stop_after=None, **kw):
  sampler = Sampler(cfg.replace(max_new_tokens=20, **kw), eos_ids=EOS)
  return sampler.sample(model, PROMPTS, 3, jax.random.key(key), stop_after=stop_after), sampler


NUCLEUS = SamplingConfig(temperature=1.0, top_p=0.95)
GREEDY = SamplingConfig(greedy=True)


@functools.lru_cache(maxsize=None)
def completions(cfg, key=1, **kw):
  return sample(tiny_model(), cfg, key=key, **kw)[0]


@pytest.mark.parametrize("cfg", [GREEDY, NUCLEUS], ids=["greedy", "top-p"])
def test_stop_test_once_per_block_changes_nothing(cfg):
  every_token = completions(cfg, stop_check_every=1)
  lengths = np.asarray(every_token.lengths)
  assert 1 <= lengths.min() and lengths.min() < lengths.max()  # rows stop at different steps
  assert_same_completions(completions(cfg, stop_check_every=8), every_token)


@pytest.mark.parametrize("cfg,cpu_kernels", [(GREEDY, False), (NUCLEUS, True), (NUCLEUS, False)],
                         ids=["greedy-xla", "top-p-cpu-kernels", "top-p-xla"])
def test_continuous_batching_gives_each_request_the_static_completion(cfg, cpu_kernels):
  static = completions(cfg, stop_check_every=8, cpu_kernels=cpu_kernels)
  continuous, sampler = sample(tiny_model(), cfg, cpu_kernels=cpu_kernels, continuous=True, slots=4,
                               refill_every=3)
  assert_same_completions(continuous, static)
  assert sampler.num_compilations >= 3  # prepare, prefill, blocks (and fewer rows at the tail)


def test_a_requests_tokens_depend_on_neither_slot_nor_neighbours():
  wide = completions(NUCLEUS, cpu_kernels=False, continuous=True, slots=5, refill_every=4)
  narrow = completions(NUCLEUS, cpu_kernels=False, continuous=True, slots=2, refill_every=1)
  assert_same_completions(narrow, wide)
  other_key = completions(NUCLEUS, key=2, cpu_kernels=False, continuous=True, slots=5, refill_every=4)
  assert not np.array_equal(np.asarray(other_key.tokens), np.asarray(wide.tokens))


def test_stop_after_caps_each_completion_on_both_paths(model):
  caps = np.arange(1, 13, dtype=np.int32).reshape(4, 3)
  cfg = GREEDY.replace(ignore_eos=True)
  static, _ = sample(model, cfg, stop_after=caps)
  continuous, _ = sample(model, cfg, stop_after=caps, continuous=True, slots=3, refill_every=2)
  np.testing.assert_array_equal(np.asarray(static.lengths), caps)
  assert_same_completions(continuous, static)


@pytest.mark.parametrize("key,value,message", [
    ("slots", 0, "sampling.slots: must be >= 1"),
    ("refill_every", 0, "sampling.refill_every: must be >= 1"),
    ("stop_check_every", 0, "sampling.stop_check_every: must be >= 1"),
    ("slot_tokens", -1, "sampling.slot_tokens: must be >= 0")])
def test_bad_engine_settings_name_their_key(key, value, message):
  with pytest.raises(UserError, match=message):
    SamplingConfig(**{key: value})


def test_a_request_longer_than_a_slot_names_the_key(model):
  with pytest.raises(UserError, match="sampling.slot_tokens: 16 cannot hold a request"):
    sample(model, GREEDY, continuous=True, slot_tokens=16)



def test_continuous_batching_on_a_mesh_gives_each_request_the_static_completion():
  from epgrpo_jax.models import param_rules
  from epgrpo_jax.parallel import sharding
  from epgrpo_jax.rollout import continuous
  mesh = sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=2, tensor=2))  # the 8 fake devices
  graphdef, state = nnx.split(tiny_model())
  state = jax.device_put(state, sharding.state_shardings(state, mesh, param_rules(tiny_model().cfg)))
  engine = Sampler(NUCLEUS.replace(max_new_tokens=20, cpu_kernels=False, continuous=True, slots=8,
                                   refill_every=3), eos_ids=EOS, mesh=mesh)
  got = engine.sample((graphdef, state), PROMPTS, 3, jax.random.key(1))
  assert_same_completions(got, completions(NUCLEUS, cpu_kernels=False))  # the static sampler, one device
  # The slots' rows split over data x fsdp, the cache's kv heads over tensor.
  slots = continuous.empty_slots(tiny_model().cfg, 8, 64, None, jax.random.split(jax.random.key(0), 2))
  placed = continuous.slot_shardings(slots, mesh)
  assert placed.done_S.spec == jax.sharding.PartitionSpec(("data", "fsdp"))
  assert placed.cache["k"][0].spec[:2] == (("data", "fsdp"), "tensor")
  assert continuous.slot_shardings(continuous.empty_slots(tiny_model().cfg, 2, 64, None, slots.keys_S),
                                   mesh).done_S.spec == jax.sharding.PartitionSpec(None)  # 2 rows: replicated
