"""Sampler tests: strategies against full-sort references, and the cached loop
against full (no-cache) forward passes of a tiny fp32 model."""

import functools

import chex

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from epgrpo_jax.rollout import sampling, strategies
from epgrpo_jax.models import LORA, LoraConfig, Qwen2, lora_layers, param_rules, preset
from epgrpo_jax.rollout.sampling import Sampler, SamplingConfig, bucket
from epgrpo_jax.rollout.strategies import sample_step

# ---------------------------------------------------------------------------
# References: a full sort per row, the documented tie rule.


def ref_top_k(x_V: np.ndarray, k: int) -> np.ndarray:
  if k <= 0 or k >= x_V.size:
    return np.ones(x_V.shape, bool)
  return x_V >= np.sort(x_V)[::-1][k - 1]


def ref_top_p(p_V: np.ndarray, top_p: float):
  """(kept mask, ambiguous): keep p >= tau, tau the smallest probability of the
  shortest sorted prefix with mass >= top_p. `ambiguous` flags rows where that
  prefix's mass is so close to top_p that float summation order decides."""
  s = np.sort(p_V)[::-1].astype(np.float64)
  c = np.cumsum(s)
  reach = np.nonzero(c >= top_p)[0]
  m = reach[0] if reach.size else s.size - 1
  ambiguous = bool(np.any(np.abs(c - top_p) < 1e-5))
  return p_V >= s[m], ambiguous


def softmax_np(x):
  """The library's softmax form, so probabilities are bit-identical."""
  return np.asarray(strategies._softmax(jnp.asarray(x, jnp.float32)))


def ref_distribution(logits_V, temperature, top_k, top_p):
  """Kept set and renormalised probabilities (float64) of temperature -> top-k -> top-p."""
  x = (np.asarray(logits_V, np.float32) / np.float32(temperature)).astype(np.float32)
  keep = ref_top_k(x, top_k)
  if top_p < 1:
    p = softmax_np(np.where(keep, x, -np.inf)[None])[0]
    keep_p, ambiguous = ref_top_p(p, top_p)
    assert not ambiguous
    keep &= keep_p
  w = np.where(keep, np.exp(x.astype(np.float64) - x.max()), 0.0)
  return keep, w / w.sum()


def random_logits(seed: int, rows: int, vocab: int) -> np.ndarray:
  """Rows of varied shape: flat, peaked, and coarsely quantised (many exact ties)."""
  rng = np.random.default_rng(seed)
  scale = rng.choice([0.05, 1.0, 4.0], size=(rows, 1))
  x = rng.normal(size=(rows, vocab)) * scale
  quantised = rng.random((rows, 1)) < 0.4
  x = np.where(quantised, np.round(x * 2) / 2, x)
  return x.astype(np.float32)


# ---------------------------------------------------------------------------
# Strategies.


def test_config_validation():
  with pytest.raises(ValueError, match=r"sampling.top_p: must be in \(0, 1\], got 1.5"):
    SamplingConfig(top_p=1.5)
  with pytest.raises(ValueError, match="sampling.top_p"):
    SamplingConfig(top_p=0.0)
  with pytest.raises(ValueError, match="sampling.temperature"):
    SamplingConfig(temperature=-1.0)
  with pytest.raises(ValueError, match="sampling.top_k"):
    SamplingConfig(top_k=-2)
  with pytest.raises(ValueError, match="sampling.max_new_tokens"):
    SamplingConfig(max_new_tokens=0)
  with pytest.raises(ValueError, match="sampling.prompt_buckets"):
    SamplingConfig(prompt_buckets=(32, 16))
  with pytest.raises(ValueError, match="sampling.cache_dtype"):
    SamplingConfig(cache_dtype="int8")
  assert SamplingConfig(temperature=0.0).is_greedy and SamplingConfig(greedy=True).is_greedy
  assert bucket(1, (16, 32)) == 16 and bucket(17, (16, 32)) == 32 and bucket(70, (16, 32)) == 96


@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.999])
def test_top_p_mask_equals_full_sort(top_p):
  logits = random_logits(1, 512, 64)
  probs = softmax_np(logits)
  got = np.asarray(jax.jit(strategies.top_p_mask, static_argnums=1)(jnp.asarray(probs), top_p))
  checked = 0
  for row in range(len(probs)):
    want, ambiguous = ref_top_p(probs[row], top_p)
    if not ambiguous:
      np.testing.assert_array_equal(got[row], want, err_msg=f"row {row}")
      checked += 1
  assert checked > 400


