"""Attention over keys that are valid per slot and causal per query: plain, blockwise, cuDNN.

Shape suffixes as in `_decoder`: B batch, K key/value heads, G query heads per KV head,
T queries, S key slots, Hd head dim, Bk keys per block, nb blocks.

Every path computes softmax(q . keys / sqrt(Hd)) . values where query t (at slot
`offset + t`) sees slot s iff `s <= offset + t` and `valid_BxS[b, s]`, and, given
`segments_BxS` (packed rows: several sequences side by side), only slots of its own
segment: `segments_BxS[b, s] == segments_BxS[b, offset + t]`:

- "plain" materialises the [B, K, G, T, S] scores (`attend`); fastest at small T,
  and the one-token decode step always takes it.
- "blockwise" runs blocks of queries one after the other and, within each, loops over
  key blocks with an online softmax (flash-style, pure XLA); a custom VJP per query
  block saves only its output and two row statistics and recomputes each block's
  probabilities in the backward pass, so that no [T, S] scores are kept: one
  [B, K, G, Bq, Bk] block at a time is the aim, which `loop="scan"` guarantees within
  a query block and the model's fenced unrolled loop (`_loop`) leaves to XLA's
  scheduler. Key blocks wholly after a query block's last query are skipped when the
  query offset is a Python int.
- "cudnn" is cuDNN's fused flash attention (GPU, bf16/fp16 only); without a cache it gets
  each row's runs of one segment as lengths and offsets (`segment_runs`), no mask array.

Which one runs is the program's choice (`epgrpo_jax.kernels.seam`): "auto" there picks per
backend and dtype, and on a CPU may hand the passes without a cache to a C++ kernel
(`Kernels.causal_attention`), which gives a query with no visible slot zero.

A query with no visible slot (left padding) gets a finite output, not NaN: uniform
weights over all S slots in "plain", over the slots its query block scans in
"blockwise". The model never reads such a query's output (its slot is not a valid key,
and losses mask it), so only queries that see a slot are held to equal values.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

_NEG = -1e30  # finite, so that a row with no valid key gets a uniform, not NaN, softmax


def configured(name: str) -> str:
  """The implementation the model runs for the config value `name` when its program chose
  none (`Kernels.attention` None): "auto" is "plain", the others as named."""
  return "plain" if name == "auto" else name


def query_segments(segments_BxS, offset, t: int):
  """[B, T]: the segment of each query (the segment id at its slot `offset + t`)."""
  return jax.lax.dynamic_slice_in_dim(segments_BxS, offset, t, axis=1)


def visible(valid_BxS, offset, t: int, segments_BxS=None):
  """[B, T, S] bool: query t (at slot offset + t) sees the valid slots up to its own (of its
  own segment, given `segments_BxS`)."""
  slot_S = jnp.arange(valid_BxS.shape[1])
  query_slot_T = offset + jnp.arange(t)
  allowed = (slot_S[None, None, :] <= query_slot_T[None, :, None]) & valid_BxS[:, None, :]
  if segments_BxS is None:
    return allowed
  same_BxTxS = query_segments(segments_BxS, offset, t)[:, :, None] == segments_BxS[:, None, :]
  return allowed & same_BxTxS


def attend(q_BxKxGxTxHd, keys_BxKxHdxS, values_BxKxSxHd, allowed_BxTxS):
  """softmax(q . keys / sqrt(Hd)) . values over the allowed slots; G query heads share a KV head.

  A query with no allowed slot gets uniform weights (the mask is finite), not NaN.
  """
  q = q_BxKxGxTxHd
  scores = jnp.einsum("bkgth,bkhs->bkgts", q, keys_BxKxHdxS.astype(q.dtype),
                      preferred_element_type=jnp.float32) / jnp.sqrt(q.shape[-1]).astype(jnp.float32)
  scores = jnp.where(allowed_BxTxS[:, None, None], scores, _NEG)
  probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
  return jnp.einsum("bkgts,bksh->bkgth", probs, values_BxKxSxHd.astype(q.dtype),
                    preferred_element_type=jnp.float32).astype(q.dtype)


def _blocks(keys_BxKxHdxS, values_BxKxSxHd, valid_BxS, segments_BxS, block: int):
  """Keys, values, validity, segments and slot numbers split into nb blocks of Bk slots
  (zero-padded)."""
  b, k, hd, s = keys_BxKxHdxS.shape
  nb = -(-s // block)
  pad = nb * block - s
  keys = jnp.pad(keys_BxKxHdxS, ((0, 0), (0, 0), (0, 0), (0, pad)))
  values = jnp.pad(values_BxKxSxHd, ((0, 0), (0, 0), (0, pad), (0, 0)))
  valid = jnp.pad(valid_BxS, ((0, 0), (0, pad)))
  segments = jnp.pad(segments_BxS, ((0, 0), (0, pad)))
  keys_nbxBxKxHdxBk = keys.reshape(b, k, hd, nb, block).transpose(3, 0, 1, 2, 4)
  values_nbxBxKxBkxHd = values.reshape(b, k, nb, block, hd).transpose(2, 0, 1, 3, 4)
  valid_nbxBxBk = valid.reshape(b, nb, block).transpose(1, 0, 2)
  segments_nbxBxBk = segments.reshape(b, nb, block).transpose(1, 0, 2)
  slot_nbxBk = jnp.arange(nb * block).reshape(nb, block)
  return keys_nbxBxKxHdxBk, values_nbxBxKxBkxHd, valid_nbxBxBk, segments_nbxBxBk, slot_nbxBk


def _loop(body, carry, xs, how: str):
  """`lax.scan(body, carry, xs)` (how="scan"), or unrolled with each step fenced after the
  previous one by an optimization barrier (how="unrolled").

  In isolation the scan holds one block at a time (tests/test_attention.py). In the
  remat'd update program of a deep model, XLA:CPU kept buffers of every layer's loops
  apart: the temporaries grew by about 3.5 GiB per 3B layer (docs/distributed.md), while
  the unrolled form grew as plain attention does; hence "unrolled" in the model.
  """
  if how == "scan":
    return jax.lax.scan(body, carry, xs)
  outs = []
  for j in range(jax.tree.leaves(xs)[0].shape[0]):
    carry, x = jax.lax.optimization_barrier((carry, jax.tree.map(lambda a: a[j], xs)))
    carry, out = body(carry, x)
    outs.append(out)
  if outs[0] is None:
    return carry, None
  return carry, jax.tree.map(lambda *a: jnp.stack(a), *outs)


def _block_scores(q_BxKxGxTxHd, k_BxKxHdxBk, valid_BxBk, seg_BxBk, slot_Bk, query_seg_BxT, offset,
                  slots: int):
  """Masked float32 scores of one key block and where they are allowed: -1e30 where not
  visible (as `attend`), -inf on the zero padding past the last slot (no weight at all)."""
  q = q_BxKxGxTxHd
  scores = jnp.einsum("bkgth,bkhs->bkgts", q, k_BxKxHdxBk.astype(q.dtype),
                      preferred_element_type=jnp.float32) / jnp.sqrt(q.shape[-1]).astype(jnp.float32)
  query_slot_T = offset + jnp.arange(q.shape[3])
  allowed_BxTxBk = ((slot_Bk[None, None, :] <= query_slot_T[None, :, None]) & valid_BxBk[:, None, :]
                    & (seg_BxBk[:, None, :] == query_seg_BxT[:, :, None]))
  allowed = allowed_BxTxBk[:, None, None]
  scores = jnp.where(allowed, scores, _NEG)
  return jnp.where(slot_Bk < slots, scores, -jnp.inf), allowed


def _blockwise_forward(q, keys, values, valid, segments, offset, block, how):
  """(output, (row max, row sum of exp(scores - max)), each [B, K, G, T] float32) by an online
  softmax over key blocks. Max and sum stay apart: for a row with no visible key the max is
  -1e30, to which log(sum) would add nothing in float32."""
  slots = keys.shape[-1]
  blocks = _blocks(keys, values, valid, segments, block)
  b, k, g, t, hd = q.shape
  query_seg_BxT = query_segments(segments, offset, t)

  def body(carry, xs):
    m_BxKxGxT, l_BxKxGxT, acc_BxKxGxTxHd = carry
    k_blk, v_blk, valid_blk, seg_blk, slot_blk = xs
    s, _ = _block_scores(q, k_blk, valid_blk, seg_blk, slot_blk, query_seg_BxT, offset, slots)
    m_new = jnp.maximum(m_BxKxGxT, s.max(-1))
    correction = jnp.exp(m_BxKxGxT - m_new)
    p = jnp.exp(s - m_new[..., None])
    l_new = l_BxKxGxT * correction + p.sum(-1)
    pv = jnp.einsum("bkgts,bksh->bkgth", p.astype(v_blk.dtype), v_blk,
                    preferred_element_type=jnp.float32)
    return (m_new, l_new, acc_BxKxGxTxHd * correction[..., None] + pv), None

  init = (jnp.full((b, k, g, t), _NEG, jnp.float32), jnp.zeros((b, k, g, t), jnp.float32),
          jnp.zeros((b, k, g, t, hd), jnp.float32))
  (m, l, acc), _ = _loop(body, init, blocks, how)
  return (acc / l[..., None]).astype(q.dtype), (m, l)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _blockwise(q, keys, values, valid, segments, offset, block, how):
  return _blockwise_forward(q, keys, values, valid, segments, offset, block, how)[0]


def _blockwise_fwd(q, keys, values, valid, segments, offset, block, how):
  out, stats = _blockwise_forward(q, keys, values, valid, segments, offset, block, how)
  return out, (q, keys, values, valid, segments, offset, out, stats)


def _blockwise_bwd(block, how, residuals, dout_BxKxGxTxHd):
  """Recomputes each block's probabilities from the saved row statistics (flash-style backward)."""
  q, keys, values, valid, segments, offset, out, (m_BxKxGxT, l_BxKxGxT) = residuals
  slots = keys.shape[-1]
  query_seg_BxT = query_segments(segments, offset, q.shape[3])
  scale = 1.0 / jnp.sqrt(q.shape[-1]).astype(jnp.float32)
  dout = dout_BxKxGxTxHd.astype(q.dtype)
  delta_BxKxGxT = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), -1)
  f32 = functools.partial(jnp.einsum, preferred_element_type=jnp.float32)

  def body(dq_BxKxGxTxHd, xs):
    k_blk, v_blk, valid_blk, seg_blk, slot_blk = xs
    s, allowed = _block_scores(q, k_blk, valid_blk, seg_blk, slot_blk, query_seg_BxT, offset,
                               slots)
    p = jnp.exp(s - m_BxKxGxT[..., None]) / l_BxKxGxT[..., None]
    dv_BxKxBkxHd = f32("bkgts,bkgth->bksh", p.astype(q.dtype), dout)
    dp = f32("bkgth,bksh->bkgts", dout, v_blk.astype(q.dtype))
    ds = jnp.where(allowed, p * (dp - delta_BxKxGxT[..., None]), 0.0) * scale
    ds = ds.astype(q.dtype)
    dq = dq_BxKxGxTxHd + f32("bkgts,bkhs->bkgth", ds, k_blk.astype(q.dtype))
    dk_BxKxHdxBk = f32("bkgts,bkgth->bkhs", ds, q)
    return dq, (dk_BxKxHdxBk, dv_BxKxBkxHd)

  dq, (dk_nb, dv_nb) = _loop(body, jnp.zeros(q.shape, jnp.float32),
                             _blocks(keys, values, valid, segments, block), how)
  b, k, hd, s = keys.shape
  nb = dk_nb.shape[0]
  dkeys = dk_nb.transpose(1, 2, 3, 0, 4).reshape(b, k, hd, nb * block)[..., :s]
  dvalues = dv_nb.transpose(1, 2, 0, 3, 4).reshape(b, k, nb * block, hd)[:, :, :s]
  return (dq.astype(q.dtype), dkeys.astype(keys.dtype), dvalues.astype(values.dtype), None, None,
          None)


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)


