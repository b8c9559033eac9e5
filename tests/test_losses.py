"""Chunked log-prob/entropy against the full softmax; the clipped policy loss by hand."""

from __future__ import annotations

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from hypothesis import given
from hypothesis import strategies as st

from epgrpo_jax.core.losses import AGGREGATIONS, LossConfig, policy_loss
from epgrpo_jax.core.token_stats import naive_token_logprob_entropy, token_logprob_entropy

TOL = dict(rtol=1e-5, atol=1e-5)


def _inputs(b, t, d, v, seed=0, scale=0.5, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  hidden = jnp.asarray(rng.normal(0, scale, (b, t, d)), dtype)
  head = jnp.asarray(rng.normal(0, 1, (d, v)), dtype)
  targets = jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)
  weights = [jnp.asarray(rng.normal(size=(b, t)), jnp.float32) for _ in range(2)]
  return hidden, head, targets, weights


def _objective(fn, targets, weights):
  """A scalar mixing both outputs with random weights, so both cotangents are exercised."""
  def f(hidden, head):
    logp, entropy = fn(hidden, head, targets)
    return jnp.sum(weights[0] * logp) + jnp.sum(weights[1] * entropy), (logp, entropy)
  return jax.value_and_grad(f, argnums=(0, 1), has_aux=True)


@functools.partial(jax.jit, static_argnames=("temperature",))
def _naive_reference(hidden, head, targets, weights, temperature):
  """(logp, entropy, d hidden, d head) of the full-softmax computation, in float32."""
  naive = lambda h, w, y: naive_token_logprob_entropy(h, w, y, temperature=temperature)
  (_, outs), grads = _objective(naive, targets, weights)(hidden.astype(jnp.float32),
                                                         head.astype(jnp.float32))
  return (*outs, *grads)


# ----------------------------------------------------------------------------- log-prob + entropy


class ChunkedLogprobTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(
      ("ragged_chunks", 2, 5, 8, 37, 4, 8, 0.7),  # neither chunk divides its size
      ("one_chunk_each", 2, 3, 4, 20, 64, 64, 1.6),  # chunks larger than the sizes
  )
  def test_matches_naive_values_and_gradients(self, b, t, d, v, token_chunk, vocab_chunk, temp):
    hidden, head, targets, weights = _inputs(b, t, d, v)
    chunked = lambda h, w, y: token_logprob_entropy(
        h, w, y, temperature=temp, vocab_chunk=vocab_chunk, token_chunk=token_chunk)
    got = self.variant(_objective(chunked, targets, weights))(hidden, head)
    (_, (logp, ent)), grads = got
    self.assertEqual(logp.dtype, jnp.float32)
    self.assertEqual(ent.dtype, jnp.float32)
    want = _naive_reference(hidden, head, targets, weights, temp)
    for name, x, y in zip(("logp", "entropy", "d_hidden", "d_head"), (logp, ent, *grads), want):
      np.testing.assert_allclose(x, y, **TOL, err_msg=name)


@pytest.mark.parametrize("token_chunk,vocab_chunk", [(1, 1), (6, 11)])
def test_chunk_sizes_do_not_matter(token_chunk, vocab_chunk):
  hidden, head, targets, weights = _inputs(2, 5, 8, 37, seed=1)
  fn = lambda h, w, y: token_logprob_entropy(h, w, y, vocab_chunk=vocab_chunk,
                                             token_chunk=token_chunk, temperature=0.7)
  (_, (logp, ent)), grads = jax.jit(_objective(fn, targets, weights))(hidden, head)
  want = _naive_reference(hidden, head, targets, weights, 0.7)
  for x, y in zip((logp, ent, *grads), want):
    np.testing.assert_allclose(x, y, **TOL)


def test_large_logits_are_stable():
  hidden, head, targets, _ = _inputs(2, 6, 8, 40, seed=2, scale=60.0)  # logits ~ +-500
  logp, ent = jax.jit(lambda h, w, y: token_logprob_entropy(h, w, y, vocab_chunk=7,
                                                            token_chunk=5))(hidden, head, targets)
  logp_ref, ent_ref = naive_token_logprob_entropy(hidden, head, targets)
  assert np.all(np.isfinite(logp)) and np.all(np.asarray(ent) >= 0)
  np.testing.assert_allclose(logp, logp_ref, rtol=1e-5, atol=1e-3)
  np.testing.assert_allclose(ent, ent_ref, rtol=1e-4, atol=1e-4)


