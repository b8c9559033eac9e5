"""The config.json keys every family on the shared decoder reads and writes (HF names); a
family adds its own checks and keys (`models/qwen2/hf.py`)."""

from __future__ import annotations

from typing import Any

from epgrpo_jax.io.errors import UserError
from epgrpo_jax.models._config import ModelConfig


def decoder_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
  """`ModelConfig` keyword arguments from an HF config.json dict; one-line UserErrors for what
  the decoder does not support (scaled rotary embeddings, another activation) or bad types."""
  if hf.get("rope_scaling"):
    raise UserError("rope_scaling: scaled rotary embeddings are not supported")
  rope_params = hf.get("rope_parameters") or {}  # transformers >= 5 layout
  rope_type = rope_params.get("rope_type", rope_params.get("type", "default"))
  if rope_type != "default":
    raise UserError(f"rope_parameters.rope_type: {rope_type!r} is not supported (only 'default')")
  act = hf.get("hidden_act", "silu")
  if act not in ("silu", "swish"):
    raise UserError(f"hidden_act: unsupported {act!r} (only 'silu')")
  # transformers' default is 10000 when neither key is present.
  theta = hf.get("rope_theta", rope_params.get("rope_theta", 10000.0))
  try:
    kw = dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads", hf["num_attention_heads"]),
        head_dim=hf.get("head_dim") or 0,
        rope_theta=float(theta),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=hf.get("max_position_embeddings", 32768),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=hf.get("eos_token_id"),
    )
  except KeyError as e:
    raise UserError(f"config.json: missing key {e.args[0]!r}") from None
  except (TypeError, ValueError):
    raise UserError(f"rope_theta, rms_norm_eps: must be numbers, got {theta!r}, "
                    f"{hf.get('rms_norm_eps')!r}") from None
  hf_keys = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
             "num_kv_heads": "num_key_value_heads"}
  for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
               "num_kv_heads", "head_dim", "max_position_embeddings"):
    if not isinstance(kw[name], int) or isinstance(kw[name], bool):
      raise UserError(f"{hf_keys.get(name, name)}: expected an integer, got {kw[name]!r}")
  for name in ("bos_token_id", "eos_token_id"):
    ids = kw[name] if isinstance(kw[name], list) else [kw[name]]
    if not all(i is None or (isinstance(i, int) and not isinstance(i, bool)) for i in ids):
      raise UserError(f"{name}: expected an integer or a list of integers, got {kw[name]!r}")
  return kw


def decoder_to_hf(cfg: ModelConfig) -> dict[str, Any]:
  """The config.json keys of the decoder's shapes and numerics (float32 or bfloat16 weights)."""
  return {
      "model_type": cfg.model_type,
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.hidden_size,
      "intermediate_size": cfg.intermediate_size,
      "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.head_dim,
      "hidden_act": "silu",
      "rope_theta": cfg.rope_theta,
      "rms_norm_eps": cfg.rms_norm_eps,
      "tie_word_embeddings": cfg.tie_word_embeddings,
      "max_position_embeddings": cfg.max_position_embeddings,
      "bos_token_id": cfg.bos_token_id,
      "eos_token_id": (list(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple)
                       else cfg.eos_token_id),
      "attention_dropout": 0.0,
      "initializer_range": 0.02,
      "use_cache": True,
      "rope_scaling": None,
      "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
      "torch_dtype": cfg.param_dtype,  # older transformers and vLLM
      "dtype": cfg.param_dtype,  # transformers >= 5
  }