@pytest.mark.parametrize("k", [1, 3, 20])
def test_top_k_mask_equals_full_sort(k):
  logits = random_logits(2, 256, 64)
  got = np.asarray(jax.jit(strategies.top_k_mask, static_argnums=1)(jnp.asarray(logits), k))
  want = np.stack([ref_top_k(row, k) for row in logits])
  np.testing.assert_array_equal(got, want)
  assert (got.sum(-1) > k).any()  # some rows do tie at the k-th logit


def test_top_k_mask_over_logits_of_both_signs():
  # The ordered int keys of -10 and 10 are more than 2^31 apart: the bisection's stop test
  # once overflowed there and kept every token.
  x = np.random.default_rng(4).normal(size=(64, 64)).astype(np.float32) * 8
  logits = np.concatenate([x, np.round(x / 4) * 4])  # the second half with many ties
  assert (logits.min(-1) < -4).all() and (logits.max(-1) > 4).all()
  for k in (1, 5):
    got = np.asarray(jax.jit(strategies.top_k_mask, static_argnums=1)(jnp.asarray(logits), k))
    np.testing.assert_array_equal(got, np.stack([ref_top_k(row, k) for row in logits]))
  extremes = jnp.asarray([[-3e38, -1.0, 0.0, 2.0, 3e38, 5.0]], jnp.float32)
  np.testing.assert_array_equal(strategies.top_k_mask(extremes, 2), [[0, 0, 0, 0, 1, 1]])


def test_top_k_then_top_p_equals_full_sort():
  logits = random_logits(3, 256, 64)
  got = np.asarray(jax.jit(lambda x: strategies.truncate(x, 10, 0.8))(jnp.asarray(logits)))
  for row in range(len(logits)):
    keep = ref_top_k(logits[row], 10)
    p = softmax_np(np.where(keep, logits[row], -np.inf)[None])[0]
    keep_p, ambiguous = ref_top_p(p, 0.8)
    if not ambiguous:
      np.testing.assert_array_equal(got[row], keep & keep_p, err_msg=f"row {row}")


TIES = np.log(np.array([0.3, 0.2, 0.2, 0.2, 0.05, 0.03, 0.01, 0.01], np.float32))


@pytest.mark.parametrize("logits,cfg,kept", [
    # top-p 0.6: the prefix 0.3, 0.2, 0.2 reaches it at 0.2; all three tied 0.2s kept.
    (TIES, SamplingConfig(top_p=0.6), 4),
    # top-k 2: the 2nd largest is tied three ways; all kept.
    (TIES, SamplingConfig(top_k=2), 4),
    # top-k 5 (renormalise over 0.99), then top-p 0.5 at temperature 0.5.
    (TIES, SamplingConfig(temperature=0.5, top_k=5, top_p=0.5), 4),
    (np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], np.float32), SamplingConfig(top_p=0.9), 4),
    (np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], np.float32), SamplingConfig(temperature=1.3), 6),
])
def test_sampling_frequencies_match_truncated_distribution(logits, cfg, kept):
  keep, expected = ref_distribution(logits, cfg.temperature, cfg.top_k, cfg.top_p)
  assert keep.sum() == kept
  draws = 60_000
  keys = jax.random.split(jax.random.key(7), draws)
  one = lambda key: sample_step(key, jnp.asarray(logits)[None], cfg)
  tokens, logp, entropy = jax.jit(jax.vmap(one))(keys)
  tokens = np.asarray(tokens[:, 0])
  counts = np.bincount(tokens, minlength=logits.size)
  assert counts[~keep].sum() == 0, counts
  _, p_value = stats.chisquare(counts[keep], expected[keep] * draws)
  assert p_value > 1e-3, (counts, expected * draws)
  # logp / entropy: of the temperature-scaled full distribution.
  full = jax.nn.log_softmax(jnp.asarray(logits) / cfg.temperature)
  np.testing.assert_allclose(np.asarray(logp[:, 0]), np.asarray(full)[tokens], atol=1e-6)
  np.testing.assert_allclose(np.asarray(entropy[:, 0]), -np.sum(np.exp(full) * full), atol=1e-6)


def test_categorical_never_draws_zero_weight():
  w = np.zeros((4096, 100), np.float32)
  w[:, [0, 37, 99]] = [1e-30, 0.5, 0.25]
  tokens = np.asarray(jax.jit(strategies.categorical)(jax.random.key(0), jnp.asarray(w)))
  assert set(np.unique(tokens)) <= {0, 37, 99}
  assert abs((tokens == 37).mean() - 2 / 3) < 0.03


# ---------------------------------------------------------------------------
# The sampler on a tiny model.

BUCKETS = dict(prompt_buckets=(8, 16), length_buckets=(8, 16))
PROMPTS = [[5, 17, 33, 2, 60, 8, 71, 9], [44, 3, 90, 12, 7, 7, 21, 30, 65, 11, 4, 56]]


