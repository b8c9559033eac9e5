"""Qwen2's Hugging Face side: config.json <-> `ModelConfig`, and its tensor names."""

from __future__ import annotations

from typing import Any

from epgrpo_jax.io.errors import UserError
from epgrpo_jax.models._config import ModelConfig
from epgrpo_jax.models._hf_config import decoder_from_hf, decoder_to_hf

# HF name (regex, full match) -> NNX path template; `True`: HF stores [out, in], we store [in, out].
WEIGHTS: tuple[tuple[str, str, bool], ...] = (
    (r"model\.embed_tokens\.weight", "embed", False),
    (r"lm_head\.weight", "lm_head", True),
    (r"model\.norm\.weight", "final_norm.weight", False),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", "layers.{0}.input_norm.weight", False),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", "layers.{0}.post_attn_norm.weight", False),
    (r"model\.layers\.(\d+)\.self_attn\.(q|k|v|o)_proj\.weight", "layers.{0}.attn.{1}.kernel", True),
    (r"model\.layers\.(\d+)\.self_attn\.(q|k|v)_proj\.bias", "layers.{0}.attn.{1}.bias", False),
    (r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight", "layers.{0}.mlp.{1}.kernel", True),
)
# Tensors some exporters add that carry nothing we need.
IGNORED = (r".*rotary_emb\.inv_freq",)


def hf_names(cfg: ModelConfig) -> list[str]:
  """Every HF tensor name a Qwen2 of `cfg` has."""
  names = ["model.embed_tokens.weight", "model.norm.weight"]
  if not cfg.tie_word_embeddings:
    names.append("lm_head.weight")
  for i in range(cfg.num_layers):
    p = f"model.layers.{i}."
    names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    names += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
    names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
    names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
  return names


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
  """`ModelConfig` keyword arguments of a Qwen2 config.json (no sliding-window attention)."""
  if hf.get("use_sliding_window"):
    raise UserError("use_sliding_window: sliding-window attention is not supported")
  return decoder_from_hf(hf)


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
  """The config.json transformers' `Qwen2Config` and vLLM read."""
  return {"architectures": ["Qwen2ForCausalLM"]} | decoder_to_hf(cfg) | {
      "use_sliding_window": False,
      "sliding_window": None,
      "max_window_layers": cfg.num_layers,
  }