def blockwise(q_BxKxGxTxHd, keys_BxKxHdxS, values_BxKxSxHd, valid_BxS, offset=0, *,
              block: int = 512, loop: str = "unrolled", segments_BxS=None):
  """`attend(q, keys, values, visible(valid_BxS, offset, T, segments_BxS))` over blocks of
  `block` queries x `block` keys, never materialising [T, S] scores in the forward or the
  backward pass; `loop` "unrolled" or "scan" (`_loop`, the key blocks).

  Query blocks run one after the other (each fenced after the previous one's output), each
  with its own custom VJP, so one block's [B, K, G, Bq, Bk] scores live at a time. With a
  Python-int `offset` (training and scoring), a query block only sees the key slots up to its
  last query, and the slots after it are left out of its loop (causal block skipping).
  """
  if loop not in ("unrolled", "scan"):
    raise ValueError(f"blockwise: loop must be 'unrolled' or 'scan', got {loop!r}")
  if block <= 0:
    raise ValueError(f"model.attention_block: must be > 0, got {block}")
  if segments_BxS is None:  # one segment: every comparison holds
    segments_BxS = jnp.zeros(valid_BxS.shape, jnp.int32)
  valid_BxS, segments_BxS = valid_BxS.astype(bool), segments_BxS.astype(jnp.int32)
  t, s = q_BxKxGxTxHd.shape[3], keys_BxKxHdxS.shape[-1]
  static = isinstance(offset, (int, np.integer))
  outs = []
  for start in range(0, t, block):
    stop = min(t, start + block)
    q_chunk = q_BxKxGxTxHd[:, :, :, start:stop]
    if outs:  # fence: this block starts after the previous block's output exists
      q_chunk, _ = jax.lax.optimization_barrier((q_chunk, outs[-1]))
    seen = min(s, int(offset) + stop) if static else s  # slots past `seen` are in the future
    outs.append(_blockwise(q_chunk, keys_BxKxHdxS[..., :seen], values_BxKxSxHd[:, :, :seen],
                           valid_BxS[:, :seen], segments_BxS[:, :seen],
                           jnp.asarray(offset + start, jnp.int32), min(block, seen), loop))
  return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=3)


