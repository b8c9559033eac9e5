"""`grpo`: GRPO's group-normalised reward (eq. 3) on every response token. The same advantage
as `epgrpo` with its three switches off, without computing the gate or the progress."""

from __future__ import annotations

from epgrpo_jax.core import advantages
from epgrpo_jax.estimators._outcome import response_estimate
from epgrpo_jax.estimators._registry import register


@register("grpo")
def grpo(rewards_PxG, entropy_PxGxT, logp_old_PxGxT, logp_ref_PxGxT, mask_PxGxT,
         cfg: advantages.AdvantageConfig):
  outcome_PxG, zero_variance_P = advantages.outcome_advantage(
      rewards_PxG, delta=cfg.delta, ddof=cfg.std_ddof, zero_std_tol=cfg.zero_std_tol)
  return response_estimate(outcome_PxG, zero_variance_P, mask_PxGxT)