@pytest.fixture(scope="module")
def model():
  """test-tiny in fp32 with a sharper output head, so argmaxes are never near-ties."""
  m = Qwen2(preset("test-tiny"), rngs=nnx.Rngs(0))
  m.lm_head[...] = m.lm_head[...] * 30.0
  return m


@functools.lru_cache(maxsize=None)
def _full_logits_fn(graphdef):
  @jax.jit
  def full_logits(state, ids_BxL, mask_BxL):
    m = nnx.merge(graphdef, state)
    positions = jnp.maximum(jnp.cumsum(mask_BxL, -1) - 1, 0)
    hidden, _ = m(ids_BxL, positions, mask_BxL)
    return m.logits(hidden)
  return full_logits


def full_logits(model, ids_BxL, mask_BxL):
  graphdef, state = nnx.split(model)
  return _full_logits_fn(graphdef)(state, jnp.asarray(ids_BxL), jnp.asarray(mask_BxL))


def sequences(out: sampling.SampleOutput):
  """Prompt ++ completion rows [P * G, Tp + N] and their mask."""
  p, g, n = out.tokens.shape
  prompt_ids = np.repeat(np.asarray(out.prompt_ids), g, 0)
  prompt_mask = np.repeat(np.asarray(out.prompt_mask), g, 0)
  ids = np.concatenate([prompt_ids, np.asarray(out.tokens).reshape(p * g, n)], 1)
  mask = np.concatenate([prompt_mask, np.asarray(out.mask).reshape(p * g, n)], 1)
  return ids, mask


@pytest.fixture(scope="module")
def greedy_sampler():
  return Sampler(SamplingConfig(greedy=True, max_new_tokens=12, **BUCKETS), eos_ids=(1,))


def test_greedy_equals_stepwise_argmax_of_full_forward(model, greedy_sampler):
  out = greedy_sampler.sample(model, PROMPTS, 2, jax.random.key(0), eos_ids=(-5,))
  assert out.tokens.shape == (2, 2, 12) and out.prompt_ids.shape == (2, 16)
  np.testing.assert_array_equal(out.tokens[:, 0], out.tokens[:, 1])
  assert np.asarray(out.mask).all() and (np.asarray(out.lengths) == 12).all()
  ids = np.zeros((2, 16 + 12), np.int32)
  mask = np.zeros((2, 16 + 12), bool)
  ids[:, :16], mask[:, :16] = out.prompt_ids, out.prompt_mask
  for i in range(12):
    logits = full_logits(model, ids, mask)[:, 16 + i - 1]
    ids[:, 16 + i], mask[:, 16 + i] = np.argmax(logits, -1), True
  np.testing.assert_array_equal(np.asarray(out.tokens[:, 0]), ids[:, 16:])
  # Greedy log-probs and entropies are those of temperature 1.
  ref = jax.nn.log_softmax(full_logits(model, ids, mask)[:, 15:-1])
  logp = np.take_along_axis(np.asarray(ref), ids[:, 16:, None], -1)[..., 0]
  np.testing.assert_allclose(np.asarray(out.logp[:, 0]), logp, atol=1e-5)


def test_bfloat16_cache_agrees_with_float32(model, greedy_sampler):
  # sampling.cache_dtype=bfloat16 halves the KV cache of a float32 model: keys and values are
  # rounded to 8 bits of mantissa when written. Greedy tokens agree until the first near-tie;
  # on the common prefix the log-probs differ by a bounded amount.
  want = greedy_sampler.sample(model, PROMPTS, 2, jax.random.key(0), eos_ids=(-5,))
  bf16 = Sampler(greedy_sampler.config.replace(cache_dtype="bfloat16"), eos_ids=(1,))
  got = bf16.sample(model, PROMPTS, 2, jax.random.key(0), eos_ids=(-5,))
  tokens, ref = np.asarray(got.tokens), np.asarray(want.tokens)
  same_prefix = np.cumprod(tokens == ref, axis=-1).astype(bool)
  diff = np.abs(np.asarray(got.logp) - np.asarray(want.logp))[same_prefix]
  print(f"\nbf16 vs fp32 cache: {same_prefix.mean():.0%} of greedy tokens on the common prefix, "
        f"max |logp diff| there {diff.max():.2e}")
  assert same_prefix[..., :4].all() and same_prefix.mean() >= 0.75
  assert diff.max() < 2e-2 and diff.mean() < 5e-3