def segment_runs(valid_BxS, segments_BxS, max_runs: int):
  """Each row's runs of consecutive valid slots of one segment, as cuDNN's packed layout takes
  them: (lengths_BxM int32 [B, max_runs], starts_BxM1 int32 [B, max_runs + 1], both -1 past the
  row's last run; overflow_B bool: the row has more than `max_runs` runs, the ones past it
  dropped, or a segment's valid slots are not contiguous: runs cannot express such a row).
  A padded row (left-padded prompt, completion, right padding) is one run; a packed row one
  run per sequence. O(B x S): no [S, S] array."""
  b, s = valid_BxS.shape
  valid = valid_BxS.astype(bool)
  seg = jnp.zeros((b, s), jnp.int32) if segments_BxS is None else segments_BxS.astype(jnp.int32)
  prev_valid = jnp.pad(valid[:, :-1], ((0, 0), (1, 0)))
  prev_seg = jnp.pad(seg[:, :-1], ((0, 0), (1, 0)))
  start_BxS = valid & (~prev_valid | (seg != prev_seg))
  run_BxS = jnp.cumsum(start_BxS, axis=1, dtype=jnp.int32) - 1
  count_B = run_BxS[:, -1] + 1
  # The segment of the last valid slot before each slot: the same at a run's start means a hole.
  last_BxS = jax.lax.cummax(jnp.where(valid, jnp.arange(s), -1), axis=1)
  before_BxS = jnp.pad(last_BxS[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
  split_B = jnp.any(start_BxS & (before_BxS >= 0)
                    & (jnp.take_along_axis(seg, jnp.maximum(before_BxS, 0), axis=1) == seg), axis=1)
  rows_Bx1 = jnp.arange(b)[:, None]
  lengths = jnp.zeros((b, max_runs), jnp.int32).at[
      rows_Bx1, jnp.where(valid, run_BxS, max_runs)].add(1, mode="drop")
  lengths = jnp.where(jnp.arange(max_runs)[None, :] < count_B[:, None], lengths, -1)
  starts = jnp.full((b, max_runs + 1), -1, jnp.int32).at[
      rows_Bx1, jnp.where(start_BxS & (run_BxS < max_runs), run_BxS, max_runs + 1)].set(
          jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s)), mode="drop")
  return lengths, starts, (count_B > max_runs) | split_B


