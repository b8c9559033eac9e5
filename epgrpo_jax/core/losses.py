"""Token log-probs and entropies from the LM head, and the clipped policy loss (eq. 5).

Shape suffixes: B sequences, T tokens, D hidden, V vocabulary, N = B * T
flattened tokens, C a chunk.

`token_logprob_entropy` never holds the [B, T, V] logits: it walks token
chunks x vocabulary chunks with an online log-sum-exp, and a custom VJP
recomputes each chunk's logits in the backward pass, so forward and backward
hold O(token_chunk * vocab_chunk) logits at a time. A size that a chunk does
not divide is handled by letting the last chunk overlap its predecessor (the
overlap is masked out of every sum), so nothing is padded or copied.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from epgrpo_jax.core import mismatch
from epgrpo_jax.io.errors import UserError

_F32 = jnp.float32
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_sum_max_len")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


def naive_token_logprob_entropy(hidden_BxTxD: jax.Array, head_DxV: jax.Array,
                                targets_BxT: jax.Array, *,
                                temperature: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """Reference: full float32 logits, log-softmax, `(logp_BxT, entropy_BxT)`."""
  logits_BxTxV = jnp.einsum("btd,dv->btv", hidden_BxTxD, head_DxV,
                            preferred_element_type=_F32) / temperature
  logprobs_BxTxV = jax.nn.log_softmax(logits_BxTxV, axis=-1)
  logp_BxT = jnp.take_along_axis(logprobs_BxTxV, targets_BxT[..., None].astype(jnp.int32),
                                 axis=-1)[..., 0]
  entropy_BxT = -jnp.sum(jnp.exp(logprobs_BxTxV) * logprobs_BxTxV, axis=-1)
  return logp_BxT, entropy_BxT


def token_logprob_entropy(hidden_BxTxD: jax.Array, head_DxV: jax.Array, targets_BxT: jax.Array,
                          *, temperature: float = 1.0, vocab_chunk: int = 8192,
                          token_chunk: int = 1024) -> tuple[jax.Array, jax.Array]:
  """Log-prob of `targets_BxT` and full-vocabulary entropy under softmax(logits / temperature).

  Float32 results `(logp_BxT, entropy_BxT)`, differentiable wrt `hidden_BxTxD`
  and `head_DxV` (their gradients come back in their dtypes); matmuls
  accumulate in float32. Targets outside [0, V) give finite garbage log-probs
  (mask them). Peak memory is a few [token_chunk, vocab_chunk] float32 arrays.
  `temperature` and the chunk sizes are Python numbers (static under jit).
  """
  if not temperature > 0:
    raise ValueError(f"temperature: must be > 0, got {temperature}")
  if vocab_chunk < 1 or token_chunk < 1:
    raise ValueError(f"vocab_chunk, token_chunk: must be >= 1, got {vocab_chunk}, {token_chunk}")
  b, t, d = hidden_BxTxD.shape
  v = head_DxV.shape[1]
  if head_DxV.shape[0] != d or targets_BxT.shape != (b, t):
    raise ValueError(f"token_logprob_entropy: shapes hidden {hidden_BxTxD.shape}, head "
                     f"{head_DxV.shape}, targets {targets_BxT.shape} do not match")
  n = b * t
  if n == 0:
    return jnp.zeros((b, t), _F32), jnp.zeros((b, t), _F32)
  with jax.named_scope("lm_head"):  # a profile's head share (benchmarks/update_gpu.py)
    logp_N, entropy_N = _chunked_stats(hidden_BxTxD.reshape(n, d), head_DxV,
                                       targets_BxT.reshape(n).astype(jnp.int32), float(temperature),
                                       min(token_chunk, n), min(vocab_chunk, v))
  return logp_N.reshape(b, t), entropy_N.reshape(b, t)


def _chunk_start(i, chunk: int, size: int):
  """Start of chunk i; the last chunk is pulled back to end at `size`."""
  return jnp.minimum(i * chunk, size - chunk)


def _logits(h_CxD, head_DxV, c0, vc: int, temperature: float):
  w_DxC = lax.dynamic_slice_in_dim(head_DxV, c0, vc, axis=1)
  return jnp.dot(h_CxD, w_DxC, preferred_element_type=_F32) / temperature, w_DxC


def _dlogits(z_CxV, cols_V, t_C, lse_C, mean_C, glogp_C, gent_C, temperature: float):
  """Cotangent of the raw logits: d logp/dz = onehot - p, d H/dz = -p (z - E[z]); a cotangent
  that is None (a symbolic zero) drops its term."""
  p_CxV = jnp.exp(z_CxV - lse_C[:, None])
  dz_CxV = jnp.zeros_like(z_CxV)
  if glogp_C is not None:
    onehot_CxV = (cols_V[None, :] == t_C[:, None]).astype(_F32)
    dz_CxV = glogp_C[:, None] * (onehot_CxV - p_CxV)
  if gent_C is not None:
    dz_CxV = dz_CxV - gent_C[:, None] * p_CxV * (z_CxV - mean_C[:, None])
  return dz_CxV / temperature


def _forward(h_NxD, head_DxV, t_N, temperature, tc, vc):
  """`(logp_N, entropy_N, lse_N, mean_N)`; mean is E_p[z] of the tempered logits z."""
  n, v = h_NxD.shape[0], head_DxV.shape[1]
  num_t, num_v = -(-n // tc), -(-v // vc)

  def vocab_step(j, h_CxD, t_C):
    c0 = _chunk_start(j, vc, v)
    z_CxV, _ = _logits(h_CxD, head_DxV, c0, vc, temperature)
    cols_V = c0 + jnp.arange(vc)
    fresh_V = cols_V >= j * vc  # columns not already seen by chunk j - 1
    z_CxV = jnp.where(fresh_V[None, :], z_CxV, -jnp.inf)
    hit_CxV = fresh_V[None, :] & (cols_V[None, :] == t_C[:, None])
    return z_CxV, jnp.sum(jnp.where(hit_CxV, z_CxV, 0.0), axis=-1)

  def token_step(i, carry):
    r0 = _chunk_start(i, tc, n)
    h_CxD = lax.dynamic_slice_in_dim(h_NxD, r0, tc)
    t_C = lax.dynamic_slice_in_dim(t_N, r0, tc)
    # Online softmax state: max m, s = sum e^(z-m), u = sum e^(z-m) (z-m), target logit.
    z_CxV, zt_C = vocab_step(0, h_CxD, t_C)
    m_C = jnp.max(z_CxV, axis=-1)
    e_CxV = jnp.exp(z_CxV - m_C[:, None])
    state = (m_C, jnp.sum(e_CxV, -1), jnp.sum(e_CxV * (z_CxV - m_C[:, None]), -1), zt_C)

    def merge(j, state):
      m_C, s_C, u_C, zt_C = state
      z_CxV, hit_C = vocab_step(j, h_CxD, t_C)
      m_new_C = jnp.maximum(m_C, jnp.max(z_CxV, axis=-1))
      scale_C = jnp.exp(m_C - m_new_C)
      y_CxV = z_CxV - m_new_C[:, None]
      e_CxV = jnp.exp(y_CxV)
      s_new_C = s_C * scale_C + jnp.sum(e_CxV, -1)
      u_new_C = scale_C * (u_C + (m_C - m_new_C) * s_C) + jnp.sum(
          jnp.where(e_CxV > 0, e_CxV * y_CxV, 0.0), -1)
      return m_new_C, s_new_C, u_new_C, zt_C + hit_C

    m_C, s_C, u_C, zt_C = lax.fori_loop(1, num_v, merge, state)
    lse_C = m_C + jnp.log(s_C)
    out = (zt_C - lse_C, jnp.log(s_C) - u_C / s_C, lse_C, m_C + u_C / s_C)
    return tuple(lax.dynamic_update_slice_in_dim(a, b, r0, 0) for a, b in zip(carry, out))

  init = tuple(jnp.zeros((n,), _F32) for _ in range(4))
  return lax.fori_loop(0, num_t, token_step, init)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _chunked_stats(h_NxD, head_DxV, t_N, temperature, tc, vc):
  logp_N, entropy_N, _, _ = _forward(h_NxD, head_DxV, t_N, temperature, tc, vc)
  return logp_N, entropy_N


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Wanted:
  """Which gradients the backward pass forms (static: a frozen head under LoRA needs none)."""

  hidden: bool
  head: bool


def _chunked_stats_fwd(h_NxD, head_DxV, t_N, temperature, tc, vc):
  """Symbolic-zeros forward rule: the primals come with whether each is differentiated."""
  wanted = _Wanted(hidden=h_NxD.perturbed, head=head_DxV.perturbed)
  h_NxD, head_DxV, t_N = h_NxD.value, head_DxV.value, t_N.value
  logp_N, entropy_N, lse_N, mean_N = _forward(h_NxD, head_DxV, t_N, temperature, tc, vc)
  return (logp_N, entropy_N), (h_NxD, head_DxV, t_N, lse_N, mean_N, wanted)


def _cotangent(g):
  """An output's cotangent as float32, or None where it is a symbolic zero."""
  return None if isinstance(g, jax.custom_derivatives.SymbolicZero) else g.astype(_F32)


