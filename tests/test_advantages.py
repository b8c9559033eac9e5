"""EP-GRPO advantages: literal oracles, a loop-by-loop numpy reference, properties."""

from __future__ import annotations

import math
from fractions import Fraction

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from epgrpo_jax.core.advantages import (VARIANTS, AdvantageConfig, compute_advantages,
                                   compute_advantages_jit)

P, G, T = 3, 4, 7
WIDE_T = T + 4  # the padding-invariance shape


# ----------------------------------------------------------------------------- reference


def reference(rewards, entropy, logp_old, logp_ref, mask, cfg: AdvantageConfig) -> dict:
  """Slow, obvious implementation of spec sections 1-5 with explicit loops.

  float64 throughout; buckets are decided with exact rationals (the inputs of
  the reference tests are dyadic, so their float sums are exact).
  """
  num_p, num_g, num_t = entropy.shape
  k_buckets = cfg.num_buckets
  out = {name: np.zeros((num_p, num_g, num_t)) for name in ("adv", "gate", "tau", "progress")}
  out["bucket"] = np.zeros((num_p, num_g, num_t), np.int64)
  out["outcome"] = np.zeros((num_p, num_g))
  out["anchor"] = np.zeros((num_p, num_g))
  out["zero_variance"] = np.zeros((num_p,), bool)
  for p in range(num_p):
    r = [float(x) for x in rewards[p]]
    mean_r = sum(r) / num_g
    dof = num_g - cfg.std_ddof
    std_r = math.sqrt(sum((x - mean_r) ** 2 for x in r) / dof) if dof > 0 else 0.0
    zero_var = std_r < cfg.zero_std_tol
    out["zero_variance"][p] = zero_var
    a = [0.0 if zero_var else (x - mean_r) / (std_r + cfg.delta) for x in r]
    out["outcome"][p] = a
    tokens = [(g, t) for g in range(num_g) for t in range(num_t) if mask[p, g, t]]
    hs = [float(entropy[p, g, t]) for g, t in tokens]
    mu = sum(hs) / len(hs) if hs else 0.0
    sigma = math.sqrt(sum((h - mu) ** 2 for h in hs) / len(hs)) if hs else 0.0
    signal = {}
    for g in range(num_g):
      if zero_var:
        d = (float(np.sign(r[g] - cfg.reward_threshold)) if cfg.zero_variance_anchor else 0.0)
      else:
        d = float(np.sign(a[g]))
      out["anchor"][p, g] = d
      idx = [t for t in range(num_t) if mask[p, g, t]]
      total = sum(max(float(entropy[p, g, t]), 0.0) for t in idx)
      cum = 0.0
      for k, t in enumerate(idx):
        cum += max(float(entropy[p, g, t]), 0.0)
        num, den = (cum, total) if total > 0 else (k + 1, len(idx))
        out["tau"][p, g, t] = num / den
        out["bucket"][p, g, t] = min(math.floor(Fraction(num) * k_buckets / Fraction(den)),
                                     k_buckets - 1)
        h = float(entropy[p, g, t])
        if cfg.entropy_gate:
          out["gate"][p, g, t] = 1.0 / (1.0 + math.exp(-cfg.gamma * (h - mu) / (sigma + cfg.eps)))
        else:
          out["gate"][p, g, t] = 1.0
        signal[g, t] = d * cfg.lam * (float(logp_old[p, g, t]) - float(logp_ref[p, g, t]))
    if cfg.progress_signal:
      for k in range(k_buckets):
        members = [gt for gt in tokens if out["bucket"][p][gt] == k]
        values = [signal[gt] for gt in members]
        if len(values) <= 1 or all(v == values[0] for v in values):
          continue  # z = 0
        m_k = sum(values) / len(values)
        s_k = math.sqrt(sum((v - m_k) ** 2 for v in values) / len(values))
        for gt, v in zip(members, values):
          out["progress"][p][gt] = cfg.eta * (v - m_k) / (s_k + cfg.eps)
    for g, t in tokens:
      out["adv"][p, g, t] = out["gate"][p, g, t] * a[g] + out["progress"][p, g, t]
  return out


