"""Sampler/trainer mismatch: its metrics and the rollout correction weights by hand, the corrected
loss by hand, bit-for-bit no change with identical log-probs, config errors, and a training step."""

from __future__ import annotations

import itertools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from epgrpo_jax.core.losses import AGGREGATIONS, LossConfig, policy_loss
from epgrpo_jax.core.mismatch import correction_weight, rollout_mismatch, weight_metrics
from epgrpo_jax.io.errors import UserError
from epgrpo_jax.training.config import TrainConfig
from helpers import arithmetic_task, rl_step_config

# Two sequences of 3 tokens, the last of the second is padding (garbage values there).
TRAIN = jnp.array([[-1.0, -2.0, -0.5], [-0.3, -1.2, 9.0]])
BEHAVIOUR = jnp.array([[-1.5, -1.0, -0.5], [-0.3, -1.7, 4.0]])  # d = [[.5, -1, 0], [0, .5, pad]]
MASK = jnp.array([[True, True, True], [True, True, False]])
E = math.e


def test_mismatch_metrics_by_hand():
  m = jax.jit(rollout_mismatch, static_argnames="cap")(TRAIN, BEHAVIOUR, MASK, cap=1.5)
  expected = {
      "sampling/sampling_logp_difference/mean": (0.5 + 1.0 + 0.0 + 0.0 + 0.5) / 5,
      "sampling/sampling_logp_difference/max": 1.0,
      "rollout_corr/kl": -(0.5 - 1.0 + 0.5) / 5,
      "rollout_corr/k3_kl": (2 * (math.exp(0.5) - 1.5) + (math.exp(-1.0) - 1 + 1)) / 5,
      "rollout_corr/chi2_token": (2 * E + E ** -2 + 2) / 5 - 1,
      # sequence log-ratios -0.5 and 0.5
      "rollout_corr/chi2_seq": (E ** -1 + E) / 2 - 1,
      # log 1.5 = 0.405: tokens 0.5, 0.5 above, -1 below; sequence 0.5 above, -0.5 below
      "rollout_corr/rollout_is_ratio_fraction_high": 2 / 5,
      "rollout_corr/rollout_is_ratio_fraction_low": 1 / 5,
      "rollout_corr/rollout_is_seq_fraction_high": 1 / 2,
      "rollout_corr/rollout_is_seq_fraction_low": 1 / 2,
  }
  assert m.keys() == expected.keys()
  for k, v in expected.items():
    np.testing.assert_allclose(float(m[k]), v, rtol=1e-6, atol=1e-7, err_msg=k)


def test_mismatch_metrics_are_zero_for_identical_logprobs_and_empty_masks():
  same = rollout_mismatch(TRAIN, TRAIN, MASK, cap=2.0)
  empty = rollout_mismatch(TRAIN, BEHAVIOUR, jnp.zeros_like(MASK), cap=2.0)
  for m in (same, empty):
    assert all(float(v) == 0.0 for v in m.values()), m


a, b = math.exp(0.5), math.exp(-1.0)  # token ratios of the case
WEIGHTS = {  # (level, mode, cap, low, high): expected [2, 3]
    ("token", "truncate", 1.5, 0.5, 2.0): [[1.5, b, 1.0], [1.0, 1.5, 0.0]],
    ("token", "mask", 2.0, 0.5, 1.5): [[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]],
    ("sequence", "truncate", 1.5, 0.5, 2.0): [[math.exp(-0.5)] * 3, [1.5, 1.5, 0.0]],
    ("sequence", "mask", 2.0, 0.5, 1.5): [[math.exp(-0.5)] * 3, [0.0, 0.0, 0.0]],
    ("geometric", "truncate", 1.2, 0.5, 2.0): [[math.exp(-0.5 / 3)] * 3, [1.2, 1.2, 0.0]],
    ("geometric", "mask", 2.0, 0.85, 1.3): [[0.0] * 3, [math.exp(0.25)] * 2 + [0.0]],
}


