"""Token log-probs and entropies from the LM head, computed in chunks.

Shape suffixes: B sequences, T tokens, D hidden, V vocabulary, S row blocks of
M = B * T / S flattened tokens each, C a chunk.

`token_logprob_entropy` never holds the [B, T, V] logits: it walks token
chunks x vocabulary chunks with an online log-sum-exp, and a custom VJP
recomputes each chunk's logits in the backward pass, so forward and backward
hold O(token_chunk * vocab_chunk) logits at a time. A size that a chunk does
not divide is handled by letting the last chunk overlap its predecessor (the
overlap is masked out of every sum), so nothing is padded or copied.

With `row_blocks=S`, the rows are S equal blocks (the devices' shares of a batch
split over a mesh) and a token chunk is the same `token_chunk` positions of every
block: chunks are sliced along each block's own rows and written back into them,
so a batch axis split over devices stays split (a chunk of the flattened tokens
would span devices: each chunk would all-gather its rows, and the backward the
whole hidden-gradient buffer).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax


_F32 = jnp.float32

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
                          token_chunk: int = 1024,
                          row_blocks: int = 1) -> tuple[jax.Array, jax.Array]:
  """Log-prob of `targets_BxT` and full-vocabulary entropy under softmax(logits / temperature).

  Float32 results `(logp_BxT, entropy_BxT)`, differentiable wrt `hidden_BxTxD`
  and `head_DxV` (their gradients come back in their dtypes); matmuls
  accumulate in float32. Targets outside [0, V) give finite garbage log-probs
  (mask them). Peak memory is a few [row_blocks x token_chunk, vocab_chunk] float32 arrays
  (per device, [token_chunk, vocab_chunk] where each device holds one block).
  `row_blocks`: how many devices split the rows (B) of `hidden_BxTxD` (a number that does
  not divide B is read as 1). `temperature`, the chunk sizes and `row_blocks` are Python
  numbers (static under jit).
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
  s = row_blocks if row_blocks >= 1 and b % row_blocks == 0 else 1
  m = n // s
  with jax.named_scope("lm_head"):  # a profile's head share (benchmarks/update_gpu.py)
    logp_SxM, entropy_SxM = _chunked_stats(hidden_BxTxD.reshape(s, m, d), head_DxV,
                                           targets_BxT.reshape(s, m).astype(jnp.int32),
                                           float(temperature), min(token_chunk, m),
                                           min(vocab_chunk, v))
  return logp_SxM.reshape(b, t), entropy_SxM.reshape(b, t)


def _chunk_start(i, chunk: int, size: int):
  """Start of chunk i; the last chunk is pulled back to end at `size`."""
  return jnp.minimum(i * chunk, size - chunk)


def _rows(a_SxM, r0, tc: int):
  """Rows r0 .. r0 + tc of every block, flattened block by block: [S * tc, ...]."""
  c_SxC = lax.dynamic_slice_in_dim(a_SxM, r0, tc, axis=1)
  return c_SxC.reshape(-1, *c_SxC.shape[2:])


def _put_rows(a_SxM, x_C, r0):
  """`a_SxM` with rows r0 .. of every block replaced by `x_C` (`_rows`' layout)."""
  return lax.dynamic_update_slice_in_dim(a_SxM, x_C.reshape(a_SxM.shape[0], -1, *a_SxM.shape[2:]),
                                         r0, axis=1)


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


