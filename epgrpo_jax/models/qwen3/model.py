"""The Qwen3 (dense) module: the shared decoder without attention biases and with an RMSNorm
over head_dim on each q and k head before the rotary embedding (transformers' Qwen3Attention)."""

from __future__ import annotations

from epgrpo_jax.models._decoder import Decoder


class Qwen3(Decoder):
  """Qwen3 causal LM (`models.interface.CausalLM`). `__call__` returns final-norm hidden states;
  `logits` applies the head."""

  FLAGS = {"attention_bias": False, "qk_norm": True, "rope_scaling": None}