@pytest.mark.parametrize("case", list(WEIGHTS), ids=lambda c: f"{c[0]}-{c[1]}")
def test_correction_weights_by_hand(case):
  level, mode, cap, low, high = case
  w = correction_weight(TRAIN, BEHAVIOUR, MASK, level=level, mode=mode, cap=cap, low=low, high=high)
  chex.assert_trees_all_close(w, jnp.array(WEIGHTS[case]), rtol=1e-6, atol=1e-7)
  m = weight_metrics(w, MASK)
  valid = np.asarray(WEIGHTS[case])[np.asarray(MASK)]
  np.testing.assert_allclose(float(m["sampling/importance_sampling_ratio/mean"]), valid.mean(), rtol=1e-6)
  np.testing.assert_allclose(float(m["sampling/importance_sampling_ratio/min"]), valid.min(), rtol=1e-6)
  np.testing.assert_allclose(float(m["sampling/importance_sampling_ratio/max"]), valid.max(), rtol=1e-6)
  assert float(m["rollout_corr/rollout_rs_masked_fraction"]) == pytest.approx((valid == 0).mean())


def test_sequence_weights_do_not_overflow_on_long_sequences():
  d = jnp.full((1, 400), 0.5)  # prod r = e^200
  for mode in ("truncate", "mask"):
    w = correction_weight(d, jnp.zeros_like(d), jnp.ones_like(d, bool), level="sequence",
                          mode=mode, cap=3.0, low=0.5, high=3.0)
    assert np.all(np.asarray(w) == (3.0 if mode == "truncate" else 0.0))


def test_corrected_loss_by_hand():
  """Token TIS on one sequence at ratio 1: each token's surrogate A_t times min(r_t, cap), the
  KL term and the token-mean denominator untouched; the weight is detached."""
  logp = jnp.array([[-1.0, -2.0]])
  behaviour = logp - jnp.array([[0.5, -1.0]])  # r = e^0.5 (capped at 1.5), e^-1
  ref_gap = jnp.array([[0.2, -0.1]])
  adv, mask = jnp.array([[1.0, -2.0]]), jnp.ones((1, 2), bool)
  cfg = LossConfig(beta=0.1, rollout_correction="token", rollout_correction_cap=1.5)
  w = [1.5, math.exp(-1.0)]
  kl = [math.exp(g) - g - 1 for g in (0.2, -0.1)]

  def loss_of(lp, c):
    return policy_loss(lp, jax.lax.stop_gradient(lp), logp + ref_gap, adv, mask, c,
                       logp_behaviour_BxT=behaviour)[0]

  expected = -((w[0] * 1.0 - 0.1 * kl[0]) + (w[1] * -2.0 - 0.1 * kl[1])) / 2
  assert float(loss_of(logp, cfg)) == pytest.approx(expected, rel=1e-6)
  # d/dlogp: (-w_t A_t + beta (1 - e^g_t)) / 2 (the ratio's derivative is 1 at rho = 1).
  grad = jax.grad(loss_of)(logp, cfg)
  expected_grad = [(-w[t] * float(adv[0, t]) + 0.1 * (1 - math.exp(g))) / 2
                   for t, g in enumerate((0.2, -0.1))]
  np.testing.assert_allclose(np.asarray(grad)[0], expected_grad, rtol=1e-5)


