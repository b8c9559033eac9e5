"""The one learning-rate schedule and optimizer of the project (RL updates and SFT alike)."""

from __future__ import annotations

import optax

DECAYS = ("linear", "cosine", "constant")


def make_schedule(peak: float, total_steps: int, *, warmup_ratio: float, decay: str = "linear",
                  end_ratio: float = 0.0) -> optax.Schedule:
  """Linear warm-up from 0 over `warmup_ratio` of the steps, then `decay` to `end_ratio * peak`
  (linear or cosine) or constant."""
  warmup = max(int(round(warmup_ratio * total_steps)), 0)
  steps = max(total_steps - warmup, 1)
  if decay == "cosine":
    after = optax.cosine_decay_schedule(peak, steps, alpha=end_ratio)
  elif decay == "constant":
    after = optax.constant_schedule(peak)
  elif decay == "linear":
    after = optax.linear_schedule(peak, peak * end_ratio, steps)
  else:
    raise ValueError(f"decay: one of {DECAYS}, got {decay!r}")
  if not warmup:
    return after
  return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after], [warmup])


def make_optimizer(schedule: optax.Schedule, *, weight_decay: float, max_grad_norm: float,
                   b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8
                   ) -> optax.GradientTransformation:
  """AdamW on `schedule`, after global-norm clipping (none when `max_grad_norm` is 0)."""
  parts = [optax.clip_by_global_norm(max_grad_norm)] if max_grad_norm > 0 else []
  parts.append(optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay))
  return optax.chain(*parts)
