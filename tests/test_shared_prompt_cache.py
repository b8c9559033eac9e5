"""A prompt's cache kept once for its G rows (`sampling.shared_prompt_cache`): the merged decode
attention against a literal case and, as an invariant, against `attend` over per-row copies;
the static sampler's completions the same with the switch on as off (greedy and T 1.0 top-p
0.95, float32; on one device and over a mesh); the prompt stored once; the per-backend choice."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from epgrpo_jax.io.errors import UserError
from epgrpo_jax.kernels import seam
from epgrpo_jax.models import Qwen2, attend, attend_shared, init_cache, preset
from epgrpo_jax.models._attention import visible
from epgrpo_jax.rollout.sampling import Sampler, SamplingConfig
from helpers import assert_same_completions
from epgrpo_jax.tools import tpu_costs


def test_merged_attention_literal_case():
  """One prompt of 2 slots (the first padding), 2 rows of 2 own slots each (the second not yet
  written), Hd = 1 (scale 1). Row 0's query is 0: equal weights on the prompt's slot 1 (value 2)
  and its own slot 0 (value 4) -> 3. Row 1's query 1 meets key ln 3 in the prompt (weight 3) and
  key 0 of its own (weight 1): 3/4 * 2 + 1/4 * 8 = 3.5. Masked slots hold 100 and 999."""
  prompt_keys = jnp.asarray([0.0, np.log(3.0)], jnp.float32).reshape(1, 1, 1, 2)  # [P, K, Hd, Tp]
  prompt_values = jnp.asarray([100.0, 2.0], jnp.float32).reshape(1, 1, 2, 1)
  prompt_valid = jnp.asarray([[False, True]])
  q = jnp.asarray([0.0, 1.0], jnp.float32).reshape(2, 1, 1, 1, 1)  # [B, K, Q, T, Hd]
  keys = jnp.zeros((2, 1, 1, 2), jnp.float32)
  values = jnp.asarray([[4.0, 999.0], [8.0, 999.0]], jnp.float32).reshape(2, 1, 2, 1)
  allowed = visible(jnp.asarray([[True, False], [True, False]]), 0, 1)  # [B, T, C]
  out = attend_shared(q, keys, values, allowed, prompt_keys, prompt_values, prompt_valid)
  chex.assert_trees_all_close(out.reshape(2), jnp.asarray([3.0, 3.5]), atol=1e-6)


@jax.jit
def merged_and_whole(q, keys, values, own_valid, offset, prompt_keys, prompt_values, prompt_valid):
  """(`attend_shared`, `attend` over each row's prompt copy ++ its own slots)."""
  g, tp = q.shape[0] // prompt_valid.shape[0], prompt_valid.shape[1]
  got = attend_shared(q, keys, values, visible(own_valid, offset, 1), prompt_keys, prompt_values,
                      prompt_valid)
  rows = lambda x: jnp.repeat(x, g, axis=0)
  whole_keys = jnp.concatenate([rows(prompt_keys), keys], axis=-1)
  whole_values = jnp.concatenate([rows(prompt_values), values], axis=2)
  whole_valid = jnp.concatenate([rows(prompt_valid), own_valid], axis=1)
  return got, attend(q, whole_keys, whole_values, visible(whole_valid, tp + offset, 1))


@settings(max_examples=max(settings.default.max_examples // 10, 5), deadline=None)
@given(shape=st.sampled_from([(1, 1, 1, 1, 1, 1), (2, 3, 2, 2, 5, 6)]), seed=st.integers(0, 2 ** 16),
       valid_share=st.sampled_from([0.0, 0.5, 0.9]))
def test_merged_attention_equals_attend_over_per_row_copies(shape, seed, valid_share):
  """Any prompt and completion masks (rows with no visible slot included): the same as `attend`
  over each row's concatenated cache, its prompt copied in."""
  p, g, k, q, tp, c = shape
  hd, b = 4, p * g
  rng = np.random.default_rng(seed)
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape) * 3, jnp.float32)
  got, want = merged_and_whole(
      normal(b, k, q, 1, hd), normal(b, k, hd, c), normal(b, k, c, hd),
      jnp.asarray(rng.random((b, c)) < valid_share), jnp.int32(rng.integers(0, c)),
      normal(p, k, hd, tp), normal(p, k, tp, hd), jnp.asarray(rng.random((p, tp)) < valid_share))
  chex.assert_trees_all_close(got, want, atol=1e-5)


# The static sampler.


@functools.cache
def tiny_model():
  m = Qwen2(preset("test-tiny"), rngs=nnx.Rngs(0))
  m.lm_head[...] = m.lm_head[...] * 3.0
  return m


PROMPTS = [[9, 17, 33, 12], [44, 13, 50, 12, 17, 27, 21], [30, 31], [40, 41, 42, 43, 44, 45]]
EOS = tuple(range(1, 9))
NUCLEUS = SamplingConfig(temperature=1.0, top_p=0.95)
GREEDY = SamplingConfig(greedy=True)


@functools.lru_cache(maxsize=None)
def completions(cfg, shared, mesh=None, **kw):
  """3 completions of each prompt, up to 24 tokens in 2 segments (the cache grows once)."""
  sampler = Sampler(cfg.replace(max_new_tokens=24, decode_segments=2, cpu_kernels=False,
                                shared_prompt_cache=shared, **kw), eos_ids=EOS, mesh=mesh)
  return sampler.sample(nnx.split(tiny_model()), PROMPTS, 3, jax.random.key(1))


@pytest.mark.parametrize("cfg", [GREEDY, NUCLEUS], ids=["greedy", "top-p"])
def test_shared_prompt_cache_gives_the_same_completions(cfg):
  off = completions(cfg, False)
  lengths = np.asarray(off.lengths)
  assert lengths.min() < lengths.max() and lengths.max() > 16  # stops vary; the second segment runs
  assert_same_completions(completions(cfg, True), off)


def test_shared_prompt_cache_on_a_mesh():
  """Over data x fsdp x tensor (the 8 fake devices): the prompts split as the rows are."""
  from epgrpo_jax.parallel import sharding
  mesh = sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=2, tensor=2))
  assert_same_completions(completions(NUCLEUS, True, mesh), completions(NUCLEUS, False))
  cache = {**init_cache(tiny_model().cfg, 12, 8), "prompt": init_cache(tiny_model().cfg, 4, 16)}
  placed = sharding.cache_shardings(jax.eval_shape(lambda: cache), mesh)["prompt"]
  assert placed["k"][0].spec == jax.sharding.PartitionSpec(("data", "fsdp"), "tensor", None, None)
  assert placed["valid"].spec == jax.sharding.PartitionSpec(("data", "fsdp"), None)


