"""`dr_grpo`: Dr. GRPO's unscaled advantage `r_i - mean(r)` on every response token (no division
by the group's std). Dr. GRPO's other half, the loss's `seq_sum_max_len` aggregation, is
`loss.aggregation`."""

from __future__ import annotations

from epgrpo_jax.core import advantages
from epgrpo_jax.estimators._outcome import per_response
from epgrpo_jax.estimators._registry import register


@register("dr_grpo")
@per_response
def dr_grpo(rewards_PxG, cfg: advantages.AdvantageConfig):
  return advantages.centred_advantage(rewards_PxG, ddof=cfg.std_ddof, zero_std_tol=cfg.zero_std_tol)