def runs_visible(lengths_BxM, starts_BxM1, slots: int):
  """[B, S, S] bool: the mask cuDNN's packed causal attention applies to `segment_runs`' runs
  (query i sees key j iff both are in one run and j <= i). For tests and the "xla" path."""
  ends_BxM = starts_BxM1[:, :-1] + jnp.maximum(lengths_BxM, 0)
  slot_S = jnp.arange(slots)
  in_BxMxS = ((slot_S[None, None, :] >= starts_BxM1[:, :-1, None])
              & (slot_S[None, None, :] < ends_BxM[:, :, None]) & (lengths_BxM[:, :, None] > 0))
  same_BxSxS = jnp.einsum("bmq,bmk->bqk", in_BxMxS.astype(jnp.int32), in_BxMxS.astype(jnp.int32)) > 0
  return same_BxSxS & (slot_S[None, None, :] <= slot_S[None, :, None])


def _packed_cudnn(q_BxTxNxHd, keys_BxSxKxHd, values_BxSxKxHd, lengths_BxM, starts_BxM1):
  """cuDNN flash attention over packed runs, causal within each (mask PADDING_CAUSAL with
  per-run lengths and offsets): no mask or bias array at all. `jax.nn.dot_product_attention`
  takes per-row lengths only, so this calls the function behind it, which takes the runs'
  offsets too (a packed layout: Hopper GPUs or newer)."""
  from jax._src.cudnn import fused_attention_stablehlo as fa

  hd = q_BxTxNxHd.shape[-1]
  return fa.dot_product_attention(
      q_BxTxNxHd, keys_BxSxKxHd, values_BxSxKxHd, q_seqlen=lengths_BxM, kv_seqlen=lengths_BxM,
      q_offsets=starts_BxM1, kv_offsets=starts_BxM1, scale=float(1.0 / np.sqrt(hd)),
      mask_type=fa.MaskType.PADDING_CAUSAL, qkv_layout="BTNH")