def test_eos_stops_a_row_and_masks_the_rest(model, greedy_sampler):
  free = np.asarray(greedy_sampler.sample(model, PROMPTS, 2, jax.random.key(0), eos_ids=(-5,)).tokens[:, 0])
  # A stop id that row 0 first produces at step >= 2 and row 1 never produces.
  stop = next(t for i, t in enumerate(free[0]) if i >= 2 and t not in free[0][:i] and t not in free[1])
  k = int(np.argmax(free[0] == stop))
  before = greedy_sampler.num_compilations
  out = greedy_sampler.sample(model, PROMPTS, 2, jax.random.key(0), eos_ids=(int(stop),))
  assert greedy_sampler.num_compilations == before  # stop ids are an argument, not a constant
  tokens, mask, logp = (np.asarray(a) for a in (out.tokens, out.mask, out.logp))
  np.testing.assert_array_equal(np.asarray(out.lengths), [[k + 1] * 2, [12] * 2])
  np.testing.assert_array_equal(tokens[0, :, :k + 1], np.broadcast_to(free[0, :k + 1], (2, k + 1)))
  assert (tokens[0, :, k + 1:] == 0).all()  # the pad id
  assert mask[0, :, :k + 1].all() and not mask[0, :, k + 1:].any()
  assert (logp[0, :, k + 1:] == 0).all() and (logp[0, :, :k + 1] < 0).all()
  np.testing.assert_array_equal(tokens[1, 0], free[1])
  assert mask[1].all()


def test_ignore_eos_always_writes_max_new_tokens(model, greedy_sampler):
  free = np.asarray(greedy_sampler.sample(model, PROMPTS, 1, jax.random.key(0), eos_ids=(-5,)).tokens)
  stop = int(free[0, 0, 1])  # row 0 produces it at step 1
  ignoring = Sampler(greedy_sampler.config.replace(ignore_eos=True), eos_ids=(stop,))
  out = ignoring.sample(model, PROMPTS, 1, jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(out.tokens), free)
  assert np.asarray(out.mask).all() and (np.asarray(out.lengths) == 12).all()
  out = ignoring.sample(model, PROMPTS, 1, jax.random.key(0), eos_ids=(stop,))  # per call too
  assert (np.asarray(out.lengths) == 12).all()


def test_left_padded_prompt_continues_like_unpadded(model, greedy_sampler):
  padded = greedy_sampler.sample(model, PROMPTS, 1, jax.random.key(0), eos_ids=(-5,))
  alone = greedy_sampler.sample(model, PROMPTS[:1] + [[3] * 8], 1, jax.random.key(0), eos_ids=(-5,))
  assert padded.prompt_ids.shape == (2, 16) and alone.prompt_ids.shape == (2, 8)
  assert not np.asarray(padded.prompt_mask)[0, :8].any() and np.asarray(alone.prompt_mask).all()
  np.testing.assert_array_equal(np.asarray(padded.tokens[0]), np.asarray(alone.tokens[0]))
  np.testing.assert_allclose(np.asarray(padded.logp[0]), np.asarray(alone.logp[0]), atol=1e-5)


@pytest.fixture(scope="module")
def nucleus_sampler():
  return Sampler(SamplingConfig(temperature=0.7, top_p=0.9, max_new_tokens=16, **BUCKETS),
                 eos_ids=(1,))


def assert_matches_scoring_pass(model, out: sampling.SampleOutput, temperature: float, top_p: float,
                                atol: float = 1e-5):
  """Sampled log-probs and entropies equal a full forward's; every token is in its top-p set."""
  ids, mask = sequences(out)
  tp = out.prompt_ids.shape[1]
  logits = np.asarray(full_logits(model, ids, mask))[:, tp - 1:-1] / np.float32(temperature)
  logp_full = np.asarray(jax.nn.log_softmax(jnp.asarray(logits)))
  logp = np.take_along_axis(logp_full, ids[:, tp:, None], -1)[..., 0]
  entropy = -np.sum(np.exp(logp_full) * logp_full, -1)
  m = mask[:, tp:]
  assert m.sum() > 40
  np.testing.assert_allclose(np.asarray(out.logp).reshape(m.shape)[m], logp[m], atol=atol)
  np.testing.assert_allclose(np.asarray(out.entropy).reshape(m.shape)[m], entropy[m], atol=atol)
  assert (np.asarray(out.logp).reshape(m.shape)[~m] == 0).all()
  for row, col in zip(*np.nonzero(m)):
    keep, ambiguous = ref_top_p(softmax_np(logits[row, col][None])[0], top_p)
    assert ambiguous or keep[ids[row, tp + col]]


def test_logp_and_entropy_equal_a_scoring_pass(model, nucleus_sampler):
  assert_matches_scoring_pass(model, nucleus_sampler.sample(model, PROMPTS, 4, jax.random.key(3)),
                              0.7, 0.9)


