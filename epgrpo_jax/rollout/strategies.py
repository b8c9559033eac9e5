"""Per-step sampling strategies: pure functions on [B, V] float32 logits.

Truncation follows transformers' order: temperature, then top-k, then top-p
(on the distribution renormalised after top-k). Both cut-offs are thresholds
found by a fixed-length bisection over the bits of the values, so no step sorts the
vocabulary or loops on data; ties at a threshold are always kept (see `docs/sampling.md`).
`sample_step` picks one token per row; `rollout.sampling.Sampler` calls it at
every decode step.
"""

from __future__ import annotations

from typing import Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from epgrpo_jax.kernels.cpu import row_uniforms

_INT_MAX = np.iinfo(np.int32).max


class StepConfig(Protocol):
  """What `sample_step` reads of a `rollout.sampling.SamplingConfig`."""

  @property
  def is_greedy(self) -> bool: ...

  @property
  def temperature(self) -> float: ...

  @property
  def top_k(self) -> int: ...

  @property
  def top_p(self) -> float: ...


def _to_key(x):
  """int32 keys ordered like the float32 values, for either sign (-0.0 maps like 0.0)."""
  x = x.astype(jnp.float32)
  i = lax.bitcast_convert_type(jnp.where(x == 0, jnp.float32(0), x), jnp.int32)
  return jnp.where(i < 0, i ^ jnp.int32(_INT_MAX), i)


def _from_key(k):
  """The float32 with ordered key `k` (inverse of `_to_key`)."""
  return lax.bitcast_convert_type(jnp.where(k < 0, k ^ jnp.int32(_INT_MAX), k), jnp.float32)


def largest_threshold(values_BxV: jax.Array, weights_BxV: jax.Array, target_B: jax.Array) -> jax.Array:
  """Per row, the largest value t among the row's values with sum(weights[values >= t]) >= target.

  A bisection over the float bits (as ordered int keys) with a fixed number of passes:
  the largest key k in [key(min), key(max)] with mass(values >= k) >= target is a value's
  key (the mass changes only at values), and 32 halvings of that range find it, each pass
  one masked sum over the row, then one pass for the value at the bound. No data-dependent loop, so on an accelerator the decode step
  never waits for the host. Exact: no rounding of thresholds. If no value reaches the
  target, returns the row's smallest value. Values must not be NaN.
  """
  values_BxV = values_BxV.astype(jnp.float32)
  lo_B = _to_key(jnp.min(values_BxV, axis=-1))  # mass(lo) >= target (unless none is)
  hi_B = _to_key(jnp.max(values_BxV, axis=-1)) + 1  # mass(hi) < target

  def halve(_, carry):
    lo_B, hi_B = carry
    open_B = hi_B - 1 > lo_B  # not hi - lo > 1: keys of both signs are more than 2^31 apart
    mid_B = (lo_B | hi_B) - ((lo_B ^ hi_B) >> 1)  # ceil((lo + hi) / 2) without overflow
    mass_B = jnp.sum(jnp.where(values_BxV >= _from_key(mid_B)[:, None], weights_BxV, 0), axis=-1)
    ok_B = mass_B >= target_B
    return jnp.where(open_B & ok_B, mid_B, lo_B), jnp.where(open_B & ~ok_B, mid_B, hi_B)

  lo_B, _ = lax.fori_loop(0, 32, halve, (lo_B, hi_B))  # hi - lo < 2^32: 32 halvings close it
  # lo is a value's key, unless the backend compares denormals as zero (XLA:CPU does): a
  # denormal bound then acts as 0, so take the smallest value at or above it (0.0, not -0.0).
  t_B = _from_key(lo_B)
  t_B = jnp.min(jnp.where(values_BxV >= t_B[:, None], values_BxV, jnp.inf), axis=-1)
  return jnp.where(t_B == 0, jnp.float32(0), t_B)


Threshold = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]  # as largest_threshold


def top_k_mask(logits_BxV: jax.Array, k: int, threshold: Threshold = largest_threshold) -> jax.Array:
  """Keeps every token whose logit is >= the k-th largest (ties at the k-th all kept).

  `threshold` computes `largest_threshold` (the C++ kernel in the CPU sampler).
  """
  if k <= 0 or k >= logits_BxV.shape[-1]:
    return jnp.ones(logits_BxV.shape, bool)
  logits_BxV = logits_BxV.astype(jnp.float32)
  ones_BxV = jnp.ones(logits_BxV.shape, jnp.float32)
  kth_B = threshold(logits_BxV, ones_BxV, jnp.full(logits_BxV.shape[:1], k, jnp.float32))
  return logits_BxV >= kth_B[:, None]


def top_p_mask(probs_BxV: jax.Array, top_p: float, threshold: Threshold = largest_threshold) -> jax.Array:
  """Keeps every token with probability >= tau, tau being the smallest probability
  of the shortest most-likely-first prefix whose mass reaches `top_p` (ties at tau
  all kept). `probs_BxV` must be >= 0 (zeros for tokens already removed)."""
  if top_p >= 1.0:
    return jnp.ones(probs_BxV.shape, bool)
  probs_BxV = probs_BxV.astype(jnp.float32)
  target_B = jnp.full(probs_BxV.shape[:1], top_p, jnp.float32)
  tau_B = threshold(probs_BxV, probs_BxV, target_B)
  return probs_BxV >= tau_B[:, None]


def _softmax(x_BxV: jax.Array) -> jax.Array:
  """exp(x - logsumexp(x)), the form every strategy (and the tests' reference) uses."""
  return jnp.exp(x_BxV - jax.nn.logsumexp(x_BxV, axis=-1, keepdims=True))


