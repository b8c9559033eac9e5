"""Llama's Hugging Face side: config.json <-> `ModelConfig` (rope_type "default" or "llama3"),
and its tensor names (Qwen2's without the q/k/v biases)."""

from __future__ import annotations

from typing import Any

from epgrpo_jax.io.errors import UserError
from epgrpo_jax.models._config import ModelConfig
from epgrpo_jax.models._hf_config import decoder_from_hf, decoder_to_hf
from epgrpo_jax.models.llama.model import Llama
from epgrpo_jax.models.qwen2 import hf as qwen2_hf

WEIGHTS: tuple[tuple[str, str, bool], ...] = tuple(
    row for row in qwen2_hf.WEIGHTS if not row[0].endswith(r"_proj\.bias"))
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def hf_names(cfg: ModelConfig) -> list[str]:
  """Every HF tensor name a Llama of `cfg` has."""
  return [n for n in qwen2_hf.hf_names(cfg) if not n.endswith("_proj.bias")]


def rope_scaling_from_hf(hf: dict[str, Any]) -> tuple | None:
  """`ModelConfig.rope_scaling` of a config.json: None for rope_type "default", the four
  "llama3" parameters for it (older files put them under `rope_scaling`, transformers >= 5
  under `rope_parameters`); any other rope_type is a one-line UserError."""
  params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
  rope_type = params.get("rope_type", params.get("type", "default"))
  if rope_type == "default":
    return None
  if rope_type != "llama3":
    raise UserError(f"rope_parameters.rope_type: {rope_type!r} is not supported (only 'default', 'llama3')")
  missing = [k for k in _LLAMA3_KEYS if k not in params]
  if missing:
    raise UserError(f"rope_parameters.{missing[0]}: missing for rope_type 'llama3'")
  factor, low, high, original = (params[k] for k in _LLAMA3_KEYS)
  return float(factor), float(low), float(high), int(original)


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
  """`ModelConfig` keyword arguments of a Llama config.json (no attention or MLP biases)."""
  for key in ("attention_bias", "mlp_bias"):
    if hf.get(key):
      raise UserError(f"{key}: biases on the projections are not supported for llama")
  scaling = rope_scaling_from_hf(hf)
  rope_params = {k: v for k, v in (hf.get("rope_parameters") or {}).items() if k not in _LLAMA3_KEYS}
  plain = {k: v for k, v in hf.items() if k != "rope_scaling"} | {
      "rope_parameters": rope_params | {"rope_type": "default"}}
  return decoder_from_hf(plain) | Llama.FLAGS | {"rope_scaling": scaling}


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
  """The config.json transformers' `LlamaConfig` and vLLM read."""
  out = {"architectures": ["LlamaForCausalLM"]} | decoder_to_hf(cfg) | {
      "attention_bias": False, "mlp_bias": False}
  if cfg.rope_scaling is not None:
    params = {"rope_type": "llama3"} | dict(zip(_LLAMA3_KEYS, cfg.rope_scaling))
    out |= {"rope_scaling": params, "rope_parameters": params | {"rope_theta": cfg.rope_theta}}
  return out
