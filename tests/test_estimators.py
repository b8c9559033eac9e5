"""The registry of advantage estimators (`epgrpo_jax.estimators`): lookup and its config error,
each built-in estimator against a literal oracle or the EP-GRPO pipeline, and a toy estimator
registered here and run by the advantage program on 8 devices."""

from __future__ import annotations

from fractions import Fraction

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from epgrpo_jax import estimators
from epgrpo_jax.core.advantages import AdvantageConfig, Components, compute_advantages
from epgrpo_jax.experiments.variants import BY_NAME, variant_config
from epgrpo_jax.io.errors import UserError
from epgrpo_jax.parallel.sharding import make_mesh
from epgrpo_jax.training.advantage_program import AdvantageProgram
from epgrpo_jax.training.config import TrainConfig

P, G, T = 3, 4, 5
SHARED_METRICS = {"ep/outcome_adv_mean", "ep/outcome_adv_abs_mean", "ep/final_adv_mean",
                  "ep/final_adv_abs_mean", "ep/zero_variance_frac", "ep/zero_variance_token_frac"}
EPGRPO_METRICS = SHARED_METRICS | {
    "ep/gate_mean", "ep/gate_std", "ep/progress_adv_mean", "ep/progress_adv_abs_mean",
    "ep/polarity_flip_frac", "ep/anchor_groups_frac", "ep/bucket_occupancy_min",
    "ep/bucket_occupancy_max", "ep/bucket_empty_frac", "ep/signal_abs_mean"}

estimate_jit = jax.jit(estimators.estimate, static_argnames=("cfg",))


def batch(seed: int = 0, num_p: int = P):
  rng = np.random.default_rng(seed)
  shape = (num_p, G, T)
  rewards = (rng.integers(0, 5, (num_p, G)) / 4).astype(np.float32)
  rewards[0] = 1.0  # one zero-variance group
  mask = np.arange(T) < rng.integers(1, T + 1, (num_p, G, 1))
  entropy = rng.gamma(1.0, 1.0, shape).astype(np.float32)
  logp_old = -rng.gamma(1.0, 1.0, shape).astype(np.float32)
  logp_ref = (logp_old + rng.normal(0, 0.5, shape)).astype(np.float32)
  return rewards, entropy, logp_old, logp_ref, mask


def leaves_equal(a, b):
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


# ----------------------------------------------------------------------------- the registry


def test_builtin_names():
  assert set(estimators.names()) >= {"epgrpo", "grpo", "dr_grpo", "rloo"}
  assert AdvantageConfig().estimator == "epgrpo"


def test_unknown_name_is_one_line_naming_the_key():
  known = str(estimators.names()).replace("[", r"\[").replace("]", r"\]")
  with pytest.raises(UserError, match=rf"^advantage\.estimator: unknown 'ppo'; use one of {known}$"):
    estimators.lookup("ppo")
  with pytest.raises(UserError, match=r"^advantage\.estimator: unknown 'ppo'"):
    TrainConfig().override("advantage.estimator=ppo")
  with pytest.raises(UserError, match=r"^advantage\.estimator: must be an estimator's name"):
    AdvantageConfig(estimator="")


def test_a_name_registers_once():
  with pytest.raises(ValueError, match="'grpo' is registered already"):
    estimators.register("grpo")(lambda *args: None)
  estimators.register("grpo")(estimators.lookup("grpo"))  # the same function again: no-op


# ----------------------------------------------------------------------------- the estimators


def test_epgrpo_is_the_pipeline_with_its_diagnostics():
  for cfg in (AdvantageConfig(), AdvantageConfig.variant("eg_ips")):
    adv, parts, metrics = estimate_jit(*batch(), cfg=cfg)
    want_adv, want_parts = jax.jit(compute_advantages, static_argnames=("cfg",))(*batch(), cfg)
    leaves_equal((adv, parts), (want_adv, want_parts))
    assert set(metrics) == EPGRPO_METRICS


@pytest.mark.parametrize("seed", range(3))
def test_grpo_is_epgrpo_with_its_switches_off(seed):
  adv, parts, metrics = estimate_jit(*batch(seed), cfg=AdvantageConfig(estimator="grpo"))
  want_adv, want_parts, _ = estimate_jit(*batch(seed), cfg=AdvantageConfig.variant("grpo"))
  leaves_equal((adv, parts.outcome, parts.gate, parts.outcome_token, parts.zero_variance),
               (want_adv, want_parts.outcome, want_parts.gate, want_parts.outcome_token,
                want_parts.zero_variance))
  assert set(metrics) == SHARED_METRICS


REWARDS = np.array([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [0.25, 0.5, 1.0, 0.0]],
                   np.float32)


def oracle(kind: str) -> np.ndarray:
  """The per-response advantage from the definition, in exact rationals."""
  out = []
  for row in REWARDS:
    r = [Fraction(float(x)) for x in row]
    if len(set(r)) == 1:  # zero variance
      out.append([0.0] * len(r))
    elif kind == "dr_grpo":
      out.append([float(x - sum(r) / len(r)) for x in r])
    else:  # rloo
      out.append([float(r[i] - sum(r[j] for j in range(len(r)) if j != i) / (len(r) - 1))
                  for i in range(len(r))])
  return np.array(out)