def _forward(h_SxMxD, head_DxV, t_SxM, temperature, tc, vc):
  """`(logp, entropy, lse, mean)`, each [S, M]; mean is E_p[z] of the tempered logits z."""
  m, v = h_SxMxD.shape[1], head_DxV.shape[1]
  num_t, num_v = -(-m // tc), -(-v // vc)

  def vocab_step(j, h_CxD, t_C):
    c0 = _chunk_start(j, vc, v)
    z_CxV, _ = _logits(h_CxD, head_DxV, c0, vc, temperature)
    cols_V = c0 + jnp.arange(vc)
    fresh_V = cols_V >= j * vc  # columns not already seen by chunk j - 1
    z_CxV = jnp.where(fresh_V[None, :], z_CxV, -jnp.inf)
    hit_CxV = fresh_V[None, :] & (cols_V[None, :] == t_C[:, None])
    return z_CxV, jnp.sum(jnp.where(hit_CxV, z_CxV, 0.0), axis=-1)

  def token_step(i, carry):
    r0 = _chunk_start(i, tc, m)
    h_CxD, t_C = _rows(h_SxMxD, r0, tc), _rows(t_SxM, r0, tc)
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
    return tuple(_put_rows(a, b, r0) for a, b in zip(carry, out))

  init = tuple(jnp.zeros(t_SxM.shape, _F32) for _ in range(4))
  return lax.fori_loop(0, num_t, token_step, init)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _chunked_stats(h_SxMxD, head_DxV, t_SxM, temperature, tc, vc):
  logp_SxM, entropy_SxM, _, _ = _forward(h_SxMxD, head_DxV, t_SxM, temperature, tc, vc)
  return logp_SxM, entropy_SxM


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Wanted:
  """Which gradients the backward pass forms (static: a frozen head under LoRA needs none)."""

  hidden: bool
  head: bool


def _chunked_stats_fwd(h_SxMxD, head_DxV, t_SxM, temperature, tc, vc):
  """Symbolic-zeros forward rule: the primals come with whether each is differentiated."""
  wanted = _Wanted(hidden=h_SxMxD.perturbed, head=head_DxV.perturbed)
  h_SxMxD, head_DxV, t_SxM = h_SxMxD.value, head_DxV.value, t_SxM.value
  logp_SxM, entropy_SxM, lse_SxM, mean_SxM = _forward(h_SxMxD, head_DxV, t_SxM, temperature, tc, vc)
  return (logp_SxM, entropy_SxM), (h_SxMxD, head_DxV, t_SxM, lse_SxM, mean_SxM, wanted)


def _cotangent(g):
  """An output's cotangent as float32, or None where it is a symbolic zero."""
  return None if isinstance(g, jax.custom_derivatives.SymbolicZero) else g.astype(_F32)


def _chunked_stats_bwd(temperature, tc, vc, res, cotangents):
  """One pass over the (token chunk, vocabulary chunk) pairs: each chunk's logits are
  recomputed once, exponentiated once (`_dlogits`), and feed both gradients, d hidden (dz W^T)
  and, when the head is differentiated, d head (h^T dz).

  With the head gradient the vocabulary chunks run outside (each chunk's d head accumulates
  over the token chunks in a [S, D, vc] float32 block, one partial sum per row block, summed
  over the blocks once per vocabulary chunk; d hidden in one [S, M, D] float32 array);
  without it (LoRA) the token chunks run outside, each accumulating its [S x tc, D] d hidden
  block over the vocabulary. Every read and write of d hidden stays within each block's rows.
  A chunk pulled back to end at the array's end masks the rows or columns its predecessor
  covered, so nothing is counted twice.
  """
  h_SxMxD, head_DxV, t_SxM, lse_SxM, mean_SxM, wanted = res
  glogp_SxM, gent_SxM = (_cotangent(g) for g in cotangents)
  if (glogp_SxM is None and gent_SxM is None) or not (wanted.hidden or wanted.head):
    return None, None, None
  (s, m, d), v = h_SxMxD.shape, head_DxV.shape[1]
  num_t, num_v = -(-m // tc), -(-v // vc)
  rows = lambda a, r0: None if a is None else _rows(a, r0, tc)

  def chunk(i, j):
    """(h chunk, head chunk, dz of the fresh rows and columns, dz of the fresh rows)."""
    r0, c0 = _chunk_start(i, tc, m), _chunk_start(j, vc, v)
    h_CxD = rows(h_SxMxD, r0)
    z_CxV, w_DxC = _logits(h_CxD, head_DxV, c0, vc, temperature)
    dz_CxV = _dlogits(z_CxV, c0 + jnp.arange(vc), rows(t_SxM, r0), rows(lse_SxM, r0),
                      rows(mean_SxM, r0), rows(glogp_SxM, r0), rows(gent_SxM, r0), temperature)
    fresh_C = jnp.tile(r0 + jnp.arange(tc) >= i * tc, s)
    dz_rows = jnp.where(fresh_C[:, None], dz_CxV, 0.0)
    dz_fresh = jnp.where((c0 + jnp.arange(vc) >= j * vc)[None, :], dz_rows, 0.0)
    return r0, c0, h_CxD, w_DxC, dz_fresh, dz_rows

  dh_to_rows = lambda dz_CxV, w_DxC: jnp.einsum("cv,dv->cd", dz_CxV, w_DxC,
                                                preferred_element_type=_F32)
  if not wanted.head:  # d hidden only: token chunks outside
    def hidden_chunk(i, dh_SxMxD):
      def add(j, acc_CxD):
        _, _, _, w_DxC, dz_fresh, _ = chunk(i, j)
        return acc_CxD + dh_to_rows(dz_fresh, w_DxC)

      acc_CxD = lax.fori_loop(0, num_v, add, jnp.zeros((s * tc, d), _F32))
      # Rows shared with the previous chunk get their (masked) zero share added.
      r0 = _chunk_start(i, tc, m)
      return _put_rows(dh_SxMxD, rows(dh_SxMxD, r0) + acc_CxD, r0)

    dh_SxMxD = lax.fori_loop(0, num_t, hidden_chunk, jnp.zeros((s, m, d), _F32))
    return dh_SxMxD.astype(h_SxMxD.dtype), None, None

  def head_chunk(j, carry):
    dh_SxMxD, dw_DxV = carry

    def add(i, inner):
      dh_SxMxD, acc_SxDxC = inner
      r0, _, h_CxD, w_DxC, dz_fresh, dz_rows = chunk(i, j)
      if wanted.hidden:
        dh_SxMxD = _put_rows(dh_SxMxD, rows(dh_SxMxD, r0) + dh_to_rows(dz_fresh, w_DxC), r0)
      acc_SxDxC = acc_SxDxC + jnp.einsum("scd,scv->sdv", h_CxD.reshape(s, tc, d),
                                         dz_rows.reshape(s, tc, vc), preferred_element_type=_F32)
      return dh_SxMxD, acc_SxDxC

    dh_SxMxD, acc_SxDxC = lax.fori_loop(0, num_t, add,
                                        (dh_SxMxD, jnp.zeros((s, d, vc), _F32)))
    # Columns shared with the previous chunk are rewritten with the same values.
    c0 = _chunk_start(j, vc, v)
    acc_DxC = jnp.sum(acc_SxDxC, axis=0)
    return dh_SxMxD, lax.dynamic_update_slice_in_dim(dw_DxV, acc_DxC.astype(dw_DxV.dtype), c0, 1)

  dh_SxMxD = jnp.zeros((s, m, d) if wanted.hidden else (s, 0, d), _F32)
  dh_SxMxD, dw_DxV = lax.fori_loop(0, num_v, head_chunk, (dh_SxMxD, jnp.zeros_like(head_DxV)))
  return (dh_SxMxD.astype(h_SxMxD.dtype) if wanted.hidden else None), dw_DxV, None


_chunked_stats.defvjp(_chunked_stats_fwd, _chunked_stats_bwd, symbolic_zeros=True)