@pytest.mark.parametrize("merge_lora", [True, False])
def test_lora_policy_is_sampled_with_its_adapters(merge_lora, nucleus_sampler):
  """With adapters folded into the kernels for the decode (the default) or applied at every
  step, the sampled log-probs are the adapted policy's; the caller's model is untouched."""
  lora_model = Qwen2(preset("test-tiny"), lora=LoraConfig(rank=4, alpha=8.0), rngs=nnx.Rngs(0))
  lora_model.lm_head[...] = lora_model.lm_head[...] * 30.0
  rng = np.random.default_rng(1)
  for _, var in nnx.to_flat_state(nnx.state(lora_model, LORA)):
    var.set_value(jnp.asarray(0.05 * rng.standard_normal(var.shape), jnp.float32))
  before = jax.tree.map(np.asarray, nnx.state(lora_model))
  sampler = Sampler(nucleus_sampler.config.replace(merge_lora=merge_lora), eos_ids=(1,))
  out = sampler.sample(lora_model, PROMPTS, 4, jax.random.key(3))
  assert_matches_scoring_pass(lora_model, out, 0.7, 0.9)
  base = nnx.clone(lora_model)  # the same weights with the adapters zeroed
  for layer in lora_layers(base):
    layer.lora_b[...] = jnp.zeros_like(layer.lora_b[...])
  with pytest.raises(AssertionError):  # so the adapters matter to this check
    assert_matches_scoring_pass(base, out, 0.7, 0.9)
  assert not any(layer.merged for layer in lora_layers(lora_model))
  chex.assert_trees_all_equal(jax.tree.map(np.asarray, nnx.state(lora_model)), before)


def test_same_key_same_output_and_no_recompilation(model, nucleus_sampler):
  a = nucleus_sampler.sample(model, PROMPTS, 4, jax.random.key(11))
  count = nucleus_sampler.num_compilations
  b = nucleus_sampler.sample(model, PROMPTS, 4, jax.random.key(11))
  c = nucleus_sampler.sample(model, PROMPTS, 4, jax.random.key(12))
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert not np.array_equal(np.asarray(a.tokens), np.asarray(c.tokens))
  # Other prompt lengths in the same bucket, fewer new tokens, new weights: same program.
  ragged = [[9, 8, 7], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]]
  short = nucleus_sampler.sample(model, ragged, 4, jax.random.key(1), max_new_tokens=10)
  assert short.tokens.shape == (2, 4, 10)
  graphdef, state = nnx.split(model)
  state = jax.tree.map(lambda x: x * 1.01, state)
  nucleus_sampler.sample((graphdef, state), PROMPTS, 4, jax.random.key(1))
  assert nucleus_sampler.num_compilations == count


def test_prompts_as_padded_arrays(nucleus_sampler):
  ids = np.array([[4, 5, 6, 0, 0], [7, 8, 9, 10, 11]])
  mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
  got_ids, got_mask = nucleus_sampler.prepare_prompts((ids, mask))
  want_ids, want_mask = nucleus_sampler.prepare_prompts([[4, 5, 6], [7, 8, 9, 10, 11]])
  np.testing.assert_array_equal(got_ids, want_ids)
  np.testing.assert_array_equal(got_mask, want_mask)
  assert got_ids.shape == (2, 8) and got_ids[0].tolist() == [0] * 5 + [4, 5, 6]
  with pytest.raises(ValueError, match=r"prompts\[1\]: empty"):
    nucleus_sampler.prepare_prompts([[1], []])


def test_sharded_sampling_matches_single_device(model, greedy_sampler, caplog):
  from epgrpo_jax.parallel import sharding
  mesh = sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=2, tensor=2))
  graphdef, state = nnx.split(model)
  state = jax.device_put(state, sharding.state_shardings(state, mesh, param_rules(model.cfg)))
  sharded = Sampler(greedy_sampler.config, eos_ids=(-5,), mesh=mesh)
  with caplog.at_level("INFO", logger="epgrpo_jax.rollout.sampling"):
    got = sharded.sample((graphdef, state), PROMPTS, 2, jax.random.key(0))
  assert sharded.num_compilations == 2 and not uses_cpu_kernel(sharded)  # prepare + sample: XLA's, over 8 devices
  assert "prompts=2 prompt_len=16 gen_len=16 samples=2" in caplog.text
  want = greedy_sampler.sample(model, PROMPTS, 2, jax.random.key(0), eos_ids=(-5,))
  np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
  np.testing.assert_allclose(np.asarray(got.logp), np.asarray(want.logp), atol=1e-5)


