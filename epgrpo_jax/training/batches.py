"""The arrays an RL step's programs take and give: the rows of prompts and sampled completions
(`CompletionBatch`), with the update's per-token inputs (`UpdateBatch`), and what the fused
update computes on its way to the loss (`Scored`)."""

from __future__ import annotations

from typing import Any

import jax
from flax import struct

from epgrpo_jax.training.packing import PackedRows


@struct.dataclass
class CompletionBatch:
  """Flattened rows (B = prompts x samples) of prompts and sampled completions; with
  `packing`, the forward passes run over its packed rows instead (`training/packing.py`).
  `behaviour_logp`, the sampler's log-probs of the completions, gives the loss its mismatch
  metrics and `loss.rollout_correction` its behaviour policy (`losses.policy_loss`)."""

  prompt_ids: jax.Array  # [B, Tp] int32, left-padded
  prompt_mask: jax.Array  # [B, Tp] bool
  completion: jax.Array  # [B, N] int32
  completion_mask: jax.Array  # [B, N] bool
  packing: PackedRows | None = None
  behaviour_logp: jax.Array | None = None  # [B, N] float32


@struct.dataclass
class UpdateBatch:
  rollout: CompletionBatch
  logp_old: jax.Array  # [B, N]
  logp_ref: jax.Array  # [B, N]
  advantage: jax.Array  # [B, N]


@struct.dataclass
class Scored:
  """What the fused update computes on its way to the loss: the scoring pass (old log-probs,
  entropies), the reference log-probs and the token-level advantage with its parts and
  `ep/*` diagnostics; the same values the separate scoring and advantage programs give."""

  logp_old: jax.Array  # [B, N]
  entropy: jax.Array  # [B, N]
  logp_ref: jax.Array  # [B, N]
  advantage: jax.Array  # [P, G, N]
  components: Any  # advantages.Components
  adv_metrics: dict[str, jax.Array]


def split_rows(batch: UpdateBatch, parts: int) -> list[UpdateBatch]:
  """`parts` equal consecutive row slices of the batch."""
  if parts == 1:
    return [batch]
  size = batch.advantage.shape[0] // parts
  return [jax.tree.map(lambda x: x[i * size:(i + 1) * size], batch) for i in range(parts)]
