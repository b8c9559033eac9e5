"""`dr_grpo`: Dr. GRPO's unscaled advantage `r_i - mean(r)` on every response token (no division
by the group's std). Dr. GRPO's other half, the loss's `seq_sum_max_len` aggregation, is
`loss.aggregation`."""

from __future__ import annotations

from epgrpo_jax.core import advantages
from epgrpo_jax.estimators._outcome import response_estimate
from epgrpo_jax.estimators._registry import register


@register("dr_grpo")
def dr_grpo(rewards_PxG, entropy_PxGxT, logp_old_PxGxT, logp_ref_PxGxT, mask_PxGxT,
            cfg: advantages.AdvantageConfig):
  outcome_PxG, zero_variance_P = advantages.centred_advantage(
      rewards_PxG, ddof=cfg.std_ddof, zero_std_tol=cfg.zero_std_tol)
  return response_estimate(outcome_PxG, zero_variance_P, mask_PxGxT)