def test_weights_on_another_mesh_are_prepared_there_and_moved(model, greedy_sampler):
  # The policy's weights split over fsdp (a training mesh); the sampler's own mesh replicates
  # them: they are prepared where they lie, then moved, and sample as on one device.
  from epgrpo_jax.parallel import sharding
  training = sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=8))
  own = sharding.make_mesh(sharding.MeshConfig(data=8))
  graphdef, state = nnx.split(model)
  state = jax.device_put(state, sharding.state_shardings(state, training, param_rules(model.cfg)))
  sampler = Sampler(greedy_sampler.config, eos_ids=(-5,), mesh=own)
  weights = sampler.prepared(graphdef, state)
  assert {x.sharding.mesh for x in jax.tree.leaves(weights)} == {own}
  assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(weights))
  got = sampler.sample((graphdef, state), PROMPTS, 2, jax.random.key(0))
  want = greedy_sampler.sample(model, PROMPTS, 2, jax.random.key(0), eos_ids=(-5,))
  np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
  np.testing.assert_allclose(np.asarray(got.logp), np.asarray(want.logp), atol=1e-5)


# ---------------------------------------------------------------------------
# The C++ decode-attention kernel (CPU).


class TestCpuDecodeAttention(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_matches_xla_attention(self):
    from epgrpo_jax.kernels import cpu as cpu_kernels
    from epgrpo_jax.models import attend
    assert cpu_kernels.available()  # the test machines have a C++ compiler
    b, k, g, hd, s = 3, 2, 3, 40, 45  # blocks of 32 and 8 slots / head-dim columns, and tails
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((b, k, g, hd)), jnp.float32)
    keys = jnp.asarray(rng.standard_normal((b, k, hd, s)), jnp.float32)
    values = jnp.asarray(rng.standard_normal((b, k, s, hd)), jnp.float32)
    allowed = jnp.asarray(rng.random((b, s)) < 0.7).at[2].set(False)  # row 2: no allowed slot
    kernel = self.variant(cpu_kernels.decode_attention)
    for limit in (1, 7, 40, s):
      got = kernel(q, keys, values, allowed, limit)
      visible = allowed & (jnp.arange(s) < limit)[None]
      want = attend(q[:, :, :, None], keys, values, visible[:, None])[:, :, :, 0]
      chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-5)
    # Row 2 has no allowed slot: uniform weights over all slots, as the finite mask gives.
    chex.assert_trees_all_close(got[2], jnp.broadcast_to(values[2].mean(1)[:, None], (k, g, hd)),
                                atol=1e-5)

  @chex.variants(with_jit=True, without_jit=True)
  def test_reads_shared_slots_from_each_groups_first_row(self):
    from epgrpo_jax.kernels import cpu as cpu_kernels
    from epgrpo_jax.models import attend
    b, k, g, hd, s, shared = 6, 2, 2, 64, 50, 33  # 2 groups of 3 rows
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((b, k, g, hd)), jnp.float32)
    keys = jnp.asarray(rng.standard_normal((b, k, hd, s)), jnp.float32)
    values = jnp.asarray(rng.standard_normal((b, k, s, hd)), jnp.float32)
    allowed = jnp.asarray(rng.random((b, s)) < 0.8)
    # What the kernel must see: every row's first `shared` slots replaced by its group leader's.
    leader = np.repeat(np.arange(0, b, 3), 3)
    seen_keys = keys.at[:, :, :, :shared].set(keys[leader][:, :, :, :shared])
    seen_values = values.at[:, :, :shared].set(values[leader][:, :, :shared])
    kernel = self.variant(functools.partial(cpu_kernels.decode_attention, share_rows=3,
                                            shared_slots=shared))
    for limit in (20, s):
      visible = (allowed & (jnp.arange(s) < limit)[None])[:, None]
      want = attend(q[:, :, :, None], seen_keys, seen_values, visible)[:, :, :, 0]
      chex.assert_trees_all_close(kernel(q, keys, values, allowed, limit), want, atol=1e-5)
      assert not np.allclose(want, attend(q[:, :, :, None], keys, values, visible)[:, :, :, 0])


  @chex.variants(with_jit=True, without_jit=True)
  def test_a_bfloat16_cache_is_read_as_its_float32_widening(self):
    from epgrpo_jax.kernels import cpu as cpu_kernels
    assert cpu_kernels.available()
    b, k, g, hd, s, shared = 4, 2, 3, 40, 45, 9  # 2 groups of 2 rows; tails of 8 and 32
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.standard_normal((b, k, g, hd)), jnp.bfloat16)
    keys = jnp.asarray(rng.standard_normal((b, k, hd, s)), jnp.bfloat16)
    values = jnp.asarray(rng.standard_normal((b, k, s, hd)), jnp.bfloat16)
    allowed = jnp.asarray(rng.random((b, s)) < 0.7).at[3].set(False)
    kernel = self.variant(functools.partial(cpu_kernels.decode_attention, share_rows=2,
                                            shared_slots=shared))
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    for limit in (1, 7, s):
      got = kernel(q, keys, values, allowed, limit)
      assert got.dtype == jnp.bfloat16
      want = kernel(f32(q), f32(keys), f32(values), allowed, limit)  # the float32 kernel
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want.astype(jnp.bfloat16)))


