"""The Qwen2 / Qwen2.5 module: the shared decoder as it is (q/k/v biases, no q/k norms)."""

from __future__ import annotations

from epgrpo_jax.models._decoder import Decoder


class Qwen2(Decoder):
  """Qwen2 causal LM (`models.interface.CausalLM`). `__call__` returns final-norm hidden states;
  `logits` applies the head."""

  FLAGS = {"attention_bias": True, "qk_norm": False, "rope_scaling": None}
