"""The clipped policy loss (eq. 5), its aggregations and the rival methods' options.

Shape suffixes: B sequences, T tokens. The token log-probs and entropies it takes come from
`core.token_stats` (chunked over the LM head).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from epgrpo_jax.core import mismatch
from epgrpo_jax.io.errors import UserError

_F32 = jnp.float32
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_sum_max_len")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")




@dataclasses.dataclass(frozen=True)
class LossConfig:
  """Clipped-surrogate loss with k3 KL (eq. 5) and its aggregation."""

  eps_low: float = 0.2
  eps_high: float = 0.2
  beta: float = 0.001
  aggregation: str = "token_mean"  # or "seq_mean_token_mean", "seq_sum_max_len" (Dr.GRPO)
  max_len: int | None = None  # Dr.GRPO normaliser; None: the batch's T
  # "80/20": the surrogate only on the top q of the batch's tokens by entropy (1.0: all).
  top_entropy_quantile: float = 1.0
  # "sequence": GSPO's length-normalised sequence ratio, clipped per sequence.
  importance_sampling_level: str = "token"
  # DAPO overlong filtering: completions without a stop token leave the loss (trainer).
  mask_truncated_completions: bool = False
  # Sampler/trainer mismatch (core/mismatch.py): "none", or the level of the importance weight
  # pi_old / mu (mu: the sampler's log-probs) on the surrogate: "token", "sequence", "geometric".
  rollout_correction: str = "none"
  rollout_correction_mode: str = "truncate"  # TIS: min(w, cap); "mask" (MIS): w in [low, high]
  rollout_correction_cap: float = 2.0  # also the [1/cap, cap] of the mismatch metrics
  rollout_correction_low: float = 0.5
  rollout_correction_high: float = 2.0
  # The KL term weighted by the same detached weights as the surrogate (an importance-sampled
  # k3 estimate of KL(pi || ref) over the sampler's tokens; docs/async.md). Needs a correction.
  rollout_correction_kl: bool = False

  def __post_init__(self):
    if not 0 <= self.eps_low < 1:
      raise UserError(f"loss.eps_low: must be in [0, 1), got {self.eps_low!r}")
    if not self.eps_high >= 0:
      raise UserError(f"loss.eps_high: must be >= 0, got {self.eps_high!r}")
    if not self.beta >= 0:
      raise UserError(f"loss.beta: must be >= 0, got {self.beta!r}")
    if self.aggregation not in AGGREGATIONS:
      raise UserError(f"loss.aggregation: unknown {self.aggregation!r}; use one of {AGGREGATIONS}")
    if self.max_len is not None and (not isinstance(self.max_len, int) or self.max_len < 1):
      raise UserError(f"loss.max_len: must be None or an int >= 1, got {self.max_len!r}")
    q = self.top_entropy_quantile
    if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0 < q <= 1:
      raise UserError(f"loss.top_entropy_quantile: must be in (0, 1], got {q!r}")
    if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
      raise UserError(f"loss.importance_sampling_level: unknown "
                       f"{self.importance_sampling_level!r}; use one of "
                       f"{IMPORTANCE_SAMPLING_LEVELS}")
    if not isinstance(self.mask_truncated_completions, bool):
      raise UserError(f"loss.mask_truncated_completions: must be a bool, got "
                       f"{self.mask_truncated_completions!r}")
    mismatch.check_correction(self.rollout_correction, self.rollout_correction_mode,
                              self.rollout_correction_cap, self.rollout_correction_low,
                              self.rollout_correction_high)
    if not isinstance(self.rollout_correction_kl, bool):
      raise UserError(f"loss.rollout_correction_kl: must be a bool, got {self.rollout_correction_kl!r}")
    if self.rollout_correction_kl and self.rollout_correction == "none":
      raise UserError("loss.rollout_correction_kl: true weights the KL term by the correction's "
                      "weights, and loss.rollout_correction is 'none'; set it to token, sequence "
                      "or geometric")

  def replace(self, **kw: Any) -> LossConfig:
    return dataclasses.replace(self, **kw)


def _masked_mean(x_BxT, mask_BxT, count):
  return jnp.sum(jnp.where(mask_BxT, x_BxT, 0.0)) / jnp.maximum(count, 1.0)


def masked_quantile(x_BxT: jax.Array, mask_BxT: jax.Array, q: float) -> jax.Array:
  """The q-quantile of the masked values, interpolated linearly between order statistics.

  The definition of `numpy.quantile` / `torch.quantile` (default "linear"): with
  the n masked values sorted, `v[floor(p)] + (p - floor(p)) (v[floor(p) + 1] -
  v[floor(p)])`, p = q (n - 1). +inf when nothing is masked.
  """
  v_N = jnp.sort(jnp.where(mask_BxT, x_BxT.astype(_F32), jnp.inf).reshape(-1))
  n = jnp.sum(mask_BxT.astype(jnp.int32))
  pos = q * jnp.maximum(n - 1, 0).astype(_F32)
  lo = jnp.floor(pos).astype(jnp.int32)
  hi = jnp.minimum(lo + 1, jnp.maximum(n - 1, 0))
  frac = pos - lo.astype(_F32)
  low, high = v_N[lo], v_N[hi]
  return jnp.where(frac > 0, low + frac * (high - low), low)


def high_entropy_mask(entropy_BxT: jax.Array, mask_BxT: jax.Array, *, quantile: float) -> jax.Array:
  """The top-`quantile` tokens by entropy ("Beyond the 80/20 rule"; TRL's `top_entropy_quantile`).

  Keeps the masked tokens whose entropy is >= the (1 - quantile)-quantile of
  the entropies of all masked tokens of the batch (`masked_quantile`); ties at
  the threshold are all kept. A constant of the loss (no gradient).
  """
  entropy_BxT = jax.lax.stop_gradient(entropy_BxT.astype(_F32))
  threshold = masked_quantile(entropy_BxT, mask_BxT, 1.0 - quantile)
  return mask_BxT & (entropy_BxT >= threshold)


def sequence_log_ratio(logp_BxT: jax.Array, logp_old_BxT: jax.Array,
                       mask_BxT: jax.Array) -> jax.Array:
  """GSPO's sequence log-ratio in its token form ("GSPO-token"), 0 on padding.

  `log s_i = mean_t (logp - logp_old)` over the response's tokens (length
  normalised); each token gets `sg(log s_i) + logp_t - sg(logp_t)`: its value is
  log s_i for every token of the sequence, its gradient that of logp_t, so
  `exp` of it has the value s_i and the gradient s_i d logp_t.
  """
  log_ratio_BxT = jnp.where(mask_BxT, logp_BxT - logp_old_BxT, 0.0)
  length_B = jnp.maximum(jnp.sum(mask_BxT.astype(_F32), axis=-1), 1.0)
  log_s_B = jax.lax.stop_gradient(jnp.sum(log_ratio_BxT, axis=-1) / length_B)
  token_BxT = logp_BxT - jax.lax.stop_gradient(logp_BxT)
  return jnp.where(mask_BxT, log_s_B[:, None] + token_BxT, 0.0)


def corrected_kl(kl_BxT: jax.Array, weight_BxT: jax.Array) -> jax.Array:
  """The per-token k3 KL weighted by the detached importance weight w_t = pi_old / mu of the
  token's sampler: `w_t * KL_k3(t)`. Over tokens drawn from mu, its mean estimates
  KL(pi || ref) as the plain k3 mean does over tokens drawn from pi; a token the policy has
  since made unlikely (pi << mu, where exp(log ref - log pi) explodes) counts with the small
  weight its probability now has."""
  return jax.lax.stop_gradient(weight_BxT) * kl_BxT


def policy_loss(logp_BxT: jax.Array, logp_old_BxT: jax.Array, logp_ref_BxT: jax.Array,
                adv_BxT: jax.Array, mask_BxT: jax.Array, cfg: LossConfig = LossConfig(),
                entropy_BxT: jax.Array | None = None, *, denominator: jax.Array | None = None,
                logp_behaviour_BxT: jax.Array | None = None
                ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Clipped surrogate with the token advantage and k3 KL to the reference (eq. 5).

  Per token: `rho = exp(logp - logp_old)`,
  `l = -(min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A) - beta KL_k3)`,
  `KL_k3 = exp(logp_ref - logp) - (logp_ref - logp) - 1`. Only `logp_BxT`
  carries gradients. The loss is `numerator / denominator`:

    token_mean:          sum_{b,t} l / #tokens
    seq_mean_token_mean: sum_b (sum_t l / |o_b|) / #non-empty sequences
    seq_sum_max_len:     sum_b (sum_t l / max_len) / B          (Dr.GRPO)

  `cfg.importance_sampling_level="sequence"` (GSPO) replaces rho by the sequence
  ratio s_i of `sequence_log_ratio`, so clipping acts per sequence.
  `cfg.top_entropy_quantile` < 1 keeps the surrogate only on the tokens of
  `high_entropy_mask(entropy_BxT)` (required then); the KL term and the
  denominator still cover every token (as TRL).

  `logp_behaviour_BxT`, the sampler's log-probs, adds the mismatch metrics of `logp_old_BxT`
  against them (`mismatch.rollout_mismatch`) to `aux`; `cfg.rollout_correction` other than
  "none" (which requires them) multiplies each token's surrogate by the detached
  `mismatch.correction_weight` (the KL term and the denominator stay as they are, as TRL);
  `cfg.rollout_correction_kl` multiplies each token's KL term by it too (`corrected_kl`; the
  mean of the weighted term is in `aux` whenever a correction is on).

  Both parts are in `aux` ("loss_numerator", "loss_denominator"). For exact
  gradient accumulation over micro-batches, pass the full batch's denominator
  as `denominator` (each micro-batch's loss is then its share of the full
  loss, and the gradients add up), or weight each micro-batch's gradient by
  its denominator and divide by their sum. With seq_sum_max_len, set
  `cfg.max_len` so that every micro-batch uses the same normaliser.
  """
  mask_BxT = mask_BxT.astype(bool)
  adv_BxT = jax.lax.stop_gradient(adv_BxT.astype(_F32))
  logp_BxT = logp_BxT.astype(_F32)
  logp_old_BxT = jax.lax.stop_gradient(logp_old_BxT.astype(_F32))
  logp_ref_BxT = jax.lax.stop_gradient(logp_ref_BxT.astype(_F32))
  # Padding may hold garbage: neutralise it before exp so nothing overflows into NaN.
  if cfg.importance_sampling_level == "sequence":
    log_ratio_BxT = sequence_log_ratio(logp_BxT, logp_old_BxT, mask_BxT)
  else:
    log_ratio_BxT = jnp.where(mask_BxT, logp_BxT - logp_old_BxT, 0.0)
  ref_gap_BxT = jnp.where(mask_BxT, logp_ref_BxT - logp_BxT, 0.0)
  adv_BxT = jnp.where(mask_BxT, adv_BxT, 0.0)

  rho_BxT = jnp.exp(log_ratio_BxT)
  clipped_BxT = jnp.clip(rho_BxT, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
  surrogate_BxT = jnp.minimum(rho_BxT * adv_BxT, clipped_BxT * adv_BxT)
  if cfg.top_entropy_quantile < 1.0:
    if entropy_BxT is None:
      raise ValueError("loss.top_entropy_quantile < 1 needs the token entropies (entropy_BxT)")
    selected_BxT = high_entropy_mask(entropy_BxT, mask_BxT, quantile=cfg.top_entropy_quantile)
    surrogate_BxT = jnp.where(selected_BxT, surrogate_BxT, 0.0)
  if cfg.rollout_correction != "none":
    if logp_behaviour_BxT is None:
      raise ValueError("loss.rollout_correction needs the sampler's log-probs (logp_behaviour_BxT)")
    weight_BxT = mismatch.correction_weight(
        logp_old_BxT, logp_behaviour_BxT, mask_BxT, level=cfg.rollout_correction,
        mode=cfg.rollout_correction_mode, cap=cfg.rollout_correction_cap,
        low=cfg.rollout_correction_low, high=cfg.rollout_correction_high)
    surrogate_BxT = surrogate_BxT * weight_BxT
  kl_BxT = jnp.exp(ref_gap_BxT) - ref_gap_BxT - 1.0
  kl_term_BxT = corrected_kl(kl_BxT, weight_BxT) if cfg.rollout_correction_kl else kl_BxT
  per_token_BxT = jnp.where(mask_BxT, -(surrogate_BxT - cfg.beta * kl_term_BxT), 0.0)

  m_BxT = mask_BxT.astype(_F32)
  length_B = jnp.sum(m_BxT, axis=-1)
  num_tokens = jnp.sum(length_B)
  if cfg.aggregation == "token_mean":
    numerator = jnp.sum(per_token_BxT)
    own_denominator = num_tokens
  elif cfg.aggregation == "seq_mean_token_mean":
    numerator = jnp.sum(jnp.sum(per_token_BxT, axis=-1) / jnp.maximum(length_B, 1.0))
    own_denominator = jnp.sum((length_B > 0).astype(_F32))
  else:
    max_len = cfg.max_len if cfg.max_len is not None else mask_BxT.shape[-1]
    numerator = jnp.sum(per_token_BxT) / max_len
    own_denominator = jnp.asarray(mask_BxT.shape[0], _F32)
  norm = own_denominator if denominator is None else jnp.asarray(denominator, _F32)
  loss = numerator / jnp.maximum(norm, 1e-8)

  low_BxT = (rho_BxT < 1.0 - cfg.eps_low) & (adv_BxT < 0)
  high_BxT = (rho_BxT > 1.0 + cfg.eps_high) & (adv_BxT > 0)
  adv_mean = _masked_mean(adv_BxT, mask_BxT, num_tokens)
  aux = {
      "loss_numerator": jax.lax.stop_gradient(numerator),
      "loss_denominator": own_denominator,
      "num_tokens": num_tokens,
      "clip_ratio/low_mean": _masked_mean(low_BxT.astype(_F32), mask_BxT, num_tokens),
      "clip_ratio/high_mean": _masked_mean(high_BxT.astype(_F32), mask_BxT, num_tokens),
      "clip_ratio/region_mean": _masked_mean((low_BxT | high_BxT).astype(_F32), mask_BxT,
                                             num_tokens),
      "kl": jax.lax.stop_gradient(_masked_mean(kl_BxT, mask_BxT, num_tokens)),
      "ratio/mean": jax.lax.stop_gradient(_masked_mean(rho_BxT, mask_BxT, num_tokens)),
      "advantage/mean": adv_mean,
      "advantage/std": jnp.sqrt(_masked_mean(jnp.square(adv_BxT - adv_mean), mask_BxT,
                                             num_tokens)),
      "advantage/min": jnp.where(num_tokens > 0, jnp.min(jnp.where(mask_BxT, adv_BxT, jnp.inf)),
                                 0.0),
      "advantage/max": jnp.where(num_tokens > 0, jnp.max(jnp.where(mask_BxT, adv_BxT, -jnp.inf)),
                                 0.0),
  }
  if cfg.top_entropy_quantile < 1.0:
    aux["entropy_mask/kept_frac"] = _masked_mean(selected_BxT.astype(_F32), mask_BxT, num_tokens)
  if logp_behaviour_BxT is not None:
    aux.update(mismatch.rollout_mismatch(logp_old_BxT, logp_behaviour_BxT, mask_BxT,
                                         cap=cfg.rollout_correction_cap))
  if cfg.rollout_correction != "none":
    aux.update(mismatch.weight_metrics(weight_BxT, mask_BxT))
    aux["rollout_corr/weighted_ref_kl"] = jax.lax.stop_gradient(
        _masked_mean(corrected_kl(kl_BxT, weight_BxT), mask_BxT, num_tokens))
  if entropy_BxT is not None:
    aux["entropy"] = jax.lax.stop_gradient(
        _masked_mean(entropy_BxT.astype(_F32), mask_BxT, num_tokens))
  return loss, aux