def assert_close(got, want, tol, what=""):
  """`np.testing.assert_allclose(rtol=atol=tol)`, with a fast path (this runs thousands of times)."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  if not (got.shape == want.shape and np.allclose(got, want, rtol=tol, atol=tol)):
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=what)


def assert_equal(got, want, what=""):
  if not np.array_equal(np.asarray(got), np.broadcast_to(want, np.shape(got))):
    np.testing.assert_array_equal(got, want, err_msg=what)


def check_against_reference(got_adv, comps, ref, mask):
  m = np.asarray(mask, bool)
  assert_equal(comps.zero_variance, ref["zero_variance"], "zero_variance")
  assert_close(comps.outcome, ref["outcome"], 1e-5, "outcome")
  assert_equal(comps.anchor, ref["anchor"], "anchor")
  assert_equal(comps.bucket, ref["bucket"], "bucket")
  assert_close(comps.tau, ref["tau"], 1e-6, "tau")
  assert_close(np.where(m, comps.gate, 0), np.where(m, ref["gate"], 0), 1e-5, "gate")
  assert_close(comps.progress, ref["progress"], 1e-4, "progress")
  assert_close(got_adv, ref["adv"], 1e-4, "advantage")


# ----------------------------------------------------------------------------- inputs


@st.composite
def batches(draw, num_p=P, num_g=G, num_t=T, dyadic=True):
  """Random inputs of one fixed shape (one compilation per test).

  Hypothesis draws the structure (reward pattern per group, scattered or
  prefix masks) and a seed; a seeded RNG fills in lengths and values,
  over-weighting the edges (empty and length-1 responses, full rows, zero
  entropy). `dyadic` keeps entropies and log-probs on grids of multiples of
  1/8 and 1/4, so float sums are exact and the reference can decide bucket
  boundaries with exact rationals. Padding holds garbage (nan, inf, 1e30).
  """
  rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
  scattered = draw(st.booleans())
  kinds = draw(st.lists(st.sampled_from(["binary", "same", "grid", "threshold"]),
                        min_size=num_p, max_size=num_p))
  shape = (num_p, num_g, num_t)
  edge = rng.choice([0, 1, num_t, -1], (num_p, num_g), p=[0.1, 0.1, 0.2, 0.6])
  lengths = np.where(edge >= 0, edge, rng.integers(0, num_t + 1, (num_p, num_g)))
  if scattered:
    order = np.argsort(rng.random(shape), axis=-1)
    mask = order < lengths[..., None]
  else:
    mask = np.arange(num_t) < lengths[..., None]
  rewards = np.zeros((num_p, num_g), np.float32)
  for p, kind in enumerate(kinds):
    if kind == "binary":
      rewards[p] = rng.integers(0, 2, num_g)
    elif kind == "same":
      rewards[p] = rng.choice([0.0, 0.25, 1.0])
    elif kind == "threshold":
      rewards[p] = 0.5  # zero variance, exactly at the anchor threshold: d = 0
    else:
      rewards[p] = rng.integers(0, 5, num_g) / 4
  if dyadic:
    entropy = rng.integers(0, 33, shape) / 8
    logp_old = -rng.integers(0, 17, shape) / 4
    logp_ref = -rng.integers(0, 17, shape) / 4
  else:
    entropy = rng.gamma(1.0, 1.0, shape)
    logp_old = -rng.gamma(1.0, 1.0, shape)
    logp_ref = logp_old + rng.normal(0, 0.5, shape)
  entropy = np.where(rng.random((num_p, num_g, 1)) < 0.15, 0.0, entropy)
  garbage = rng.choice([np.nan, np.inf, -np.inf, 1e30, -7.0], (3,) + shape)
  entropy, logp_old, logp_ref = (np.where(mask, x, junk).astype(np.float32)
                                 for x, junk in zip((entropy, logp_old, logp_ref), garbage))
  return rewards, entropy, logp_old, logp_ref, mask


def run(batch, cfg):
  adv, comps = compute_advantages_jit(*batch, cfg)
  return np.asarray(adv), jax.tree.map(np.asarray, comps)


def check_structure(adv, comps, mask, cfg):
  """Invariants every output must satisfy, whatever the inputs."""
  pad = ~mask
  for name in ("gate", "outcome_token", "signal", "tau", "bucket", "progress"):
    assert_equal(getattr(comps, name)[pad], 0, name)
  assert_equal(adv[pad], 0, "advantage on padding")
  assert all(np.all(np.isfinite(np.asarray(x, np.float64))) for x in jax.tree.leaves(comps))
  assert np.all(np.isfinite(adv))
  gate = comps.gate[mask]
  if cfg.entropy_gate:  # mathematically in (0, 1); float32 sigmoid may round up to 1
    assert np.all(gate > 0) and np.all(gate <= 1)
  else:
    assert_equal(gate, 1.0, "gate off")
  a_tok = np.broadcast_to(comps.outcome[..., None], mask.shape)
  assert_equal(np.sign(comps.outcome_token[mask]), np.sign(a_tok[mask]), "outcome sign")
  if not cfg.progress_signal:
    assert_equal(comps.progress, 0.0, "progress off")
  if not cfg.zero_variance_anchor:
    assert_equal(comps.progress[comps.zero_variance], 0.0, "zero variance without anchor")
  if not (cfg.entropy_gate or cfg.progress_signal):  # GRPO, exactly
    assert_equal(adv, np.where(mask, a_tok, 0.0), "GRPO")
  assert_equal(comps.outcome[comps.zero_variance], 0.0, "zero-variance outcome")
  # tau rises along each response's tokens to 1 at its last token, in the last bucket.
  rising = np.maximum.accumulate(np.where(mask, comps.tau, -np.inf), axis=-1)
  assert np.all(comps.tau[mask] >= rising[mask] - 1e-6)
  last = (mask.shape[-1] - 1 - np.argmax(mask[..., ::-1], axis=-1))[..., None]
  nonempty = mask.any(-1)
  assert_close(np.take_along_axis(comps.tau, last, -1)[nonempty, 0], 1.0, 1e-6, "last tau")
  assert np.all(np.take_along_axis(comps.bucket, last, -1)[nonempty, 0] == cfg.num_buckets - 1)
  assert np.all((comps.bucket >= 0) & (comps.bucket < cfg.num_buckets))


def bucket_stats(x, comps, mask, num_buckets):
  """Per (group, bucket): count, mean, population std and range of `x` over masked tokens."""
  seg = (np.arange(mask.shape[0])[:, None, None] * num_buckets + comps.bucket)[mask]
  n_seg = mask.shape[0] * num_buckets
  x = np.asarray(x, np.float64)[mask]
  count = np.bincount(seg, minlength=n_seg)
  mean = np.bincount(seg, x, n_seg) / np.maximum(count, 1)
  std = np.sqrt(np.bincount(seg, (x - mean[seg]) ** 2, n_seg) / np.maximum(count, 1))
  low, high = np.full(n_seg, np.inf), np.full(n_seg, -np.inf)
  np.minimum.at(low, seg, x)
  np.maximum.at(high, seg, x)
  shape = (mask.shape[0], num_buckets)
  return (count.reshape(shape), mean.reshape(shape), std.reshape(shape),
          np.where(count > 0, high - low, 0).reshape(shape))


# ----------------------------------------------------------------------------- config


def test_config_defaults_match_paper():
  cfg = AdvantageConfig()
  assert (cfg.gamma, cfg.lam, cfg.eta, cfg.num_buckets) == (5.0, 0.1, 0.2, 10)
  assert cfg.reward_threshold == 0.5
  assert (cfg.eps, cfg.delta, cfg.std_ddof, cfg.zero_std_tol) == (1e-6, 1e-4, 1, 1e-6)
  assert cfg.entropy_gate and cfg.progress_signal and cfg.zero_variance_anchor
  assert cfg == AdvantageConfig.variant("epgrpo")
  assert hash(cfg) == hash(AdvantageConfig())


@pytest.mark.parametrize("field,value", [
    ("num_buckets", 0), ("num_buckets", 2.5), ("gamma", 0.0), ("lam", -1.0), ("eta", 0),
    ("eps", 0.0), ("delta", -1e-4), ("zero_std_tol", 0.0), ("std_ddof", 2),
    ("entropy_gate", 1), ("reward_threshold", "0.5"),
])
def test_config_validation(field, value):
  with pytest.raises(ValueError, match=rf"^advantage\.{field}: "):
    AdvantageConfig(**{field: value})


def test_config_message_format():
  with pytest.raises(ValueError, match=r"^advantage\.num_buckets: must be >= 1, got 0$"):
    AdvantageConfig(num_buckets=0)


def test_variants():
  assert set(VARIANTS) == {"grpo", "eg", "ips", "eg_ips", "ips_zvd", "epgrpo"}
  table = {  # Table IV: (entropy gate, progress signal, zero-variance anchor)
      "grpo": (False, False), "eg": (True, False), "ips": (False, True),
      "eg_ips": (True, True), "ips_zvd": (False, True), "epgrpo": (True, True)}
  for name, (gate, progress) in table.items():
    cfg = AdvantageConfig.variant(name)
    assert (cfg.entropy_gate, cfg.progress_signal) == (gate, progress)
  assert AdvantageConfig.variant("ips_zvd").zero_variance_anchor
  assert not AdvantageConfig.variant("eg_ips").zero_variance_anchor
  assert AdvantageConfig.variant("eg", gamma=2.0).gamma == 2.0
  with pytest.raises(ValueError, match=r"^advantage\.variant: unknown 'ppo'"):
    AdvantageConfig.variant("ppo")


# ----------------------------------------------------------------------------- literal oracles


class LiteralTest(chex.TestCase):
  """Hand-computed cases, all of shape [1, 2, 3] (so eager runs share their kernels)."""

  @chex.variants(with_jit=True, without_jit=True)
  def test_hand_computed_group(self):
    # One group of two responses, two tokens each, then a padding column of garbage.
    # Response 1 has zero entropy: positional tau (0.5, 1.0) -> buckets (5, 9);
    # response 0: tau (1/4, 4/4) -> buckets (2, 9).
    nan = jnp.nan
    rewards = jnp.array([[1.0, 0.0]])
    entropy = jnp.array([[[1.0, 3.0, nan], [0.0, 0.0, jnp.inf]]])
    logp_old = jnp.array([[[-1.0, -2.0, nan], [-0.5, -0.3, 1e30]]])
    logp_ref = jnp.array([[[-1.5, -1.0, -jnp.inf], [-0.5, -0.8, nan]]])
    mask = jnp.array([[[True, True, False], [True, True, False]]])
    fn = self.variant(compute_advantages, static_argnames=("cfg",))
    adv, comps = fn(rewards, entropy, logp_old, logp_ref, mask, AdvantageConfig())

    a = 0.5 / (math.sqrt(0.5) + 1e-4)  # ddof=1 std of (1, 0) is sqrt(1/2)
    sig = lambda x: 1 / (1 + math.exp(-x))
    sigma_h = math.sqrt(1.5)  # H = (1, 3, 0, 0): mean 1, population variance (0+4+1+1)/4
    w = [[sig(5 * (h - 1) / (sigma_h + 1e-6)) for h in row] + [0.0] for row in ([1, 3], [0, 0])]
    # s~: response 0 (d=+1): 0.1 * (0.5, -1); response 1 (d=-1): -0.1 * (0, 0.5).
    # Only bucket 9 has two tokens: -0.1 and -0.05; mean -0.075, population std 0.025.
    z9 = 0.025 / (0.025 + 1e-6)
    expected = [[w[0][0] * a, w[0][1] * a - 0.2 * z9, 0.0],
                [-w[1][0] * a, -w[1][1] * a + 0.2 * z9, 0.0]]
    np.testing.assert_allclose(adv[0], expected, rtol=1e-6)
    np.testing.assert_allclose(comps.outcome, [[a, -a]], rtol=1e-6)
    np.testing.assert_allclose(comps.gate[0], w, rtol=1e-6)
    np.testing.assert_allclose(comps.outcome_token[0], np.array(w) * [[a], [-a]], rtol=1e-6)
    np.testing.assert_array_equal(comps.anchor, [[1.0, -1.0]])
    np.testing.assert_allclose(comps.tau[0], [[0.25, 1.0, 0], [0.5, 1.0, 0]], rtol=1e-6)
    np.testing.assert_array_equal(comps.bucket[0], [[2, 9, 0], [5, 9, 0]])
    np.testing.assert_allclose(comps.signal[0], [[0.05, -0.1, 0], [0.0, -0.05, 0]], rtol=1e-6)
    np.testing.assert_allclose(comps.progress[0], [[0, -0.2 * z9, 0], [0, 0.2 * z9, 0]],
                               rtol=1e-6)
    self.assertEqual(comps.bucket.dtype, jnp.int32)
    self.assertFalse(bool(comps.zero_variance[0]))
    check_structure(np.asarray(adv), jax.tree.map(np.asarray, comps), np.asarray(mask),
                    AdvantageConfig())

  @chex.variants(with_jit=True, without_jit=True)
  def test_zero_variance_degradation(self):
    # Both rewards 1: A = 0; d = sign(1 - 0.5) = +1 with ZVD, 0 without.
    # Length-1 responses: tau = 1, both tokens in bucket K - 1.
    rewards = jnp.array([[1.0, 1.0]])
    entropy = jnp.array([[[1.0, 2.0, 3.0], [1.0, jnp.nan, 0.0]]])
    logp_old = jnp.array([[[-1.0, 5.0, 5.0], [-3.0, jnp.inf, 5.0]]])
    logp_ref = jnp.full((1, 2, 3), -2.0)
    mask = jnp.array([[[True, False, False], [True, False, False]]])
    fn = self.variant(compute_advantages, static_argnames=("cfg",))
    adv, comps = fn(rewards, entropy, logp_old, logp_ref, mask, AdvantageConfig())
    z = 0.1 / (0.1 + 1e-6)  # s~ = (0.1, -0.1): mean 0, population std 0.1
    np.testing.assert_allclose(adv[0], [[0.2 * z, 0, 0], [-0.2 * z, 0, 0]], rtol=1e-6)
    np.testing.assert_array_equal(comps.outcome, 0.0)
    np.testing.assert_array_equal(comps.anchor, [[1.0, 1.0]])
    self.assertTrue(bool(comps.zero_variance[0]))
    adv_off, comps_off = fn(rewards, entropy, logp_old, logp_ref, mask,
                            AdvantageConfig.variant("eg_ips"))
    np.testing.assert_array_equal(adv_off, 0.0)
    np.testing.assert_array_equal(comps_off.anchor, 0.0)

  @chex.variants(with_jit=True, without_jit=True)
  def test_grpo_literal(self):
    rewards = jnp.array([[1.0, 0.0]])
    x = jnp.arange(6.0).reshape(1, 2, 3)
    mask = jnp.array([[[True, True, False], [True, False, False]]])
    fn = self.variant(compute_advantages, static_argnames=("cfg",))
    adv, _ = fn(rewards, x, -x, x, mask, AdvantageConfig.variant("grpo"))
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    np.testing.assert_array_equal(adv[0], np.array([[a, a, 0], [-a, 0, 0]], np.float32))


class ConstantEntropyGateTest(chex.TestCase):
  """Eq. 18 on a group whose tokens share one entropy value: H - mu_H = 0, so W = 0.5."""

  @chex.variants(with_jit=True, without_jit=True)
  def test_issue_example(self):
    # P 1, G 3, T 5, every entropy 0.7, rewards [1, 0, 0], variant eg: W 0.5 and
    # outcome-token advantage 0.5 * A with A = (2/3) / (sqrt(1/3) + 1e-4).
    fn = self.variant(compute_advantages, static_argnames=("cfg",))
    entropy = jnp.full((1, 3, 5), 0.7)
    zeros = jnp.zeros((1, 3, 5))
    mask = jnp.ones((1, 3, 5), bool)
    _, comps = fn(jnp.array([[1.0, 0.0, 0.0]]), entropy, zeros, zeros, mask,
                  AdvantageConfig.variant("eg"))
    a = (2 / 3) / (math.sqrt(1 / 3) + 1e-4)
    np.testing.assert_array_equal(comps.gate, 0.5)
    np.testing.assert_allclose(comps.outcome_token[0, 0], 0.5 * a, rtol=1e-6)

  @chex.variants(with_jit=True, without_jit=True)
  def test_magnitudes_and_lengths(self):
    fn = self.variant(compute_advantages, static_argnames=("cfg",))
    rewards = jnp.array([[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]])
    for num_t in (1, 5, 64):
      lengths = jnp.array([[num_t, max(num_t - 1, 1), 1], [num_t, num_t, max(num_t // 2, 1)]])
      mask = jnp.arange(num_t)[None, None, :] < lengths[..., None]
      zeros = jnp.zeros(mask.shape)
      for value in (1e-3, 0.1, 0.7, 2.3, 11.93):
        entropy = jnp.where(mask, value, 9.0)  # padding holds another value: it must not count
        entropy = entropy.at[1].set(jnp.where(mask[1], value * 3.0, -1.0))
        _, comps = fn(rewards, entropy, zeros, zeros, mask, AdvantageConfig.variant("eg"))
        gate = np.asarray(comps.gate)
        np.testing.assert_array_equal(gate[np.asarray(mask)], 0.5, err_msg=f"T={num_t} H={value}")
        np.testing.assert_array_equal(gate[~np.asarray(mask)], 0.0)


def test_grpo_four_responses():
  # Group 0 of a [P, G, T] batch (the shape the property tests compile).
  rewards = np.zeros((P, G), np.float32)
  rewards[0] = (1.0, 0.0, 0.0, 1.0)
  mask = np.zeros((P, G, T), bool)
  mask[0, :, :3] = [[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]]
  x = np.arange(P * G * T, dtype=np.float32).reshape(P, G, T)
  adv, _ = run((rewards, x, -x, x, mask), AdvantageConfig.variant("grpo"))
  a = 0.5 / (math.sqrt(1 / 3) + 1e-4)  # ddof=1: sum of squares 1, / 3
  np.testing.assert_allclose(adv[0, :, :3], np.array([a, -a, -a, a])[:, None] * mask[0, :, :3],
                             rtol=1e-6)
  np.testing.assert_array_equal(adv[1:], 0.0)


def test_progress_positional_fallback_and_exact_boundaries():
  entropy = np.zeros((P, G, WIDE_T), np.float32)
  entropy[0, 0, :10] = 1.0  # tau = 0.1, 0.2, ..., 1.0: tau = k / K belongs to bucket k
  entropy[0, 1, :2] = (3.0, 7.0)  # tau = 0.3, 1.0
  mask = entropy > 0
  mask[0, 2, [1, 3, 4]] = True  # zero entropy: positional (t + 1) / |o| over masked tokens
  rewards = np.ones((P, G), np.float32)
  _, comps = run((rewards, entropy, entropy, entropy, mask), AdvantageConfig())
  np.testing.assert_array_equal(comps.bucket[0, 0, :10], [1, 2, 3, 4, 5, 6, 7, 8, 9, 9])
  np.testing.assert_array_equal(comps.bucket[0, 1, :3], [3, 9, 0])
  np.testing.assert_allclose(comps.tau[0, 2, :5], [0, 1 / 3, 0, 2 / 3, 1.0], rtol=1e-6)
  np.testing.assert_array_equal(comps.bucket[0, 2, :5], [0, 3, 0, 6, 9])


def test_group_of_one_is_zero_variance_and_finite():
  logp_ref = np.array([[[-2, -1, -3, -1, 0]], [[-2, -1, -3, -1, 0]]], np.float32)
  batch = (np.array([[1.0], [0.0]], np.float32), np.ones((2, 1, 5), np.float32),
           -np.ones((2, 1, 5), np.float32), logp_ref, np.ones((2, 1, 5), bool))
  adv, comps = run(batch, AdvantageConfig())
  np.testing.assert_array_equal(comps.zero_variance, [True, True])
  np.testing.assert_array_equal(comps.outcome, 0.0)
  np.testing.assert_array_equal(comps.anchor, [[1.0], [-1.0]])
  check_structure(adv, comps, batch[-1], AdvantageConfig())


def test_all_padding_batch_is_finite_and_zero():
  nan = np.full((P, G, T), np.nan, np.float32)
  batch = (np.zeros((P, G), np.float32), nan, nan, nan, np.zeros((P, G, T), bool))
  for name in VARIANTS:
    cfg = AdvantageConfig.variant(name)
    adv, comps = run(batch, cfg)
    np.testing.assert_array_equal(adv, 0.0)
    check_structure(adv, comps, batch[-1], cfg)


def test_jits_once_per_shape():
  rng = np.random.default_rng(0)
  make = lambda: (rng.integers(0, 2, (P, G)).astype(np.float32),
                  *rng.random((3, P, G, T)).astype(np.float32), rng.random((P, G, T)) < 0.7)
  compute_advantages_jit(*make(), AdvantageConfig())
  before = compute_advantages_jit._cache_size()
  compute_advantages_jit(*make(), AdvantageConfig())  # an equal config, new values
  compute_advantages_jit(*make(), AdvantageConfig.variant("epgrpo"))
  assert compute_advantages_jit._cache_size() == before


def test_inputs_are_constants():
  rng = np.random.default_rng(1)
  args = [jnp.asarray(rng.integers(0, 2, (P, G)), jnp.float32)]
  args += [jnp.asarray(x, jnp.float32) for x in rng.random((3, P, G, T))]
  mask = jnp.ones((P, G, T), bool)

  def total(*xs):
    return jnp.sum(compute_advantages(*xs, mask, AdvantageConfig())[0])

  for g in jax.jit(jax.grad(total, argnums=(0, 1, 2, 3)))(*args):
    np.testing.assert_array_equal(g, 0.0)


def test_shape_errors():
  with pytest.raises(ValueError, match="rewards"):
    compute_advantages(jnp.zeros((2, 2)), *(jnp.zeros((2, 3, 4)),) * 4)
  with pytest.raises(ValueError, match="mask"):
    compute_advantages(jnp.zeros((2, 3)), *(jnp.zeros((2, 3, 4)),) * 3, jnp.zeros((2, 3, 5)))


# ----------------------------------------------------------------------------- properties


@given(batch=batches(), name=st.sampled_from(sorted(VARIANTS)))
def test_matches_reference(batch, name):
  cfg = AdvantageConfig.variant(name)
  adv, comps = run(batch, cfg)
  check_structure(adv, comps, batch[-1], cfg)
  check_against_reference(adv, comps, reference(*batch, cfg), batch[-1])


@given(batch=batches(num_p=2, num_g=1, num_t=5))
def test_group_of_one_matches_reference(batch):
  cfg = AdvantageConfig()
  adv, comps = run(batch, cfg)
  check_structure(adv, comps, batch[-1], cfg)
  check_against_reference(adv, comps, reference(*batch, cfg), batch[-1])
  assert np.all(comps.zero_variance)  # ddof=1 std of one reward is undefined


@given(batch=batches(dyadic=False))
def test_continuous_inputs(batch):
  mask = batch[-1]
  cfg = AdvantageConfig()
  adv, comps = run(batch, cfg)
  check_structure(adv, comps, mask, cfg)
  # Within every populated, non-constant bucket, z has mean 0 and population std 1.
  count, _, signal_std, signal_range = bucket_stats(comps.signal, comps, mask, cfg.num_buckets)
  _, z_mean, z_std, _ = bucket_stats(comps.progress / cfg.eta, comps, mask, cfg.num_buckets)
  standard = (count >= 2) & (signal_std > 1e-2)
  assert_close(z_mean[standard], 0.0, 1e-4, "bucket mean of z")
  assert_close(z_std[standard], 1.0, 1e-3, "bucket std of z")
  # Zero-variance groups: progress is non-zero (with the anchor) exactly where some
  # bucket is non-constant, and exactly zero without the anchor.
  off_cfg = cfg.replace(zero_variance_anchor=False)
  off_adv, off = run(batch, off_cfg)
  check_structure(off_adv, off, mask, off_cfg)
  varied_P = np.any((count > 1) & (signal_range > 0), axis=-1)
  moved_P = np.any(comps.progress != 0, axis=(1, 2))
  zv = comps.zero_variance
  assert_equal(moved_P[zv], varied_P[zv], "zero-variance progress with anchor")
  assert_equal(off.progress[zv], 0.0, "zero-variance progress without anchor")
  # All switches off: GRPO's advantage (float64 formula), broadcast over tokens.
  grpo_adv, grpo = run(batch, AdvantageConfig.variant("grpo"))
  check_structure(grpo_adv, grpo, mask, AdvantageConfig.variant("grpo"))
  rewards = batch[0].astype(np.float64)
  std = rewards.std(-1, ddof=1, keepdims=True)
  expected = np.where(std < 1e-6, 0.0, (rewards - rewards.mean(-1, keepdims=True)) / (std + 1e-4))
  assert_close(grpo.outcome, expected, 1e-5, "GRPO outcome")



@given(batch=batches(), seed=st.integers(0, 2 ** 32 - 1), name=st.sampled_from(sorted(VARIANTS)))
def test_padding_and_permutation_invariance(batch, seed, name):
  cfg = AdvantageConfig.variant(name)
  rewards, entropy, logp_old, logp_ref, mask = batch
  rng = np.random.default_rng(seed)
  adv, comps = run(batch, cfg)

  # Responses permuted within their group: outputs permuted alike.
  perm = rng.permutation(G)
  p_adv, p_comps = run(tuple(x[:, perm] for x in batch), cfg)
  assert_close(p_adv, adv[:, perm], 1e-5, "permuted advantage")
  assert_equal(p_comps.bucket, comps.bucket[:, perm], "permuted bucket")
  assert_close(p_comps.outcome, comps.outcome[:, perm], 1e-6, "permuted outcome")

  # The same tokens, in order, spread over a wider array with more garbage padding
  # (full EP-GRPO only, to compile the wider shape once).
  cfg = AdvantageConfig()
  adv, comps = run(batch, cfg)
  cols = np.sort(np.argsort(rng.random((P, G, WIDE_T)), -1)[..., :T], -1)
  ip, ig = np.meshgrid(np.arange(P), np.arange(G), indexing="ij")
  at = (ip[..., None], ig[..., None], cols)

  def widen(x, junk):
    out = np.full((P, G, WIDE_T), junk, x.dtype)
    out[at] = x
    return out

  wide_mask = widen(mask, False)
  wide = (rewards,) + tuple(widen(x, np.float32(j)) for x, j in
                            zip((entropy, logp_old, logp_ref), (np.nan, 1e30, -np.inf)))
  w_adv, w_comps = run(wide + (wide_mask,), cfg)
  check_structure(w_adv, w_comps, wide_mask, cfg)
  assert_close(w_adv[at][mask], adv[mask], 1e-5, "widened advantage")
  assert_equal(w_comps.bucket[at][mask], comps.bucket[mask], "widened bucket")
  assert_close(w_comps.tau[at][mask], comps.tau[mask], 1e-6, "widened tau")
