"""`rloo`: REINFORCE leave-one-out, `r_i - mean_{j != i} r_j` on every response token."""

from __future__ import annotations

from epgrpo_jax.core import advantages
from epgrpo_jax.estimators._outcome import response_estimate
from epgrpo_jax.estimators._registry import register


@register("rloo")
def rloo(rewards_PxG, entropy_PxGxT, logp_old_PxGxT, logp_ref_PxGxT, mask_PxGxT,
         cfg: advantages.AdvantageConfig):
  outcome_PxG, zero_variance_P = advantages.leave_one_out_advantage(
      rewards_PxG, ddof=cfg.std_ddof, zero_std_tol=cfg.zero_std_tol)
  return response_estimate(outcome_PxG, zero_variance_P, mask_PxGxT)
