"""Qwen3's Hugging Face side: config.json <-> `ModelConfig`, and its tensor names (Qwen2's
without the q/k/v biases, with `self_attn.q_norm` / `k_norm`)."""

from __future__ import annotations

from typing import Any

from epgrpo_jax.io.errors import UserError
from epgrpo_jax.models._config import ModelConfig
from epgrpo_jax.models._hf_config import decoder_from_hf, decoder_to_hf
from epgrpo_jax.models.qwen2 import hf as qwen2_hf

WEIGHTS: tuple[tuple[str, str, bool], ...] = tuple(
    row for row in qwen2_hf.WEIGHTS if not row[0].endswith(r"_proj\.bias")) + (
    (r"model\.layers\.(\d+)\.self_attn\.(q|k)_norm\.weight", "layers.{0}.attn.{1}_norm.weight", False),
)


def hf_names(cfg: ModelConfig) -> list[str]:
  """Every HF tensor name a Qwen3 of `cfg` has."""
  norms = [f"model.layers.{i}.self_attn.{x}_norm.weight" for i in range(cfg.num_layers) for x in "qk"]
  return [n for n in qwen2_hf.hf_names(cfg) if not n.endswith("_proj.bias")] + norms


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
  """`ModelConfig` keyword arguments of a dense Qwen3 config.json (no attention biases, sliding
  window or mixture of experts)."""
  if hf.get("attention_bias"):
    raise UserError("attention_bias: biases on the attention projections are not supported for qwen3")
  if hf.get("num_experts") or hf.get("num_local_experts"):
    raise UserError("num_experts: mixture-of-experts models are not supported (dense only)")
  if hf.get("use_sliding_window"):
    raise UserError("use_sliding_window: sliding-window attention is not supported")
  return decoder_from_hf(hf) | {"attention_bias": False, "qk_norm": True}


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
  """The config.json transformers' `Qwen3Config` and vLLM read."""
  return {"architectures": ["Qwen3ForCausalLM"]} | decoder_to_hf(cfg) | {
      "attention_bias": False,
      "use_sliding_window": False,
      "sliding_window": None,
      "max_window_layers": cfg.num_layers,
  }
