"""Padding-free batches: the sequences (prompt + completion) of a rollout packed side by side
into fixed-length rows (`train.packing`).

A padded rollout runs every row as [prompt (left-padded) + completion (right-padded)], as
long as the longest; a packed one places each sequence's real tokens in a row of
`row_length` slots after the previous sequence's, numbered by a segment id (1, 2, ... within
the row in batch order; 0: an empty slot) with positions restarting at 0. The model attends within a
segment only (`CausalLM(..., segments_BxT=...)`), so each sequence's hidden states are those of
the padded path. Per-token results come back to the rollout's [B, N] layout through
`index_BxN`, so advantages, the loss and the metrics are unchanged.

Rows are filled first-fit-decreasing (longest sequence first, each into the first row with
room): few rows, and a deterministic layout. Their number rounds up to the next of 1, 2,
3, 4, 6, 8, 12, 16, ... (powers of two and 1.5 times them; then to a multiple of the batch
shards), so that a run compiles its programs for at most two row counts per doubling, and
at most a third of the rows are empty. Host-side numpy.

With gradient accumulation (`train.grad_accumulation` = k), `pack_micro_batches` packs each
micro-batch apart into rows laid out the way `objective.accumulated_gradients` splits a batch.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import struct

from epgrpo_jax.io.errors import UserError


@struct.dataclass
class PackedRows:
  """A rollout's sequences in R rows of L slots, and where its completion tokens went."""

  tokens: jax.Array  # [R, L] int32: prompt + completion tokens (the last one needs no slot)
  positions: jax.Array  # [R, L] int32: 0, 1, ... within each sequence
  segments: jax.Array  # [R, L] int32: one id >= 1 per sequence within a row; 0 empty
  targets: jax.Array  # [R, L] int32: the completion token each slot's hidden predicts (or 0)
  index: jax.Array  # [B, N] int32: the flat slot r * L + l predicting completion token (b, n)


