"""The Llama 3.x module: the shared decoder without attention biases or q/k norms (rotary
frequencies by Llama 3.1's rule where config.json asks for it, `ModelConfig.rope_scaling`)."""

from __future__ import annotations

from epgrpo_jax.models._decoder import Decoder


class Llama(Decoder):
  """Llama causal LM (`models.interface.CausalLM`). `__call__` returns final-norm hidden states;
  `logits` applies the head."""

  FLAGS = {"attention_bias": False, "qk_norm": False}