@pytest.mark.parametrize("kind,literal", [
    ("dr_grpo", [[0.5, -0.5, -0.5, 0.5], [0, 0, 0, 0], [-3 / 16, 1 / 16, 9 / 16, -7 / 16]]),
    ("rloo", [[2 / 3, -2 / 3, -2 / 3, 2 / 3], [0, 0, 0, 0], [-1 / 4, 1 / 12, 3 / 4, -7 / 12]]),
])
def test_response_estimators_literal(kind, literal):
  np.testing.assert_allclose(oracle(kind), literal, rtol=1e-12)  # the oracle, by hand
  mask = np.zeros((P, G, T), bool)
  mask[:, :, :3] = True
  mask[2, 1, 1:] = False  # a one-token response
  x = np.full((P, G, T), np.nan, np.float32)  # entropies and log-probs are not read
  adv, parts, metrics = estimate_jit(REWARDS, x, x, x, mask, cfg=AdvantageConfig(estimator=kind))
  chex.assert_trees_all_close(np.asarray(parts.outcome), np.asarray(literal, np.float32),
                              rtol=1e-6, atol=1e-7)
  np.testing.assert_array_equal(adv, np.where(mask, parts.outcome[..., None], 0.0))
  np.testing.assert_array_equal(parts.zero_variance, [False, True, False])
  np.testing.assert_array_equal(parts.progress, 0.0)
  np.testing.assert_array_equal(parts.gate, mask.astype(np.float32))
  np.testing.assert_allclose(metrics["ep/final_adv_abs_mean"],
                             np.abs(oracle(kind)[..., None] * mask).sum() / mask.sum(), rtol=1e-6)
  np.testing.assert_allclose(metrics["ep/zero_variance_token_frac"], 12 / 34, rtol=1e-6)


def test_one_response_per_group_is_zero():
  ones = np.ones((2, 1, 3), np.float32)
  for kind in ("grpo", "dr_grpo", "rloo"):
    adv, parts, _ = estimate_jit(np.array([[1.0], [0.0]], np.float32), ones, ones, ones,
                                 ones.astype(bool), cfg=AdvantageConfig(estimator=kind))
    np.testing.assert_array_equal(adv, 0.0)
    np.testing.assert_array_equal(parts.zero_variance, [True, True])


_response_outcomes = jax.jit(lambda r: tuple(
    estimators.estimate(r, *(jnp.zeros((2, 5, 1)),) * 3, jnp.ones((2, 5, 1), bool),
                        AdvantageConfig(estimator=k))[1].outcome for k in ("dr_grpo", "rloo")))


@given(st.lists(st.integers(0, 8), min_size=10, max_size=10))
def test_rloo_sums_to_zero_and_scales_dr_grpo(quarters):
  rewards = np.array(quarters, np.float32).reshape(2, 5) / 4
  centred, loo = map(np.asarray, _response_outcomes(rewards))
  np.testing.assert_allclose(loo.sum(axis=-1), 0.0, atol=1e-5)
  np.testing.assert_allclose(loo, centred * 5 / 4, rtol=1e-5, atol=1e-6)  # G / (G - 1)


# ----------------------------------------------------------------------------- a new estimator


@pytest.fixture
def toy():
  """A registered toy estimator: each response's reward on its tokens, one metric."""

  @estimators.register("toy")
  def reward_as_advantage(rewards_PxG, entropy_PxGxT, logp_old_PxGxT, logp_ref_PxGxT, mask_PxGxT,
                          cfg):
    adv_PxGxT = jnp.where(mask_PxGxT, rewards_PxG[..., None], 0.0)
    parts = Components(outcome=rewards_PxG, gate=mask_PxGxT.astype(jnp.float32),
                       outcome_token=adv_PxGxT, anchor=jnp.zeros_like(rewards_PxG),
                       signal=entropy_PxGxT * 0, tau=entropy_PxGxT * 0,
                       bucket=jnp.zeros(mask_PxGxT.shape, jnp.int32), progress=logp_ref_PxGxT * 0,
                       zero_variance=jnp.zeros(rewards_PxG.shape[:1], bool))
    return adv_PxGxT, parts, {"toy/reward_mean": jnp.mean(rewards_PxG)}

  yield "toy"
  estimators.unregister("toy")


def test_a_registered_estimator_runs_in_the_advantage_program(toy):
  cfg = TrainConfig().override(f"advantage.estimator={toy}").advantage  # one config value
  rewards, entropy, logp_old, logp_ref, mask = batch(num_p=8)
  program = AdvantageProgram(make_mesh())
  adv, parts, metrics = program(rewards, entropy, logp_old, logp_ref, mask, cfg=cfg)
  assert len(adv.sharding.device_set) == 8  # the groups split over the mesh
  np.testing.assert_array_equal(adv, np.where(mask, rewards[..., None], 0.0))
  np.testing.assert_array_equal(parts.outcome, rewards)
  assert metrics.keys() == {"toy/reward_mean"}
  np.testing.assert_allclose(metrics["toy/reward_mean"], rewards.mean(), rtol=1e-6)


@pytest.mark.parametrize("name", ["epgrpo", "grpo", "dr_grpo", "rloo"])
def test_builtin_estimators_run_in_the_advantage_program(name):
  cfg = AdvantageConfig(estimator=name)
  program = AdvantageProgram(make_mesh())
  adv, parts, metrics = program(*batch(num_p=8), cfg=cfg)
  want = estimate_jit(*batch(num_p=8), cfg=cfg)
  chex.assert_trees_all_close(jax.device_get((adv, parts, metrics)), jax.device_get(want),
                              rtol=1e-6, atol=1e-7)


def test_a_comparison_row_runs_the_epgrpo_estimator():
  row = BY_NAME["grpo"]
  assert variant_config(row).advantage.estimator == "epgrpo"
  with pytest.raises(UserError, match=r"^grpo\.yaml: advantage\.estimator is 'rloo'; GRPO is"):
    variant_config(row, ["advantage.estimator=rloo"])