def cudnn(q_BxKxGxTxHd, keys_BxKxHdxS, values_BxKxSxHd, valid_BxS, offset=0, *,
          implementation: str | None = "cudnn", segments_BxS=None, max_segments: int = 16):
  """The same attention through cuDNN's fused flash attention (GPU, bf16/fp16 only);
  `implementation="xla"` runs the same arguments through jax.nn's reference path anywhere
  (tests).

  Without a cache (training, scoring: offset 0, T = S) the mask is not an array: each row's
  runs of valid slots of one segment (`segment_runs`; a padded row is one run, a packed row
  one per sequence, at most `max_segments`) go to cuDNN as lengths and offsets, and it
  attends causally within each run (a segment's valid slots must be contiguous, as the
  update's rows are). Slots outside every run (padding) are zeroed going in and
  coming out, so that whatever the kernel leaves there reaches neither the output nor, through
  `where`'s gradient, the weights. A row with more runs than `max_segments`, or a segment
  with a hole, gets NaN outputs
  (the loss turns non-finite and the update is skipped, never silently wrong); the trainer
  checks the packed rows beforehand (`model.attention_segments`).

  With a cache (the sampler's prefill: no gradient) the mask goes as a boolean array, which
  cuDNN's inference pass takes at any length."""
  b, k, g, t, hd = q_BxKxGxTxHd.shape
  s = keys_BxKxHdxS.shape[-1]
  q_BxTxNxHd = q_BxKxGxTxHd.transpose(0, 3, 1, 2, 4).reshape(b, t, k * g, hd)
  dtype = q_BxTxNxHd.dtype
  keys_BxSxKxHd = keys_BxKxHdxS.transpose(0, 3, 1, 2).astype(dtype)
  values_BxSxKxHd = values_BxKxSxHd.transpose(0, 2, 1, 3).astype(dtype)
  valid_BxS = valid_BxS.astype(bool)
  if isinstance(offset, (int, np.integer)) and offset == 0 and t == s:
    runs = max(2, max_segments)  # two or more: cuDNN reads offsets only then
    lengths_BxM, starts_BxM1, overflow_B = segment_runs(valid_BxS, segments_BxS, runs)
    live = lambda x: jnp.where(valid_BxS[:, :, None, None], x, jnp.zeros((), x.dtype))
    q_BxTxNxHd, keys_BxSxKxHd, values_BxSxKxHd = map(live, (q_BxTxNxHd, keys_BxSxKxHd,
                                                            values_BxSxKxHd))
    if implementation == "cudnn":
      out_BxTxNxHd = _packed_cudnn(q_BxTxNxHd, keys_BxSxKxHd, values_BxSxKxHd, lengths_BxM,
                                   starts_BxM1)
    else:
      out_BxTxNxHd = jax.nn.dot_product_attention(
          q_BxTxNxHd, keys_BxSxKxHd, values_BxSxKxHd,
          mask=runs_visible(lengths_BxM, starts_BxM1, s)[:, None], implementation=implementation)
    out_BxTxNxHd = jnp.where(overflow_B[:, None, None, None], jnp.nan, live(out_BxTxNxHd))
  else:
    out_BxTxNxHd = jax.nn.dot_product_attention(
        q_BxTxNxHd, keys_BxSxKxHd, values_BxSxKxHd,
        mask=visible(valid_BxS, offset, t, segments_BxS)[:, None], implementation=implementation)
  return out_BxTxNxHd.astype(dtype).reshape(b, t, k, g, hd).transpose(0, 2, 3, 1, 4)