def truncate(scaled_BxV: jax.Array, top_k: int = 0, top_p: float = 1.0,
             probs_BxV: jax.Array | None = None, threshold: Threshold = largest_threshold) -> jax.Array:
  """Top-k then top-p on temperature-scaled logits; returns the kept mask [B, V].

  `probs_BxV`, the softmax of `scaled_BxV`, may be passed in to save a pass.
  """
  keep_BxV = top_k_mask(scaled_BxV, top_k, threshold)
  if top_p < 1.0:
    if top_k > 0 or probs_BxV is None:
      probs_BxV = _softmax(jnp.where(keep_BxV, scaled_BxV, -jnp.inf))
    keep_BxV &= top_p_mask(probs_BxV, top_p, threshold)
  return keep_BxV


def _block_size(v: int) -> int:
  return max(8, 1 << ((int(np.ceil(np.sqrt(v))) - 1).bit_length()))


def _inclusive_cumsum(x_BxM: jax.Array) -> jax.Array:
  """Cumulative sum over a short last axis as one small matmul (XLA's CPU cumsum is slow)."""
  m = x_BxM.shape[-1]
  upper_MxM = jnp.triu(jnp.ones((m, m), x_BxM.dtype))
  return jnp.dot(x_BxM, upper_MxM, precision=lax.Precision.HIGHEST)


def _last_true(mask_BxM: jax.Array) -> jax.Array:
  m = mask_BxM.shape[-1]
  return m - 1 - jnp.argmax(mask_BxM[:, ::-1], axis=-1)


def categorical(key: jax.Array, weights_BxV: jax.Array) -> jax.Array:
  """Draws token i with probability w_i / sum(w) (w >= 0, some w > 0 per row).

  Inverse-CDF sampling with one uniform per row (`row_uniforms`: `key` is one key or [B]
  keys), in two levels (a block of the vocabulary, then a token within it), so no [B, V]
  cumsum or [B, V] random numbers. A token with zero weight is never drawn.
  """
  b, v = weights_BxV.shape
  bs = _block_size(v)
  nb = -(-v // bs)
  w_BxNbxBs = jnp.pad(weights_BxV.astype(jnp.float32), ((0, 0), (0, nb * bs - v))).reshape(b, nb, bs)
  block_BxNb = jnp.sum(w_BxNbxBs, axis=-1)
  block_cum_BxNb = _inclusive_cumsum(block_BxNb)
  u_B = row_uniforms(key, b) * block_cum_BxNb[:, -1]

  def pick(cum_BxM, w_BxM, u_B):  # first index with cum > u and w > 0; else the last w > 0
    hit_BxM = (cum_BxM > u_B[:, None]) & (w_BxM > 0)
    return jnp.where(jnp.any(hit_BxM, -1), jnp.argmax(hit_BxM, -1), _last_true(w_BxM > 0))

  blk_B = pick(block_cum_BxNb, block_BxNb, u_B)
  before_B = jnp.take_along_axis(block_cum_BxNb - block_BxNb, blk_B[:, None], 1)[:, 0]
  row_BxBs = jnp.take_along_axis(w_BxNbxBs, blk_B[:, None, None], 1)[:, 0]
  j_B = pick(_inclusive_cumsum(row_BxBs), row_BxBs, u_B - before_B)
  return (blk_B * bs + j_B).astype(jnp.int32)


def log_prob_and_entropy(scaled_BxV: jax.Array, tokens_B: jax.Array, lse_B: jax.Array | None = None,
                         probs_BxV: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """log p(token) and the entropy of softmax(scaled) over the full vocabulary.

  `lse_B` (logsumexp of scaled) and `probs_BxV` (the softmax) may be passed in.
  """
  if lse_B is None:
    lse_B = jax.nn.logsumexp(scaled_BxV, axis=-1)
  if probs_BxV is None:
    probs_BxV = jnp.exp(scaled_BxV - lse_B[:, None])
  entropy_B = -jnp.sum(probs_BxV * (scaled_BxV - lse_B[:, None]), axis=-1)  # no cancellation
  logp_B = jnp.take_along_axis(scaled_BxV, tokens_B[:, None], 1)[:, 0] - lse_B
  return logp_B, entropy_B


def sample_step(key: jax.Array, logits_BxV: jax.Array, cfg: StepConfig,
                threshold: Threshold = largest_threshold):
  """One token per row: (tokens_B int32, logp_B, entropy_B); `key` is one key or [B] keys.

  logp and entropy are those of the temperature-scaled full distribution (not
  the truncated one); for greedy decoding, of temperature 1.
  """
  logits_BxV = logits_BxV.astype(jnp.float32)
  if cfg.is_greedy:
    tokens_B = jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    return (tokens_B, *log_prob_and_entropy(logits_BxV, tokens_B))
  scaled_BxV = logits_BxV / jnp.float32(cfg.temperature)
  lse_B = jax.nn.logsumexp(scaled_BxV, axis=-1)
  probs_BxV = jnp.exp(scaled_BxV - lse_B[:, None])  # = _softmax(scaled_BxV)
  keep_BxV = truncate(scaled_BxV, cfg.top_k, cfg.top_p, probs_BxV, threshold)
  tokens_B = categorical(key, jnp.where(keep_BxV, probs_BxV, 0.0))
  return (tokens_B, *log_prob_and_entropy(scaled_BxV, tokens_B, lse_B, probs_BxV))