class TestCpuLargestThreshold(chex.TestCase):
  """The C++ `largest_threshold` (top-k / top-p) against the XLA one and a full sort."""

  @chex.variants(with_jit=True, without_jit=True)
  def test_top_k_thresholds_equal_xla(self):
    from epgrpo_jax.kernels import cpu as cpu_kernels
    assert cpu_kernels.available()
    logits = jnp.asarray(random_logits(5, 96, 61) * 4)  # both signs, ties, a tail of 5 lanes
    kernel = self.variant(cpu_kernels.largest_threshold)
    for k in (1, 3, 20, 61):
      target = jnp.full((96,), k, jnp.float32)
      got = kernel(logits, jnp.ones_like(logits), target)
      np.testing.assert_array_equal(got, strategies.largest_threshold(logits, jnp.ones_like(logits), target))
      np.testing.assert_array_equal(np.asarray(logits) >= np.asarray(got)[:, None],
                                    np.stack([ref_top_k(row, k) for row in np.asarray(logits)]))

  @chex.variants(with_jit=True, without_jit=True)
  def test_top_p_thresholds_equal_a_full_sort(self):
    from epgrpo_jax.kernels import cpu as cpu_kernels
    probs = softmax_np(random_logits(6, 256, 203))
    kernel = self.variant(cpu_kernels.largest_threshold)
    for top_p in (0.3, 0.9, 0.999):
      target = jnp.full((256,), top_p, jnp.float32)
      got = np.asarray(kernel(jnp.asarray(probs), jnp.asarray(probs), target))
      xla = np.asarray(strategies.largest_threshold(jnp.asarray(probs), jnp.asarray(probs), target))
      checked = 0
      for row in range(len(probs)):
        want, ambiguous = ref_top_p(probs[row], top_p)
        if not ambiguous:
          np.testing.assert_array_equal(probs[row] >= got[row], want, err_msg=f"row {row}")
          assert got[row] == xla[row]
          checked += 1
      assert checked > 200

  def test_thresholds_at_a_large_vocabulary_equal_xla(self):
    # Rows of 20,000 values: after the first passes the kernel sweeps only the values left
    # inside its bracket (and the mass above it); the thresholds must not change.
    from epgrpo_jax.kernels import cpu as cpu_kernels
    assert cpu_kernels.available()
    probs = jnp.asarray(softmax_np(random_logits(7, 12, 20000) * 3))
    for top_p in (0.5, 0.95):
      target = jnp.full((12,), top_p, jnp.float32)
      got = cpu_kernels.largest_threshold(probs, probs, target)
      np.testing.assert_array_equal(got, strategies.largest_threshold(probs, probs, target))
    logits = jnp.asarray(random_logits(8, 12, 20000))
    for k in (1, 50, 19999):
      target = jnp.full((12,), k, jnp.float32)
      np.testing.assert_array_equal(
          cpu_kernels.largest_threshold(logits, jnp.ones_like(logits), target),
          strategies.largest_threshold(logits, jnp.ones_like(logits), target))

  def test_unreachable_target_gives_the_smallest_value(self):
    from epgrpo_jax.kernels import cpu as cpu_kernels
    values = jnp.asarray([[0.5, -2.0, 7.0, 1.0], [3.0, 3.0, 3.0, 3.0]], jnp.float32)
    got = cpu_kernels.largest_threshold(values, jnp.ones_like(values), jnp.asarray([9.0, 2.0]))
    np.testing.assert_array_equal(got, [-2.0, 3.0])

  def test_negative_and_positive_zero_are_one_value(self):
    # -0.0 == 0.0: with separate keys for them the bisection once never ended.
    from epgrpo_jax.kernels import cpu as cpu_kernels
    values = jnp.asarray([[-0.0, 0.0, 1.0, -1.0, -0.0], [0.0, -0.0, -0.0, -2.0, 3.0]], jnp.float32)
    for k in (1, 2, 3, 4):
      target = jnp.full((2,), k, jnp.float32)
      got = cpu_kernels.largest_threshold(values, jnp.ones_like(values), target)
      np.testing.assert_array_equal(got, strategies.largest_threshold(values, jnp.ones_like(values), target))


