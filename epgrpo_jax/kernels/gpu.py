"""The GPU backend's decode attention: a Pallas kernel (Triton on NVIDIA GPUs) that reads only
each row's span of cache slots, behind `Kernels.decode_attention`.

XLA's one-token attention (`models.attend`) reads all S slots of every row at every step,
whatever the row's length. Here each row's span is cut from the slots its `allowed_BxS` marks
(first to last, below `limit`), so a row that has written 300 of its 2,304 slots reads 300
(block-rounded), and a finished slot of the continuous engine (its index stands still) no
more than it held.
Within the span the mask applies slot by slot: what an invalid slot holds (an earlier
request's keys, NaN) reaches neither the scores nor the output.

The cache stays in the model's layout, keys [B, K, Hd, S] and values [B, K, S, Hd] (heads
major), so no step transposes or copies it. `jax.experimental.pallas.ops.gpu.decode_attention`
was not used: it takes keys [B, S, K, Hd] (a transposed copy of the whole cache at every
step and layer would cost more than the slots it saves) and a [start, length) window per row
with an additive mask, which lets NaN in an invalid slot of a read block through.

One program per (row, KV head, split): its G query heads (padded to `Gp` >= 16 rows, for
Triton's dot) against blocks of `block` slots of its split of the span, an online softmax;
the splits' partial results (unnormalised output, row max, row sum) merge by log-sum-exp
(`models.merge_partials`). Shape suffixes as in `models._decoder`; Gp padded query heads, J splits,
Bk slots per block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from epgrpo_jax.models import attend, attend_shared, merge_partials

NEG = -1e30  # finite: a block with no readable slot leaves exp(NEG - NEG) to be masked, not NaN
MIN_SLOTS = 16  # Triton's dot needs 16 or more along each axis


def row_spans(allowed_BxS: jax.Array, limit) -> tuple[jax.Array, jax.Array]:
  """(lo_B, hi_B) int32: each row's first allowed slot and one past its last below `limit`
  (a scalar or [B]); lo = hi = 0 for a row with none."""
  s = allowed_BxS.shape[1]
  allowed = allowed_BxS.astype(bool) & (jnp.arange(s)[None, :] < jnp.asarray(limit)[..., None])
  some_B = allowed.any(axis=1)
  lo_B = jnp.argmax(allowed, axis=1).astype(jnp.int32)
  hi_B = (s - jnp.argmax(allowed[:, ::-1], axis=1)).astype(jnp.int32)
  return jnp.where(some_B, lo_B, 0), jnp.where(some_B, hi_B, 0)


def block_slots(slots: int, block: int) -> int:
  """Slots per block: `block`, or the largest power of two that fits the cache (>= MIN_SLOTS)."""
  return min(block, 1 << (slots.bit_length() - 1))


def split_count(rows: int, kv_heads: int, slots: int, bk: int, programs: int) -> int:
  """Splits of each row's slots: enough for about `programs` programs, at most one per block."""
  return int(max(1, min(-(-programs // (rows * kv_heads)), -(-slots // bk))))


def _kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, allowed_ref, o_ref, m_ref, l_ref, *, bk: int,
            chunk: int, slots: int, scale: float, precision):
  """One (row, KV head, split): the online softmax over the split's blocks of the row's span.
  A block past the cache's end is moved back to end there; the slots it then shares with the
  block before are masked (`slot >= i * bk`), so every slot counts once and no read leaves the
  cache (Triton needs no bounds mask, interpret mode no clamped slice)."""
  j = pl.program_id(2)
  start = jnp.maximum(lo_ref[...], j * chunk)
  stop = jnp.minimum(hi_ref[...], (j + 1) * chunk)
  q_GpxHd = q_ref[...]
  gp, hd = q_GpxHd.shape

  def body(i, carry):
    m_Gp, l_Gp, acc_GpxHd = carry
    base = jnp.minimum(i * bk, slots - bk)
    slot_Bk = base + jnp.arange(bk)
    keep_Bk = ((slot_Bk >= i * bk) & (slot_Bk >= start) & (slot_Bk < stop)
               & (allowed_ref[pl.ds(base, bk)] != 0))
    k_HdxBk = k_ref[:, pl.ds(base, bk)]
    v_BkxHd = jnp.where(keep_Bk[:, None], v_ref[pl.ds(base, bk), :].astype(q_GpxHd.dtype),
                        jnp.zeros((), q_GpxHd.dtype))
    s_GpxBk = jnp.dot(q_GpxHd, k_HdxBk.astype(q_GpxHd.dtype), precision=precision,
                      preferred_element_type=jnp.float32) * scale
    s_GpxBk = jnp.where(keep_Bk[None, :], s_GpxBk, NEG)
    m_new = jnp.maximum(m_Gp, s_GpxBk.max(axis=1))
    correction = jnp.exp(m_Gp - m_new)
    p_GpxBk = jnp.where(keep_Bk[None, :], jnp.exp(s_GpxBk - m_new[:, None]), 0.0)
    pv_GpxHd = jnp.dot(p_GpxBk.astype(v_BkxHd.dtype), v_BkxHd, precision=precision,
                       preferred_element_type=jnp.float32)
    return m_new, l_Gp * correction + p_GpxBk.sum(axis=1), acc_GpxHd * correction[:, None] + pv_GpxHd

  init = (jnp.full((gp,), NEG, jnp.float32), jnp.zeros((gp,), jnp.float32),
          jnp.zeros((gp, hd), jnp.float32))
  first = start // bk
  last = jnp.maximum(first, (stop + bk - 1) // bk)
  m_Gp, l_Gp, acc_GpxHd = jax.lax.fori_loop(first, last, body, init)
  o_ref[...] = acc_GpxHd
  m_ref[...] = m_Gp
  l_ref[...] = l_Gp


def partials(q_BxKxGxHd, keys_BxKxHdxS, values_BxKxSxHd, allowed_BxS, lo_B, hi_B, *,
             block: int = 128, programs: int = 256, interpret: bool = False):
  """The kernel's per-split results (o [J, B, K, G, Hd], m and l [J, B, K, G], float32) over
  each row's slots [lo_B, hi_B) that `allowed_BxS` marks; `models.merge_partials` combines them."""
  b, k, g, hd = q_BxKxGxHd.shape
  s = keys_BxKxHdxS.shape[-1]
  bk = block_slots(s, block)
  splits = split_count(b, k, s, bk, programs)
  chunk = -(-(-(-s // splits)) // bk) * bk
  gp = max(MIN_SLOTS, 1 << (g - 1).bit_length())
  q = jnp.pad(q_BxKxGxHd, ((0, 0), (0, 0), (0, gp - g), (0, 0)))
  f32 = q.dtype == jnp.float32
  kernel = functools.partial(_kernel, bk=bk, chunk=chunk, slots=s, scale=float(1 / np.sqrt(hd)),
                             precision=jax.lax.Precision.HIGHEST if f32 else None)
  row = lambda i, h, j: (i,)
  o, m, l = pl.pallas_call(
      kernel, grid=(b, k, splits),
      in_specs=[pl.BlockSpec((None,), row), pl.BlockSpec((None,), row),
                pl.BlockSpec((None, None, gp, hd), lambda i, h, j: (i, h, 0, 0)),
                pl.BlockSpec((None, None, hd, s), lambda i, h, j: (i, h, 0, 0)),
                pl.BlockSpec((None, None, s, hd), lambda i, h, j: (i, h, 0, 0)),
                pl.BlockSpec((None, s), lambda i, h, j: (i, 0))],
      out_specs=[pl.BlockSpec((None, None, None, gp, hd), lambda i, h, j: (j, i, h, 0, 0)),
                 pl.BlockSpec((None, None, None, gp), lambda i, h, j: (j, i, h, 0)),
                 pl.BlockSpec((None, None, None, gp), lambda i, h, j: (j, i, h, 0))],
      out_shape=[jax.ShapeDtypeStruct((splits, b, k, gp, hd), jnp.float32),
                 jax.ShapeDtypeStruct((splits, b, k, gp), jnp.float32),
                 jax.ShapeDtypeStruct((splits, b, k, gp), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
      interpret=interpret, name="epgrpo_decode_attention",
  )(lo_B, hi_B, q, keys_BxKxHdxS, values_BxKxSxHd, allowed_BxS.astype(jnp.int8))
  return o[..., :g, :], m[..., :g], l[..., :g]


def decode_attention(q_BxKxGxHd, keys_BxKxHdxS, values_BxKxSxHd, allowed_BxS, limit, *,
                     block: int = 128, programs: int = 256, interpret: bool = False):
  """`Kernels.decode_attention` on a GPU: softmax(q . keys / sqrt(Hd)) . values over the slots
  < `limit` that `allowed_BxS` marks, each row reading its own span only (`row_spans`).
  q and the cache in float32 or bfloat16 (the cache is read in its dtype and, as in XLA's
  path, taken to q's; the products accumulate in float32, float32 products in IEEE
  precision, not TF32); output in q's dtype, 0 for a row
  with no slot. A cache under `MIN_SLOTS` slots takes XLA's attention. `programs`: about how
  many programs the grid should hold (rows x KV heads x splits of the slots); `interpret`:
  Pallas' interpreter (any backend; the tests' way to run it on a CPU)."""
  s = keys_BxKxHdxS.shape[-1]
  if s < MIN_SLOTS:
    allowed = allowed_BxS.astype(bool) & (jnp.arange(s) < limit)
    return attend(q_BxKxGxHd[:, :, :, None], keys_BxKxHdxS, values_BxKxSxHd,
                  allowed[:, None, :])[:, :, :, 0]
  lo_B, hi_B = row_spans(allowed_BxS, limit)
  parts = partials(q_BxKxGxHd, keys_BxKxHdxS, values_BxKxSxHd, allowed_BxS, lo_B, hi_B,
                   block=block, programs=programs, interpret=interpret)
  return merge_partials(*parts).astype(q_BxKxGxHd.dtype)


def prompt_partials(q_BxKxGxHd, prompt_keys_PxKxHdxTp, prompt_values_PxKxTpxHd, prompt_valid_PxTp):
  """A group's prompt part as one more split for `models.merge_partials` (o [1, B, K, G, Hd] unnormalised, m
  and l [1, B, K, G], float32): the queries of a prompt's rows against its keys and values,
  read once for the group (one XLA product per prompt and KV head; float32 in IEEE precision,
  as the kernel's). A row with no valid prompt slot gives l = 0."""
  b, k, g, hd = q_BxKxGxHd.shape
  p = prompt_valid_PxTp.shape[0]
  dtype = q_BxKxGxHd.dtype
  precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
  q_PxRxKxGxHd = q_BxKxGxHd.reshape(p, b // p, k, g, hd)
  scores = jnp.einsum("prkgh,pkhs->prkgs", q_PxRxKxGxHd, prompt_keys_PxKxHdxTp.astype(dtype),
                      preferred_element_type=jnp.float32, precision=precision) / np.sqrt(hd)
  valid = prompt_valid_PxTp[:, None, None, None, :]
  scores = jnp.where(valid, scores, NEG)
  m_PxRxKxG = scores.max(-1)
  e = jnp.where(valid, jnp.exp(scores - m_PxRxKxG[..., None]), 0.0)
  o = jnp.einsum("prkgs,pksh->prkgh", e.astype(dtype), prompt_values_PxKxTpxHd.astype(dtype),
                 preferred_element_type=jnp.float32, precision=precision)
  return o.reshape(1, b, k, g, hd), m_PxRxKxG.reshape(1, b, k, g), e.sum(-1).reshape(1, b, k, g)


def shared_decode_attention(q_BxKxGxHd, keys_BxKxHdxS, values_BxKxSxHd, allowed_BxS, limit,
                            prompt_keys_PxKxHdxTp, prompt_values_PxKxTpxHd, prompt_valid_PxTp, *,
                            block: int = 128, programs: int = 256, interpret: bool = False):
  """`Kernels.shared_decode_attention` on a GPU, over a cache whose prompt part is kept once per
  group (`models.split_cache`): the prompt part by `prompt_partials` (read once per group),
  each row's own slots by the kernel over its span (`decode_attention`'s), the two merged by
  log-sum-exp (`models.merge_partials`). A cache under `MIN_SLOTS` own slots takes `models.attend_shared`."""
  s = keys_BxKxHdxS.shape[-1]
  prompt = (prompt_keys_PxKxHdxTp, prompt_values_PxKxTpxHd, prompt_valid_PxTp)
  if s < MIN_SLOTS:
    allowed = allowed_BxS.astype(bool) & (jnp.arange(s) < limit)
    return attend_shared(q_BxKxGxHd[:, :, :, None], keys_BxKxHdxS, values_BxKxSxHd,
                         allowed[:, None, :], *prompt)[:, :, :, 0]
  lo_B, hi_B = row_spans(allowed_BxS, limit)
  own = partials(q_BxKxGxHd, keys_BxKxHdxS, values_BxKxSxHd, allowed_BxS, lo_B, hi_B, block=block,
                 programs=programs, interpret=interpret)
  parts = [jnp.concatenate(pair) for pair in zip(prompt_partials(q_BxKxGxHd, *prompt), own)]
  return merge_partials(*parts).astype(q_BxKxGxHd.dtype)