def test_corrected_kl_by_hand():
  """`loss.rollout_correction_kl`: each token's KL term times the same detached weight as its
  surrogate, w_t KL_k3(t); the reported `rollout_corr/weighted_ref_kl` is their token mean."""
  logp = jnp.array([[-1.0, -2.0, -0.7]])
  behaviour = logp - jnp.array([[0.5, -3.0, 0.0]])  # r = e^0.5 (capped at 1.5), e^-3, 1
  ref_gap = jnp.array([[0.2, 2.5, -0.1]])  # the second token: pi fell far below ref and mu
  adv, mask = jnp.array([[1.0, -2.0, 0.5]]), jnp.ones((1, 3), bool)
  cfg = LossConfig(beta=0.1, rollout_correction="token", rollout_correction_cap=1.5,
                   rollout_correction_kl=True)
  w = [1.5, math.exp(-3.0), 1.0]
  gaps = (0.2, 2.5, -0.1)
  kl = [math.exp(g) - g - 1 for g in gaps]

  def loss_of(lp, c):
    return policy_loss(lp, jax.lax.stop_gradient(lp), logp + ref_gap, adv, mask, c,
                       logp_behaviour_BxT=behaviour)

  loss, aux = loss_of(logp, cfg)
  expected = -sum(w[t] * float(adv[0, t]) - 0.1 * w[t] * kl[t] for t in range(3)) / 3
  assert float(loss) == pytest.approx(expected, rel=1e-6)
  assert float(aux["rollout_corr/weighted_ref_kl"]) == pytest.approx(sum(
      w[t] * kl[t] for t in range(3)) / 3, rel=1e-6)
  assert float(aux["kl"]) == pytest.approx(sum(kl) / 3, rel=1e-6)  # the plain k3 mean, as before
  # d/dlogp: (-w_t A_t + beta w_t (1 - e^g_t)) / T: the weight scales the KL gradient too.
  grad = jax.grad(lambda lp: loss_of(lp, cfg)[0])(logp)
  expected_grad = [(-w[t] * float(adv[0, t]) + 0.1 * w[t] * (1 - math.exp(gaps[t]))) / 3
                   for t in range(3)]
  np.testing.assert_allclose(np.asarray(grad)[0], expected_grad, rtol=1e-5)
  # Off: the KL term is unweighted, as TRL's; the weighted mean is still measured.
  loss_off, aux_off = loss_of(logp, cfg.replace(rollout_correction_kl=False))
  assert float(loss_off) == pytest.approx(
      -sum(w[t] * float(adv[0, t]) - 0.1 * kl[t] for t in range(3)) / 3, rel=1e-6)
  assert float(aux_off["rollout_corr/weighted_ref_kl"]) == float(aux["rollout_corr/weighted_ref_kl"])
  # No correction: neither the weights nor the weighted KL.
  aux_none = loss_of(logp, LossConfig(beta=0.1))[1]
  assert not any(k.startswith(("rollout_corr/weighted", "sampling/importance")) for k in aux_none)


MODES = [(level, mode) for level in ("token", "sequence", "geometric")
         for mode in ("truncate", "mask")]


@pytest.mark.parametrize("level,mode", MODES)
def test_identical_logprobs_leave_loss_and_gradient_unchanged_bit_for_bit(level, mode):
  """Every aggregation, GSPO and the 80/20 selection, off-policy ratios: with the behaviour
  log-probs equal to the old ones the weights are exactly 1."""
  rng = np.random.default_rng(0)
  shape = (4, 6)
  logp = jnp.asarray(rng.normal(-1.5, 0.5, shape), jnp.float32)
  logp_old = logp + jnp.asarray(rng.normal(0, 0.3, shape), jnp.float32)
  logp_ref = logp + jnp.asarray(rng.normal(0, 0.2, shape), jnp.float32)
  adv = jnp.asarray(rng.normal(0, 1, shape), jnp.float32)
  entropy = jnp.asarray(rng.random(shape), jnp.float32)
  mask = jnp.asarray(np.arange(6)[None] < np.array([6, 4, 1, 0])[:, None])
  for agg, is_level, quantile in itertools.product(AGGREGATIONS, ("token", "sequence"), (1.0, 0.5)):
    base = LossConfig(beta=0.04, aggregation=agg, importance_sampling_level=is_level,
                      top_entropy_quantile=quantile)
    corrected = base.replace(rollout_correction=level, rollout_correction_mode=mode,
                             rollout_correction_kl=quantile == 1.0)  # the KL term weighted too

    def value_and_grad(cfg, behaviour):
      f = lambda lp: policy_loss(lp, logp_old, logp_ref, adv, mask, cfg, entropy,
                                 logp_behaviour_BxT=behaviour)
      return jax.value_and_grad(f, has_aux=True)(logp)

    (loss0, aux0), grad0 = value_and_grad(base, None)
    (loss1, aux1), grad1 = value_and_grad(corrected, logp_old)
    what = (agg, is_level, quantile)
    assert np.asarray(loss0).tobytes() == np.asarray(loss1).tobytes(), what
    assert np.asarray(grad0).tobytes() == np.asarray(grad1).tobytes(), what
    assert float(aux1["sampling/importance_sampling_ratio/mean"]) == 1.0, what
    assert float(aux1["rollout_corr/k3_kl"]) == 0.0, what


def test_the_correction_needs_behaviour_logprobs():
  x = jnp.zeros((1, 2))
  with pytest.raises(ValueError, match="rollout_correction"):
    policy_loss(x, x, x, x, jnp.ones((1, 2), bool), LossConfig(rollout_correction="sequence"))