class TestCpuNucleusDraw(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_draws_what_sample_step_draws(self):
    from epgrpo_jax.kernels import cpu as cpu_kernels
    assert cpu_kernels.available()
    logits = jnp.asarray(random_logits(9, 64, 203) * 3)  # flat, peaked and tied rows
    for temperature, top_p in ((1.0, 0.95), (0.7, 0.5), (1.3, 1.0)):
      cfg = SamplingConfig(temperature=temperature, top_p=top_p)
      draw = self.variant(functools.partial(cpu_kernels.nucleus_draw, temperature=temperature,
                                            top_p=top_p))
      for seed in range(3):
        got = draw(jax.random.key(seed), logits)
        want = sample_step(jax.random.key(seed), logits, cfg)
        assert got[0].dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
        chex.assert_trees_all_close(got[1:], want[1:], atol=1e-5, rtol=1e-5)

  def test_keeps_to_the_nucleus_at_a_real_vocabulary(self):
    # At V = 151,936 the draw's running sum (C++, float64) and sample_step's block sums
    # (float32) may round a draw across a token boundary, so the tokens are checked for
    # membership and their log-probs and entropies against the reference, not for equality.
    from epgrpo_jax.kernels import cpu as cpu_kernels
    assert cpu_kernels.available()
    logits = jnp.asarray(random_logits(10, 8, 151936) * 4)
    got = cpu_kernels.nucleus_draw(jax.random.key(0), logits, 1.0, 0.9)
    tokens = np.asarray(got[0])
    keep = np.asarray(strategies.truncate(logits, top_p=0.9))
    assert keep[np.arange(8), tokens].all()
    want = strategies.log_prob_and_entropy(logits, got[0])
    chex.assert_trees_all_close(got[1:], want, atol=1e-5, rtol=1e-5)


def uses_cpu_kernel(sampler: Sampler) -> bool:
  """Whether the sampler's program calls the C++ kernels (attention and the token choice:
  the whole draw with top-k off and T > 0, else the thresholds; all, or none)."""
  text = list(sampler._programs.values())[-1].as_text()  # the sampling program (after the weights' own)
  cfg = sampler.config
  choice = ("epgrpo_nucleus_draw" if not cfg.is_greedy and cfg.top_k == 0
            else "epgrpo_largest_threshold")
  attention = "epgrpo_decode_attention" in text
  assert attention == (choice in text), text
  return attention


def test_sampler_decodes_with_the_cpu_kernel_like_xla(model):
  from epgrpo_jax.parallel import sharding
  config = SamplingConfig(temperature=0.7, top_p=0.9, max_new_tokens=16, **BUCKETS)
  with_xla = Sampler(config.replace(cpu_kernels=False))
  want = with_xla.sample(model, PROMPTS, 4, jax.random.key(3))
  one_device = sharding.make_mesh(devices=jax.devices()[:1])  # as the trainer runs on one CPU
  for with_kernel in (Sampler(config), Sampler(config, mesh=one_device)):
    got = with_kernel.sample(model, PROMPTS, 4, jax.random.key(3))
    assert uses_cpu_kernel(with_kernel) and not uses_cpu_kernel(with_xla)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_allclose(np.asarray(got.logp), np.asarray(want.logp), atol=1e-5)
    np.testing.assert_allclose(np.asarray(got.entropy), np.asarray(want.entropy), atol=1e-5)


def test_cpu_kernel_without_a_compiler_falls_back_to_xla(model, tmp_path, monkeypatch, caplog):
  from epgrpo_jax.kernels import cpu as cpu_kernels
  with pytest.raises(RuntimeError, match="compiler '/no/such/c\\+\\+' not found"):
    cpu_kernels.build("/no/such/c++", tmp_path)
  with pytest.raises(RuntimeError, match="false failed on cpu.cc"):
    cpu_kernels.build("false", tmp_path)  # a "compiler" that exits 1
  assert not list(tmp_path.iterdir())  # no partial library left behind
  monkeypatch.setenv("CXX", "/no/such/c++")
  monkeypatch.setenv("EPGRPO_KERNEL_DIR", str(tmp_path))
  with caplog.at_level("WARNING", logger="epgrpo_jax.models"):
    assert not cpu_kernels.available.__wrapped__()
  assert "kernels unavailable, using XLA's attention and thresholds" in caplog.text
  monkeypatch.setattr(cpu_kernels, "available", lambda: False)
  sampler = Sampler(SamplingConfig(greedy=True, max_new_tokens=8, **BUCKETS))
  out = sampler.sample(model, PROMPTS, 1, jax.random.key(0))
  assert not uses_cpu_kernel(sampler)
  assert np.asarray(out.mask).all()
