"""`grpo`: GRPO's group-normalised reward (eq. 3) on every response token. The same advantage
as `epgrpo` with its three switches off, without computing the gate or the progress."""

from __future__ import annotations

from epgrpo_jax.core import advantages
from epgrpo_jax.estimators._outcome import per_response
from epgrpo_jax.estimators._registry import register


@register("grpo")
@per_response
def grpo(rewards_PxG, cfg: advantages.AdvantageConfig):
  return advantages.outcome_advantage(rewards_PxG, delta=cfg.delta, ddof=cfg.std_ddof,
                                      zero_std_tol=cfg.zero_std_tol)