def test_the_prompt_is_stored_once_per_group():
  model = tiny_model()
  cfg = GREEDY.replace(max_new_tokens=24, decode_segments=2, cpu_kernels=False)
  ids, mask = Sampler(cfg).prepare_prompts(PROMPTS)
  p, tp = ids.shape
  args = (ids, mask, jax.random.key(0), jnp.full((p * 3,), 24, jnp.int32), jnp.asarray(EOS, jnp.int32))
  def prefill_cache(shared):
    sampler = Sampler(cfg.replace(shared_prompt_cache=shared), eos_ids=EOS)
    run = functools.partial(sampler._generate, native=False, num_samples=3,
                            gen_len=24, prompt_len=tp, part="prefill")
    return jax.eval_shape(run, sampler.prepared(*nnx.split(model)), *args)[0].cache
  own, split = prefill_cache(False), prefill_cache(True)
  heads, hd = model.cfg.num_kv_heads, model.cfg.head_dim
  assert own["k"][0].shape == (p * 3, heads, hd, tp + 16) and "prompt" not in own
  assert split["prompt"]["k"][0].shape == (p, heads, hd, tp)  # once per prompt
  assert split["prompt"]["v"][0].shape == (p, heads, tp, hd)
  assert split["k"][0].shape == (p * 3, heads, hd, 16)  # the rows' own: the first segment
  assert split["valid"].shape == (p * 3, 16) and split["prompt"]["valid"].shape == (p, tp)


def test_no_data_dependent_loop_inside_a_decode_step():
  sampler = Sampler(NUCLEUS.replace(max_new_tokens=16, cpu_kernels=False, shared_prompt_cache=True))
  ids, mask = sampler.prepare_prompts(PROMPTS)
  graphdef, state = nnx.split(tiny_model())
  run = functools.partial(sampler._generate, num_samples=2, gen_len=16,
                          prompt_len=ids.shape[1], native=False)
  jaxpr = jax.make_jaxpr(run)(sampler.prepared(graphdef, state), ids, mask, jax.random.key(0), jnp.full((8,), 16, jnp.int32),
                              jnp.asarray(EOS, jnp.int32)).jaxpr
  loops = [e for e in jaxpr.eqns if e.primitive.name == "while"]
  assert len(loops) == 2  # one per segment, testing "all done" once per block
  inner = str(loops[0].params["body_jaxpr"]) + str(loops[1].params["body_jaxpr"])
  assert "while[" not in inner and "scan[" in inner


def test_the_backend_chooses_and_a_bad_value_names_the_key():
  assert [seam.shared_prompt_cache("auto", b) for b in ("tpu", "cpu", "gpu")] == [True, False, False]
  assert seam.shared_prompt_cache(True, "cpu") and not seam.shared_prompt_cache(False, "tpu")
  with pytest.raises(UserError, match="sampling.shared_prompt_cache: must be true, false or auto"):
    SamplingConfig(shared_prompt_cache="always")


@pytest.mark.skipif(not tpu_costs.libtpu_installed(),
                    reason="libtpu is not installed: no TPU ahead-of-time compiles")