@pytest.mark.parametrize("overrides,message", [
    ({"rollout_correction": "tokens"}, "loss.rollout_correction: unknown 'tokens'"),
    ({"rollout_correction_mode": "clip"}, "loss.rollout_correction_mode: unknown 'clip'"),
    ({"rollout_correction_cap": 0.0}, "loss.rollout_correction_cap: must be > 0, got 0.0"),
    ({"rollout_correction_cap": -1.0}, "loss.rollout_correction_cap: must be > 0, got -1.0"),
    ({"rollout_correction_high": 0.0}, "loss.rollout_correction_high: must be > 0, got 0.0"),
    ({"rollout_correction_low": 2.0}, "loss.rollout_correction_low: must be >= 0 and < "
                                      "loss.rollout_correction_high (2.0), got 2.0"),
    ({"rollout_correction_low": -0.1}, "loss.rollout_correction_low: must be >= 0"),
    ({"rollout_correction_kl": True}, "loss.rollout_correction_kl: true weights the KL term by "
                                      "the correction's weights, and loss.rollout_correction is 'none'"),
    ({"rollout_correction_kl": 1, "rollout_correction": "token"},
     "loss.rollout_correction_kl: must be a bool, got 1"),
])
def test_bad_correction_settings_name_the_key(overrides, message):
  with pytest.raises(UserError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
    LossConfig(**overrides)


def test_correction_with_greedy_sampling_is_a_config_error():
  with pytest.raises(UserError, match=r"^loss.rollout_correction: 'token' needs the sampler"):
    TrainConfig().override("loss.rollout_correction=token", "sampling.temperature=0")
  TrainConfig().override("sampling.temperature=0")  # measuring alone is fine


def test_cli_exits_2_with_one_line(capsys):
  from epgrpo_jax import train as train_cli
  for args, line in ((["loss.rollout_correction_cap=0"],
                      "error: loss.rollout_correction_cap: must be > 0, got 0.0"),
                     (["loss.rollout_correction_low=3", "loss.rollout_correction_high=2"],
                      "error: loss.rollout_correction_low: must be >= 0 and < "
                      "loss.rollout_correction_high (2.0), got 3.0"),
                     (["loss.rollout_correction=geometric", "sampling.greedy=true"], None)):
    assert train_cli.main(args) == 2
    err = [l for l in capsys.readouterr().err.strip().splitlines() if l.startswith("error:")]
    assert len(err) == 1 and (line is None or err[0] == line), err
    assert line is not None or err[0].startswith("error: loss.rollout_correction: 'geometric'")


@pytest.fixture(scope="module")
def task(tmp_path_factory):
  return arithmetic_task(tmp_path_factory.mktemp("arith"))


@pytest.mark.parametrize("overrides", [
    ("loss.rollout_correction=sequence", "loss.rollout_correction_mode=mask"),
    ("loss.rollout_correction=token", "train.fused_update=false", "train.num_iterations=2",
     "loss.rollout_correction_kl=true")],
    ids=["fused-sequence-mask", "separate-token-truncate"])
def test_a_training_step_measures_and_corrects(task, tmp_path, overrides):
  from epgrpo_jax.training.trainer import Trainer
  trainer = Trainer(rl_step_config(task, tmp_path / "run", *overrides))
  try:
    _, m, _ = trainer.step(trainer.initial_state())
  finally:
    trainer.close()
  keys = [k for k in m if k.startswith(("sampling/sampling_logp", "rollout_corr/"))]
  # 10 measured, the share the correction dropped, the weighted KL to the reference
  assert len(keys) == 12, keys
  assert all(math.isfinite(m[k]) for k in keys)
  # The tiny float32 model: the sampler's and the trainer's log-probs agree to rounding.
  assert 0.0 <= m["sampling/sampling_logp_difference/max"] < 1e-3
  assert abs(m["rollout_corr/k3_kl"]) < 1e-6
  assert m["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=1e-3)
  # Weights within rounding of 1: the weighted KL is the plain one.
  assert m["rollout_corr/weighted_ref_kl"] == pytest.approx(m["kl"], rel=1e-3, abs=1e-9)
