"""`rloo`: REINFORCE leave-one-out, `r_i - mean_{j != i} r_j` on every response token."""

from __future__ import annotations

from epgrpo_jax.core import advantages
from epgrpo_jax.estimators._outcome import per_response
from epgrpo_jax.estimators._registry import register


@register("rloo")
@per_response
def rloo(rewards_PxG, cfg: advantages.AdvantageConfig):
  return advantages.leave_one_out_advantage(rewards_PxG, ddof=cfg.std_ddof,
                                            zero_std_tol=cfg.zero_std_tol)