def test_a_tpu_decode_block_moves_fewer_bytes_with_the_prompt_once():
  """A tiny config's decode block compiled for one v5e chip (the TPU compiler's HLO, its HBM bytes
  counted instruction by instruction, `models.hlo_bytes`): the switch on (auto on a TPU) moves
  fewer bytes than off, and its arguments hold the prompts once."""
  from epgrpo_jax.tools import compile_check
  before = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)  # programs for devices this host lacks
  try:
    measured = {}
    for setting in ("auto", "false"):
      args = compile_check.parse_args([
          "--topology", "v5e:2x2", "--preset", "test-tiny", "--prompt-tokens", "8",
          "train.prompts_per_step=4", "train.num_generations=4", "sampling.max_new_tokens=16",
          f"sampling.shared_prompt_cache={setting}"])
      check = compile_check.CompileCheck.create(args, tpu_costs.topology_devices("v5e:2x2")[:1])
      measured[setting] = dict(check.programs())["decode block 0"]()
  finally:
    jax.config.update("jax_enable_compilation_cache", before)
  on, off = measured["auto"], measured["false"]
  # 4 prompts of 4 rows each: 3 of each prompt's 4 copies of the 32 prompt slots (of 40) go; 2026-12-07: 596 KB
  # against 793 KB a block
  assert 0 < on.hbm < 0.9 * off.hbm and on.argument < off.argument, (on.hbm, off.hbm, on.argument,
                                                                     off.argument)


# On a GPU with the switch on: the prompt part by one XLA product per group, the rows' own
# slots by the Pallas kernel (`kernels/gpu.py`), run here by Pallas' interpreter.


def test_gpu_shared_attention_equals_xla_with_garbage_outside_the_rows_spans():
  from epgrpo_jax.kernels import gpu
  p, g, k, q, hd, tp, c = 2, 3, 2, 3, 8, 5, 40
  rng = np.random.default_rng(7)
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape) * 2, jnp.float32)
  q_, keys, values = normal(p * g, k, q, hd), normal(p * g, k, hd, c), normal(p * g, k, c, hd)
  allowed = jnp.asarray(rng.random((p * g, c)) < 0.6).at[:, 30:].set(False).at[0].set(False)
  keys = jnp.where(allowed[:, None, None, :], keys, jnp.nan)  # never read: not allowed or past 30
  values = jnp.where(allowed[:, None, :, None], values, jnp.inf)
  prompt = normal(p, k, hd, tp), normal(p, k, tp, hd), jnp.asarray([[0, 1, 1, 1, 1], [1, 1, 0, 1, 1]], bool)
  got = jax.jit(functools.partial(gpu.shared_decode_attention, block=16, programs=8, interpret=True))(
      q_, keys, values, allowed, 30, *prompt)
  clean = lambda x: jnp.nan_to_num(x, nan=0.0, posinf=0.0)
  want = attend_shared(q_[:, :, :, None], clean(keys), clean(values), visible(allowed, 29, 1), *prompt)
  chex.assert_trees_all_close(got, want[:, :, :, 0], atol=1e-5)  # row 0: its prompt alone


def test_the_sampler_as_for_a_gpu_gives_the_same_completions(monkeypatch):
  """The static sampler's programs built as for one GPU (the seam told so) with the switch on,
  the kernel interpreted: the completions of XLA's attention over per-row caches on the CPU."""
  from epgrpo_jax.kernels import gpu
  want = completions(NUCLEUS, False)  # before the seam is told it is a GPU
  calls, kernel = [], gpu.shared_decode_attention

  def interpreted(*args, **kw):
    calls.append(args[0].shape)
    return kernel(*args, interpret=True, **kw)

  monkeypatch.setattr(seam, "backend_of", lambda mesh: "gpu")
  monkeypatch.setattr(seam, "one_device", lambda mesh: True)
  monkeypatch.setattr(gpu, "shared_decode_attention", interpreted)
  sampler = Sampler(NUCLEUS.replace(max_new_tokens=24, decode_segments=2, cpu_kernels=False,
                                    shared_prompt_cache=True), eos_ids=EOS)
  got = sampler.sample(nnx.split(tiny_model()), PROMPTS, 3, jax.random.key(1))
  assert calls, "the decode steps did not call the GPU kernel"
  assert_same_completions(got, want)


def test_gpu_shared_attention_lowers_to_the_triton_kernel_for_cuda():
  from epgrpo_jax.kernels import gpu
  b, p, k, q, hd, tp, c = 64, 8, 2, 7, 64, 256, 1024  # Qwen2.5-0.5B's heads, 8 x 8 rows
  shapes = [jax.ShapeDtypeStruct(s, d) for s, d in (
      ((b, k, q, hd), jnp.bfloat16), ((b, k, hd, c), jnp.bfloat16), ((b, k, c, hd), jnp.bfloat16),
      ((b, c), bool), ((), jnp.int32), ((p, k, hd, tp), jnp.bfloat16), ((p, k, tp, hd), jnp.bfloat16),
      ((p, tp), bool))]
  text = jax.jit(gpu.shared_decode_attention).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
  assert "__gpu$xla.gpu.triton" in text and "epgrpo_decode_attention" in text