def test_uniform_logits_give_log_vocab_entropy():
  hidden = jnp.zeros((1, 3, 4))
  logp, ent = token_logprob_entropy(hidden, jnp.ones((4, 50)), jnp.array([[0, 7, 49]]),
                                    vocab_chunk=16, token_chunk=2)
  np.testing.assert_allclose(ent, math.log(50), rtol=1e-6)
  np.testing.assert_allclose(logp, -math.log(50), rtol=1e-6)


def test_bfloat16_inputs_keep_float32_math():
  hidden, head, targets, weights = _inputs(2, 5, 8, 37, seed=3, dtype=jnp.bfloat16)
  fn = lambda h, w, y: token_logprob_entropy(h, w, y, vocab_chunk=8, token_chunk=4,
                                             temperature=0.7)
  (_, (logp, ent)), (g_hidden, g_head) = jax.jit(_objective(fn, targets, weights))(hidden, head)
  assert logp.dtype == ent.dtype == jnp.float32
  assert g_hidden.dtype == g_head.dtype == jnp.bfloat16
  logp_ref, ent_ref, *grads_ref = _naive_reference(hidden.astype(jnp.float32),
                                                   head.astype(jnp.float32), targets, weights, 0.7)
  np.testing.assert_allclose(logp, logp_ref, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(ent, ent_ref, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(np.asarray(g_hidden, np.float32), grads_ref[0], rtol=2e-2, atol=2e-2)
  np.testing.assert_allclose(np.asarray(g_head, np.float32), grads_ref[1], rtol=2e-2, atol=2e-2)


def test_out_of_range_targets_are_finite_and_empty_batch():
  hidden, head, _, _ = _inputs(1, 3, 4, 10)
  logp, ent = token_logprob_entropy(hidden, head, jnp.array([[-1, 10, 3]]), vocab_chunk=4)
  assert np.all(np.isfinite(logp)) and np.all(np.isfinite(ent))
  logp, ent = token_logprob_entropy(jnp.zeros((0, 3, 4)), head, jnp.zeros((0, 3), jnp.int32))
  assert logp.shape == ent.shape == (0, 3)


def test_argument_errors():
  hidden, head, targets, _ = _inputs(1, 2, 4, 10)
  with pytest.raises(ValueError, match="temperature"):
    token_logprob_entropy(hidden, head, targets, temperature=0.0)
  with pytest.raises(ValueError, match="chunk"):
    token_logprob_entropy(hidden, head, targets, vocab_chunk=0)
  with pytest.raises(ValueError, match="shapes"):
    token_logprob_entropy(hidden, head.T, targets)


def test_memory_is_bounded_by_the_chunks():
  """Compiled (never run) forward + backward: chunked temp memory far below the naive one."""
  b, t, d, v = 2, 512, 64, 8192
  args = (jax.ShapeDtypeStruct((b, t, d), jnp.float32), jax.ShapeDtypeStruct((d, v), jnp.float32),
          jax.ShapeDtypeStruct((b, t), jnp.int32))

  def temp_bytes(fn):
    f = lambda h, w, y: jnp.sum(sum(fn(h, w, y)))
    return jax.jit(jax.grad(f, argnums=(0, 1))).lower(*args).compile().memory_analysis(
        ).temp_size_in_bytes

  chunked = temp_bytes(lambda h, w, y: token_logprob_entropy(h, w, y, vocab_chunk=1024,
                                                              token_chunk=128))
  naive = temp_bytes(naive_token_logprob_entropy)
  assert naive >= b * t * v * 4  # at least the float32 logits
  assert chunked < 16 * 128 * 1024 * 4 < naive / 4  # a few chunk-sized buffers


# ----------------------------------------------------------------------------- policy loss


def reference_loss(logp, logp_old, logp_ref, adv, mask, cfg: LossConfig):
  """float64 loops over sequences and tokens."""
  per_seq, lengths = [], []
  for b in range(logp.shape[0]):
    total = 0.0
    for t in np.flatnonzero(mask[b]):
      rho = math.exp(logp[b, t] - logp_old[b, t])
      clipped = min(max(rho, 1 - cfg.eps_low), 1 + cfg.eps_high)
      surrogate = min(rho * adv[b, t], clipped * adv[b, t])
      gap = logp_ref[b, t] - logp[b, t]
      total += -(surrogate - cfg.beta * (math.exp(gap) - gap - 1))
    per_seq.append(total)
    lengths.append(int(mask[b].sum()))
  if cfg.aggregation == "token_mean":
    return sum(per_seq) / max(sum(lengths), 1)
  if cfg.aggregation == "seq_mean_token_mean":
    means = [s / n for s, n in zip(per_seq, lengths) if n]
    return sum(means) / max(len(means), 1)
  max_len = cfg.max_len or logp.shape[1]
  return sum(s / max_len for s in per_seq) / logp.shape[0]


class PolicyLossTest(chex.TestCase):
  """Hand-computed cases, all [3, 4] with bool masks (eager runs share their kernels)."""

  @chex.variants(with_jit=True, without_jit=True)
  def test_on_policy_is_minus_mean_advantage_plus_kl(self):
    logp = jnp.array([[-1.0, -2.0, -0.5, 0.0], [-0.3, -1.0, 9.0, 0.0], [-1.0, -1.0, -1.0, -1.0]])
    ref = jnp.array([[-1.5, -2.0, -0.1, 0.0], [-0.3, -0.2, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    adv = jnp.array([[1.0, -2.0, 0.5, 0.0], [3.0, -1.0, 7.0, 0.0], [9.0, 9.0, 9.0, 9.0]])
    mask = jnp.array([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]], bool)
    cfg = LossConfig(beta=0.1)
    loss_fn = self.variant(lambda lp: policy_loss(lp, logp, ref, adv, mask, cfg))
    (loss, aux), grad = jax.value_and_grad(loss_fn, has_aux=True)(logp)
    m = np.asarray(mask)
    gap = np.asarray(ref - logp)[m]
    kl = np.exp(gap) - gap - 1
    np.testing.assert_allclose(loss, -np.asarray(adv)[m].mean() + 0.1 * kl.mean(), rtol=1e-6)
    np.testing.assert_allclose(aux["kl"], kl.mean(), rtol=1e-6)
    self.assertEqual(float(aux["clip_ratio/region_mean"]), 0.0)
    np.testing.assert_allclose(aux["ratio/mean"], 1.0)
    # d/dlogp: (-A + beta * (1 - exp(ref - logp))) / #tokens, zero on padding.
    want = np.where(m, -np.asarray(adv) + 0.1 * (1 - np.exp(np.asarray(ref - logp))), 0) / 5
    np.testing.assert_allclose(grad, want, rtol=1e-6, atol=1e-7)

  @chex.variants(with_jit=True, without_jit=True)
  def test_clipping_by_hand(self):
    # Five tokens (rho, A): (1.5, 1) clipped high, (0.5, -1) clipped low, (1.5, -1) and
    # (0.5, 1) unclipped (the pessimistic side), (1.1, 2) inside the trust region.
    rho = np.array([[1.5, 0.5, 1.5, 0.5], [1.1, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    adv = jnp.array([[1.0, -1.0, -1.0, 1.0], [2.0, 5.0, 5.0, 5.0], [5.0, 5.0, 5.0, 5.0]])
    mask = jnp.array([[1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]], bool)
    logp_old = jnp.full((3, 4), -1.0)
    logp = logp_old + jnp.log(jnp.asarray(rho, jnp.float32))
    cfg = LossConfig(beta=0.0)
    fn = self.variant(lambda lp: policy_loss(lp, logp_old, logp_old, adv, mask, cfg))
    (loss, aux), grad = jax.value_and_grad(fn, has_aux=True)(logp)
    # min(rho A, clip(rho) A) per token: 1.2, -0.8, -1.5, 0.5, 2.2.
    np.testing.assert_allclose(loss, -(1.2 - 0.8 - 1.5 + 0.5 + 2.2) / 5, rtol=1e-6)
    np.testing.assert_allclose(aux["clip_ratio/high_mean"], 0.2)
    np.testing.assert_allclose(aux["clip_ratio/low_mean"], 0.2)
    np.testing.assert_allclose(aux["clip_ratio/region_mean"], 0.4)
    # Clipped tokens get no gradient; the others -A rho / N.
    want = [[0, 0, 1.5 / 5, -0.5 / 5], [-2.2 / 5, 0, 0, 0], [0, 0, 0, 0]]
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-7)

  @chex.variants(with_jit=True, without_jit=True)
  def test_aggregations_by_hand(self):
    adv = jnp.array([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0], [5.0, 5.0, 5.0, 5.0]])
    mask = jnp.array([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], bool)
    zeros = jnp.zeros((3, 4))
    expected = {
        "token_mean": -(1 + 2 + 3 + 4) / 4,
        "seq_mean_token_mean": -(2.0 + 4.0) / 2,  # the empty sequence is left out
        "seq_sum_max_len": -(6 / 4 + 4 / 4) / 3,  # Dr.GRPO: / T, mean over all B rows
    }
    for aggregation, want in expected.items():
      cfg = LossConfig(beta=0.0, aggregation=aggregation)
      fn = self.variant(lambda a, cfg=cfg: policy_loss(zeros, zeros, zeros, a, mask, cfg))
      loss, aux = fn(adv)
      np.testing.assert_allclose(loss, want, rtol=1e-6)
      np.testing.assert_allclose(aux["loss_numerator"] / aux["loss_denominator"], want, rtol=1e-6)
    cfg = LossConfig(beta=0.0, aggregation="seq_sum_max_len", max_len=10)
    loss, _ = self.variant(lambda a: policy_loss(zeros, zeros, zeros, a, mask, cfg))(adv)
    np.testing.assert_allclose(loss, -(6 / 10 + 4 / 10) / 3, rtol=1e-6)


def test_aux_statistics():
  adv = jnp.array([[1.0, -3.0, 99.0], [2.0, 0.0, -99.0]])
  mask = jnp.array([[1, 1, 0], [1, 1, 0]])
  entropy = jnp.array([[0.5, 1.5, 50.0], [1.0, 1.0, 50.0]])
  z = jnp.zeros((2, 3))
  _, aux = policy_loss(z, z, z, adv, mask, LossConfig(), entropy)
  a = np.array([1.0, -3.0, 2.0, 0.0])
  np.testing.assert_allclose(aux["advantage/mean"], a.mean())
  np.testing.assert_allclose(aux["advantage/std"], a.std(), rtol=1e-6)
  assert (float(aux["advantage/min"]), float(aux["advantage/max"])) == (-3.0, 2.0)
  np.testing.assert_allclose(aux["entropy"], 1.0)
  assert float(aux["num_tokens"]) == 4 and float(aux["kl"]) == 0.0
  assert "entropy" not in policy_loss(z, z, z, adv, mask, LossConfig())[1]


def test_padding_garbage_changes_nothing():
  rng = np.random.default_rng(0)
  logp, old, ref = (jnp.asarray(-rng.gamma(1, 1, (3, 4)), jnp.float32) for _ in range(3))
  adv = jnp.asarray(rng.normal(size=(3, 4)), jnp.float32)
  mask = jnp.array([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], bool)
  junk = lambda x: jnp.where(mask, x, jnp.array([jnp.nan, jnp.inf, -jnp.inf, 1e30])[None, :4])
  f = lambda lp, o, r, a: policy_loss(lp, o, r, a, mask, LossConfig())[0]
  clean, g_clean = jax.value_and_grad(f)(jnp.where(mask, logp, 0), jnp.where(mask, old, 0),
                                         jnp.where(mask, ref, 0), jnp.where(mask, adv, 0))
  dirty, g_dirty = jax.value_and_grad(f)(junk(logp), junk(old), junk(ref), junk(adv))
  np.testing.assert_allclose(dirty, clean, rtol=1e-6)
  np.testing.assert_allclose(g_dirty, g_clean, rtol=1e-6)
  assert np.all(np.isfinite(g_dirty))


def test_empty_mask_is_finite():
  z = jnp.zeros((2, 3))
  for aggregation in AGGREGATIONS:
    cfg = LossConfig(aggregation=aggregation)
    loss, aux = policy_loss(z, z, z, z, jnp.zeros((2, 3), bool), cfg)
    assert float(loss) == 0.0
    assert all(np.isfinite(float(x)) for x in aux.values())


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_micro_batches_add_up_to_the_full_batch(aggregation):
  rng = np.random.default_rng(1)
  b, t = 6, 5
  logp, old, ref = (jnp.asarray(-rng.gamma(1, 0.5, (b, t)), jnp.float32) for _ in range(3))
  adv = jnp.asarray(rng.normal(size=(b, t)), jnp.float32)
  mask = jnp.asarray(np.arange(t) < rng.integers(0, t + 1, (b, 1)))
  mask = mask.at[0].set(True).at[3].set(False)
  cfg = LossConfig(aggregation=aggregation, max_len=t)
  value_and_grad = jax.value_and_grad(
      lambda lp, o, r, a, m, den: policy_loss(lp, o, r, a, m, cfg, denominator=den), has_aux=True)
  halves = [slice(0, 3), slice(3, 6)]

  @jax.jit
  def run(logp):  # everything in one compilation
    rows = lambda sl: (logp[sl], old[sl], ref[sl], adv[sl], mask[sl])
    (_, aux), _ = value_and_grad(*rows(slice(None)), 1.0)
    den = aux["loss_denominator"]
    full = value_and_grad(*rows(slice(None)), den)
    own = [value_and_grad(*rows(sl), 1.0)[0][1] for sl in halves]
    shared = [value_and_grad(*rows(sl), den) for sl in halves]
    return aux, full, own, shared

  full_aux, ((full, _), full_grad), own, shared = run(logp)
  np.testing.assert_allclose(full, full_aux["loss_numerator"] / full_aux["loss_denominator"],
                             rtol=1e-6)
  np.testing.assert_allclose(sum(a["loss_numerator"] for a in own) /
                             sum(a["loss_denominator"] for a in own), full, rtol=1e-6)
  np.testing.assert_allclose(sum(a["loss_denominator"] for a in own),
                             full_aux["loss_denominator"])
  # With the full batch's denominator, micro-batch losses and gradients simply add up.
  np.testing.assert_allclose(sum(p[0][0] for p in shared), full, rtol=1e-6)
  np.testing.assert_allclose(jnp.concatenate([p[1] for p in shared]), full_grad, rtol=1e-6,
                             atol=1e-8)


@pytest.mark.parametrize("kw,field", [
    (dict(eps_low=1.0), "eps_low"), (dict(eps_low=-0.1), "eps_low"),
    (dict(eps_high=-1), "eps_high"), (dict(beta=-1e-3), "beta"),
    (dict(aggregation="sum"), "aggregation"), (dict(max_len=0), "max_len"),
])
def test_loss_config_validation(kw, field):
  with pytest.raises(ValueError, match=rf"^loss\.{field}: "):
    LossConfig(**kw)


def test_loss_config_defaults():
  cfg = LossConfig()
  assert (cfg.eps_low, cfg.eps_high, cfg.beta, cfg.aggregation, cfg.max_len) == (
      0.2, 0.2, 0.001, "token_mean", None)


_LOSS_JIT = jax.jit(policy_loss, static_argnames=("cfg",))


@given(seed=st.integers(0, 2 ** 32 - 1), aggregation=st.sampled_from(AGGREGATIONS),
       lengths=st.lists(st.integers(0, 6), min_size=4, max_size=4))
def test_policy_loss_matches_reference(seed, aggregation, lengths):
  eps, beta = (0.2, 0.28), 0.04  # asymmetric clipping (DAPO-style), KL on
  rng = np.random.default_rng(seed)
  logp_old = -rng.gamma(1.0, 1.0, (4, 6))
  logp = logp_old + rng.normal(0, 0.3, (4, 6))
  logp_ref = logp_old + rng.normal(0, 0.3, (4, 6))
  adv = rng.normal(0, 1, (4, 6))
  mask = np.arange(6) < np.array(lengths)[:, None]
  cfg = LossConfig(eps_low=eps[0], eps_high=eps[1], beta=beta, aggregation=aggregation)
  args = [np.asarray(x, np.float32) for x in (logp, logp_old, logp_ref, adv)]
  loss, aux = _LOSS_JIT(*args, mask, cfg)
  f64 = [x.astype(np.float64) for x in args]
  np.testing.assert_allclose(loss, reference_loss(*f64, mask, cfg), rtol=1e-5, atol=1e-6)
  rho = np.exp(f64[0] - f64[1])[mask]
  a = f64[3][mask]
  high = np.mean((rho > 1 + eps[1]) & (a > 0)) if mask.any() else 0.0
  np.testing.assert_allclose(aux["clip_ratio/high_mean"], high, atol=1e-6)