def num_rows(needed: int, multiple: int = 1) -> int:
  """The bucketed row count: the next of 1, 2, 3, 4, 6, 8, 12, ... >= `needed`, rounded up
  to `multiple`."""
  power = 1 << max(needed - 1, 0).bit_length()  # the next power of two
  rows = power * 3 // 4 if power >= 4 and power * 3 // 4 >= needed else power
  return -(-max(rows, multiple) // multiple) * multiple


def sequence_lengths(prompt_mask_BxTp, completion_mask_BxN) -> np.ndarray:
  """[B] slots each sequence takes: its prompt and completion tokens but the last (0 without
  completion tokens: nothing is scored, the sequence is left out)."""
  completion_B = np.asarray(completion_mask_BxN).sum(1)
  return np.where(completion_B > 0, np.asarray(prompt_mask_BxTp).sum(1) + completion_B - 1, 0)


def first_fit_decreasing(lengths_B, row_length: int) -> tuple[np.ndarray, np.ndarray, int]:
  """(row [B], start slot [B], rows used) of each sequence, longest first into the first row
  with room; sequences of length 0 get row -1."""
  row_B = np.full(len(lengths_B), -1, np.int64)
  start_B = np.zeros(len(lengths_B), np.int64)
  used: list[int] = []  # slots taken in each row
  for b in np.argsort(-np.asarray(lengths_B), kind="stable"):
    n = int(lengths_B[b])
    if n == 0:
      break
    if n > row_length:
      raise ValueError(f"packing: a sequence of {n} tokens does not fit a row of {row_length}")
    r = next((i for i, u in enumerate(used) if u + n <= row_length), len(used))
    if r == len(used):
      used.append(0)
    row_B[b], start_B[b] = r, used[r]
    used[r] += n
  return row_B, start_B, len(used)


def pack(prompt_ids_BxTp, prompt_mask_BxTp, completion_BxN, completion_mask_BxN, *,
         row_length: int, multiple: int = 1) -> PackedRows:
  """The packed layout (numpy) of a rollout; `multiple`: the row count's divisor (shards).

  Sequence b is its prompt's real tokens then its completion's real tokens (those where the
  masks hold, in order); completion token n is predicted by the slot before it in the
  sequence. `index_BxN` is 0 where the completion mask is false.
  """
  prompt_ids, prompt_mask = np.asarray(prompt_ids_BxTp), np.asarray(prompt_mask_BxTp, bool)
  completion, completion_mask = np.asarray(completion_BxN), np.asarray(completion_mask_BxN, bool)
  lengths_B = sequence_lengths(prompt_mask, completion_mask)
  if np.any((lengths_B > 0) & (prompt_mask.sum(1) == 0)):
    raise ValueError("packing: a scored completion has no prompt token to follow")
  row_B, start_B, used = first_fit_decreasing(lengths_B, row_length)
  rows = num_rows(used, multiple)
  tokens_RxL, positions_RxL, segments_RxL, targets_RxL = (
      np.zeros((rows, row_length), np.int32) for _ in range(4))
  index_BxN = np.zeros(completion.shape, np.int32)
  segment_of_row = np.zeros(rows, np.int32)
  for b in np.flatnonzero(lengths_B):
    r, s, n = row_B[b], start_B[b], lengths_B[b]
    scored_N = np.flatnonzero(completion_mask[b])
    prompt = prompt_ids[b][prompt_mask[b]]
    tokens_RxL[r, s:s + n] = np.concatenate([prompt, completion[b, scored_N[:-1]]])
    positions_RxL[r, s:s + n] = np.arange(n)
    segment_of_row[r] += 1
    segments_RxL[r, s:s + n] = segment_of_row[r]
    predicting = s + len(prompt) - 1 + np.arange(len(scored_N))
    targets_RxL[r, predicting] = completion[b, scored_N]
    index_BxN[b, scored_N] = r * row_length + predicting
  return PackedRows(tokens_RxL, positions_RxL, segments_RxL, targets_RxL, index_BxN)


def pack_micro_batches(prompt_ids_BxTp, prompt_mask_BxTp, completion_BxN, completion_mask_BxN,
                       *, micro_batches: int, row_length: int, multiple: int = 1) -> PackedRows:
  """`pack` of each of k micro-batches apart (micro-batch i: sequences i, i + k, ...), in the
  layout `objective.accumulated_gradients` splits: k x R_m rows, row j * k + i being row j of
  micro-batch i, and each sequence's `index` a slot of its own micro-batch's [R_m, L] rows.

  R_m, the same for every micro-batch, is the most rows one needs, bucketed (`num_rows`) and
  a multiple of `multiple`. micro_batches = 1 gives `pack`'s layout.
  """
  k = micro_batches
  batch = [np.asarray(x) for x in (prompt_ids_BxTp, prompt_mask_BxTp, completion_BxN,
                                   completion_mask_BxN)]
  if k == 1:
    return pack(*batch, row_length=row_length, multiple=multiple)
  if len(batch[0]) % k:
    raise ValueError(f"packing: {k} micro-batches do not divide {len(batch[0])} sequences")
  packs_K = [pack(*(x[i::k] for x in batch), row_length=row_length) for i in range(k)]
  rows = num_rows(max(p.tokens.shape[0] for p in packs_K), multiple)
  return jax.tree.map(lambda *parts_K: interleave(parts_K),
                      *(with_rows(p, rows) for p in packs_K))


def check_layout(packing: PackedRows, completion_BxN, completion_mask_BxN, micro_batches: int):
  """Raises ValueError unless `packing` has `pack_micro_batches`' layout for `micro_batches`:
  each scored completion token is the target of the slot its `index` names in its own
  micro-batch's rows (`pack`'s layout passes only for micro_batches = 1)."""
  k = micro_batches
  targets_RxL, index_BxN = np.asarray(packing.targets), np.asarray(packing.index)
  completion, mask = np.asarray(completion_BxN), np.asarray(completion_mask_BxN, bool)

  def fits(i):
    slots, scored = targets_RxL[i::k].reshape(-1), mask[i::k]
    index = index_BxN[i::k][scored]
    return np.all(index < slots.size) and np.all(slots[index] == completion[i::k][scored])

  if len(targets_RxL) % k or len(index_BxN) % k or not all(fits(i) for i in range(k)):
    raise ValueError(f"packing: {len(targets_RxL)} rows of {len(index_BxN)} sequences are not "
                     f"the layout of {k} micro-batches; pack the rollout with "
                     f"pack_micro_batches(..., micro_batches={k})")


def with_rows(packing: PackedRows, rows: int) -> PackedRows:
  """`packing` with empty rows appended up to `rows` (its `index` holds as it is)."""
  grow = lambda x_RxL: np.pad(x_RxL, ((0, rows - x_RxL.shape[0]), (0, 0)))
  return packing.replace(tokens=grow(packing.tokens), positions=grow(packing.positions),
                         segments=grow(packing.segments), targets=grow(packing.targets))


def interleave(parts_K) -> np.ndarray:
  """Rows of k equal-shaped arrays, row j of part i at j * k + i: the inverse of
  `accumulated_gradients`' split `x.reshape(-1, k, ...).swapaxes(0, 1)`."""
  stacked = np.stack(parts_K, axis=1)  # [R, k, ...]
  return stacked.reshape(-1, *stacked.shape[2:])


def check_segments(packing: PackedRows, most: int) -> None:
  """Raises a one-line UserError if a row holds more than `most` sequences (cuDNN attention
  takes each row's sequences as `model.attention_segments` lengths and offsets)."""
  held = int(np.asarray(packing.segments).max(initial=0))  # ids run 1, 2, ... within a row
  if held > most:
    raise UserError(f"model.attention_segments: a packed row holds {held} sequences, more than "
                    f"{most}; raise it to {held} or more, or shorten train.packing_length")


def fill(packing: PackedRows) -> float:
  """Share of the packed slots holding a token."""
  segments = np.asarray(packing.segments)
  return float((segments > 0).mean())
