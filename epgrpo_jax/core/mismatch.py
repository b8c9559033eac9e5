"""The sampler/trainer mismatch: how far the sampler's token log-probs are from the trainer's, and
the importance weights that correct for it (truncated or masked importance sampling).

The sampler (KV-cached decode, its own kernels, merged adapters, bf16 rounding) and the training
forward compute the same policy's log-probs differently, so a "synchronous, on-policy" batch is
drawn from a behaviour policy mu slightly off the trained policy pi_old. Per completion token,
`log r_t = log pi_old(y_t) - log mu(y_t)`; `r` is the importance ratio pi_old / mu.

Shape suffixes: B sequences, T tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from epgrpo_jax.io.errors import UserError

_F32 = jnp.float32
CORRECTION_LEVELS = ("none", "token", "sequence", "geometric")
CORRECTION_MODES = ("truncate", "mask")
# |log r| of a whole sequence is clamped here before exp (chi2_seq), as verl's safety bound.
_SEQUENCE_LOG_BOUND = 20.0


def _mean(x_BxT, mask_BxT):
  return jnp.sum(jnp.where(mask_BxT, x_BxT, 0.0)) / jnp.maximum(jnp.sum(mask_BxT.astype(_F32)), 1.0)


def rollout_mismatch(logp_train_BxT: jax.Array, logp_behaviour_BxT: jax.Array, mask_BxT: jax.Array,
                     *, cap: float) -> dict[str, jax.Array]:
  """Mismatch metrics of a batch over its masked tokens (all 0 when nothing is masked).

  With `d_t = logp_train - logp_behaviour` and `r_t = exp(d_t)`:

    sampling/sampling_logp_difference/mean, /max   mean and max |d_t| (TRL's names)
    rollout_corr/kl          mean(-d_t), the plain estimate of KL(mu || pi)      (verl's names)
    rollout_corr/k3_kl       mean(r_t - 1 - d_t), k3 estimate of KL(mu || pi), >= 0 per token
    rollout_corr/chi2_token  mean(r_t^2) - 1 = mean(r_t^2 - 1)
    rollout_corr/chi2_seq    mean over sequences of (prod_t r_t)^2 - 1, log prod clamped to +-20
    rollout_corr/rollout_is_ratio_fraction_high, _low   share of tokens with r_t > cap, < 1 / cap
    rollout_corr/rollout_is_seq_fraction_high, _low     share of non-empty sequences whose
                                                        prod_t r_t is > cap, < 1 / cap

  The estimates are over the behaviour policy's samples (the sampled tokens). A pure function,
  no gradient.
  """
  mask_BxT = mask_BxT.astype(bool)
  d_BxT = jax.lax.stop_gradient(jnp.where(
      mask_BxT, logp_train_BxT.astype(_F32) - logp_behaviour_BxT.astype(_F32), 0.0))
  log_cap = jnp.log(jnp.asarray(cap, _F32))
  seq_log_B = jnp.sum(d_BxT, axis=-1)
  seq_B = jnp.any(mask_BxT, axis=-1)
  seq_mean = lambda x_B: jnp.sum(jnp.where(seq_B, x_B, 0.0)) / jnp.maximum(
      jnp.sum(seq_B.astype(_F32)), 1.0)
  # expm1: r - 1 and r^2 - 1 keep their digits when r is within rounding of 1 (float32 runs).
  seq_r2_B = jnp.expm1(2.0 * jnp.clip(seq_log_B, -_SEQUENCE_LOG_BOUND, _SEQUENCE_LOG_BOUND))
  return {
      "sampling/sampling_logp_difference/mean": _mean(jnp.abs(d_BxT), mask_BxT),
      "sampling/sampling_logp_difference/max": jnp.max(jnp.abs(d_BxT)),
      "rollout_corr/kl": _mean(-d_BxT, mask_BxT),
      "rollout_corr/k3_kl": _mean(jnp.expm1(d_BxT) - d_BxT, mask_BxT),
      "rollout_corr/chi2_token": _mean(jnp.expm1(2.0 * d_BxT), mask_BxT),
      "rollout_corr/chi2_seq": seq_mean(seq_r2_B),
      "rollout_corr/rollout_is_ratio_fraction_high": _mean((d_BxT > log_cap).astype(_F32), mask_BxT),
      "rollout_corr/rollout_is_ratio_fraction_low": _mean((d_BxT < -log_cap).astype(_F32), mask_BxT),
      "rollout_corr/rollout_is_seq_fraction_high": seq_mean((seq_log_B > log_cap).astype(_F32)),
      "rollout_corr/rollout_is_seq_fraction_low": seq_mean((seq_log_B < -log_cap).astype(_F32)),
  }


def level_log_ratio(logp_train_BxT: jax.Array, logp_behaviour_BxT: jax.Array, mask_BxT: jax.Array,
                    level: str) -> jax.Array:
  """log of the importance ratio each token is weighted by, [B, T] (0 on padding):

    token:     d_t                    the token's own ratio
    sequence:  sum_t d_t              the sequence's ratio prod_t r_t, on each of its tokens
    geometric: mean_t d_t             the geometric mean of the sequence's token ratios
  """
  mask_BxT = mask_BxT.astype(bool)
  d_BxT = jnp.where(mask_BxT, logp_train_BxT.astype(_F32) - logp_behaviour_BxT.astype(_F32), 0.0)
  if level == "token":
    return d_BxT
  total_B = jnp.sum(d_BxT, axis=-1)
  if level == "geometric":
    total_B = total_B / jnp.maximum(jnp.sum(mask_BxT.astype(_F32), axis=-1), 1.0)
  elif level != "sequence":
    raise ValueError(f"level_log_ratio: unknown level {level!r}")
  return jnp.where(mask_BxT, total_B[:, None], 0.0)


def correction_weight(logp_train_BxT: jax.Array, logp_behaviour_BxT: jax.Array,
                      mask_BxT: jax.Array, *, level: str, mode: str, cap: float, low: float,
                      high: float) -> jax.Array:
  """Detached importance weight per token, [B, T] (0 on padding).

  With `log w` the `level_log_ratio`:
    truncate (TIS): `min(w, cap)`
    mask (MIS):     `w` where `low <= w <= high`, else 0 (the token, or the whole sequence at the
                    sequence and geometric levels, drops out of the surrogate)
  Both are computed in log space (no overflow for long sequences). When the two log-probs are
  equal, every weight is exactly 1 for `cap >= 1` and `low <= 1 <= high`.
  """
  mask_BxT = mask_BxT.astype(bool)
  log_w_BxT = jax.lax.stop_gradient(
      level_log_ratio(logp_train_BxT, logp_behaviour_BxT, mask_BxT, level))
  if mode == "truncate":
    w_BxT = jnp.exp(jnp.minimum(log_w_BxT, jnp.log(jnp.asarray(cap, _F32))))
  elif mode == "mask":
    lo, hi = (jnp.log(jnp.asarray(x, _F32)) for x in (low, high))  # log 0 = -inf keeps all below
    inside_BxT = (log_w_BxT >= lo) & (log_w_BxT <= hi)
    w_BxT = jnp.where(inside_BxT, jnp.exp(jnp.minimum(log_w_BxT, hi)), 0.0)
  else:
    raise ValueError(f"correction_weight: unknown mode {mode!r}")
  return jnp.where(mask_BxT, w_BxT, 0.0)


def weight_metrics(weight_BxT: jax.Array, mask_BxT: jax.Array) -> dict[str, jax.Array]:
  """The applied correction weights over the masked tokens (TRL's names for the ratio it
  applies), and the share of tokens the mask mode dropped (weight 0; verl's name)."""
  mask_BxT = mask_BxT.astype(bool)
  any_token = jnp.any(mask_BxT)
  w_BxT = jax.lax.stop_gradient(weight_BxT.astype(_F32))
  return {
      "sampling/importance_sampling_ratio/mean": _mean(w_BxT, mask_BxT),
      "sampling/importance_sampling_ratio/min": jnp.where(
          any_token, jnp.min(jnp.where(mask_BxT, w_BxT, jnp.inf)), 0.0),
      "sampling/importance_sampling_ratio/max": jnp.where(
          any_token, jnp.max(jnp.where(mask_BxT, w_BxT, -jnp.inf)), 0.0),
      "rollout_corr/rollout_rs_masked_fraction": _mean((w_BxT == 0).astype(_F32), mask_BxT),
  }


def check_correction(level: str, mode: str, cap: float, low: float, high: float) -> None:
  """One-line errors naming the `loss.rollout_correction*` key that is out of range."""
  if level not in CORRECTION_LEVELS:
    raise UserError(f"loss.rollout_correction: unknown {level!r}; use one of {CORRECTION_LEVELS}")
  if mode not in CORRECTION_MODES:
    raise UserError(f"loss.rollout_correction_mode: unknown {mode!r}; use one of {CORRECTION_MODES}")
  for name, value in (("cap", cap), ("low", low), ("high", high)):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
      raise UserError(f"loss.rollout_correction_{name}: must be a number, got {value!r}")
  if not cap > 0:
    raise UserError(f"loss.rollout_correction_cap: must be > 0, got {cap!r}")
  if not high > 0:
    raise UserError(f"loss.rollout_correction_high: must be > 0, got {high!r}")
  if not 0 <= low < high:
    raise UserError(f"loss.rollout_correction_low: must be >= 0 and < loss.rollout_correction_high "
                    f"({high!r}), got {low!r}")
