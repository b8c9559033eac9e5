"""The causal-LM interface: what the sampler, the training programs, evaluation and export may
use of a model, whatever its family (`models.registry` builds one from a `ModelConfig`).

Shape suffixes: B batch, T new tokens, D hidden, V vocabulary.
"""

from __future__ import annotations

from typing import Protocol

import jax

from epgrpo_jax.models._config import LoraConfig, ModelConfig
from epgrpo_jax.models._kernels import XLA, Kernels
from epgrpo_jax.models._lora import Projection

# A family's KV cache: a plain pytree; the shared decoder's is {"k": [L x BxKxHdxS],
# "v": [L x BxKxSxHd], "valid": BxS bool, "index": int32 scalar or [B]}.
Cache = dict


class CausalLM(Protocol):
  """A decoder-only language model in Flax NNX.

  `__call__` returns the final-norm hidden states (and the updated cache); the head is
  applied by the caller (`logits`, or the losses' chunked products over `head_DxV`).
  A family also gives `init_cache(cfg, batch, slots, dtype)` (`registry.Family.init_cache`).
  """

  cfg: ModelConfig
  lora: LoraConfig | None

  def __call__(self, tokens_BxT: jax.Array, positions_BxT: jax.Array, mask_BxT: jax.Array,
               cache: Cache | None = None, *, adapters: bool = True,
               rope_table: tuple[jax.Array, jax.Array] | None = None,
               segments_BxT: jax.Array | None = None,
               kernels: Kernels = XLA) -> tuple[jax.Array, Cache | None]:
    """Hidden states [B, T, D] of `tokens_BxT` at `positions_BxT`: without a cache, causal
    attention within the batch over the keys where `mask_BxT`; with one, the tokens written at
    its `index` and attending to every valid slot (the cache comes back updated, else None).
    `adapters=False` runs the base weights alone; `rope_table` (`models.rope_table`) looks
    the rotary angles up by position; `segments_BxT` (no cache): packed rows, each token
    attends within its own segment; `kernels`: the backend's implementations, chosen once per
    program (`epgrpo_jax.kernels.seam.choose`; `Kernels.products` in `linear_groups` order)."""
    ...

  def head_DxV(self) -> jax.Array:
    """The output projection [D, V] in the compute dtype."""
    ...

  def logits(self, hidden_BxTxD: jax.Array) -> jax.Array:
    """Full float32 logits [B, T, V]."""
    ...

  def linear_groups(self) -> list[list[Projection]]:
    """The projections as the forward pass multiplies them: each group is one fused product
    over the same input (e.g. q/k/v), in a fixed order (decode's prepared weights, LoRA)."""
    ...