def _chunked_stats_bwd(temperature, tc, vc, res, cotangents):
  """One pass over the (token chunk, vocabulary chunk) pairs: each chunk's logits are
  recomputed once, exponentiated once (`_dlogits`), and feed both gradients, d hidden (dz W^T)
  and, when the head is differentiated, d head (h^T dz).

  With the head gradient the vocabulary chunks run outside (each chunk's d head accumulates
  over the token chunks in a [D, vc] float32 block; d hidden in one [N, D] float32 array);
  without it (LoRA) the token chunks run outside, each accumulating its [tc, D] d hidden
  block over the vocabulary. A chunk pulled back to end at the array's end masks the rows
  or columns its predecessor covered, so nothing is counted twice.
  """
  h_NxD, head_DxV, t_N, lse_N, mean_N, wanted = res
  glogp_N, gent_N = (_cotangent(g) for g in cotangents)
  if (glogp_N is None and gent_N is None) or not (wanted.hidden or wanted.head):
    return None, None, None
  (n, d), v = h_NxD.shape, head_DxV.shape[1]
  num_t, num_v = -(-n // tc), -(-v // vc)
  rows = lambda a, r0: None if a is None else lax.dynamic_slice_in_dim(a, r0, tc)

  def chunk(i, j):
    """(h chunk, head chunk, dz of the fresh rows and columns, dz of the fresh rows)."""
    r0, c0 = _chunk_start(i, tc, n), _chunk_start(j, vc, v)
    h_CxD = rows(h_NxD, r0)
    z_CxV, w_DxC = _logits(h_CxD, head_DxV, c0, vc, temperature)
    dz_CxV = _dlogits(z_CxV, c0 + jnp.arange(vc), rows(t_N, r0), rows(lse_N, r0),
                      rows(mean_N, r0), rows(glogp_N, r0), rows(gent_N, r0), temperature)
    dz_rows = jnp.where((r0 + jnp.arange(tc) >= i * tc)[:, None], dz_CxV, 0.0)
    dz_fresh = jnp.where((c0 + jnp.arange(vc) >= j * vc)[None, :], dz_rows, 0.0)
    return r0, c0, h_CxD, w_DxC, dz_fresh, dz_rows

  dh_to_rows = lambda dz_CxV, w_DxC: jnp.einsum("cv,dv->cd", dz_CxV, w_DxC,
                                                preferred_element_type=_F32)
  if not wanted.head:  # d hidden only: token chunks outside
    def hidden_chunk(i, dh_NxD):
      def add(j, acc_CxD):
        _, _, _, w_DxC, dz_fresh, _ = chunk(i, j)
        return acc_CxD + dh_to_rows(dz_fresh, w_DxC)

      acc_CxD = lax.fori_loop(0, num_v, add, jnp.zeros((tc, d), _F32))
      # Rows shared with the previous chunk get their (masked) zero share added.
      return lax.dynamic_update_slice_in_dim(
          dh_NxD, rows(dh_NxD, _chunk_start(i, tc, n)) + acc_CxD, _chunk_start(i, tc, n), 0)

    dh_NxD = lax.fori_loop(0, num_t, hidden_chunk, jnp.zeros((n, d), _F32))
    return dh_NxD.astype(h_NxD.dtype), None, None

  def head_chunk(j, carry):
    dh_NxD, dw_DxV = carry

    def add(i, inner):
      dh_NxD, acc_DxC = inner
      r0, _, h_CxD, w_DxC, dz_fresh, dz_rows = chunk(i, j)
      if wanted.hidden:
        dh_NxD = lax.dynamic_update_slice_in_dim(dh_NxD, rows(dh_NxD, r0)
                                                 + dh_to_rows(dz_fresh, w_DxC), r0, 0)
      acc_DxC = acc_DxC + jnp.einsum("cd,cv->dv", h_CxD, dz_rows, preferred_element_type=_F32)
      return dh_NxD, acc_DxC

    dh_NxD, acc_DxC = lax.fori_loop(0, num_t, add, (dh_NxD, jnp.zeros((d, vc), _F32)))
    # Columns shared with the previous chunk are rewritten with the same values.
    c0 = _chunk_start(j, vc, v)
    return dh_NxD, lax.dynamic_update_slice_in_dim(dw_DxV, acc_DxC.astype(dw_DxV.dtype), c0, 1)

  dh_NxD = jnp.zeros((n, d) if wanted.hidden else (0, d), _F32)
  dh_NxD, dw_DxV = lax.fori_loop(0, num_v, head_chunk, (dh_NxD, jnp.zeros_like(head_DxV)))
  return (dh_NxD.astype(h_NxD.dtype) if wanted.hidden else None), dw_DxV, None


_chunked_stats.defvjp(_chunked_stats_fwd, _chunked_stats_bwd, symbolic_zeros=True)


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
  `mismatch.correction_weight` (the KL term and the denominator stay as they are, as TRL).

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
  per_token_BxT = jnp.where(mask_BxT, -(surrogate_BxT - cfg.beta * kl_BxT), 0.0)

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
  if entropy_BxT is not None:
    aux["entropy"] = jax.lax.stop_gradient(
        _masked_mean(entropy_BxT.astype(_F32), mask_BxT, num_tokens))
  return loss, aux
