"""Qwen2 model and LoRA configuration: one frozen dataclass each, with presets."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from epgrpo_jax.io.errors import UserError

LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
ATTENTION = ("auto", "plain", "blockwise", "cudnn", "cpu")
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def as_dtype(name: str):
  """The jnp dtype for 'float32', 'bfloat16' or 'float16'."""
  if name not in _DTYPES:
    raise UserError(f"dtype: unsupported {name!r}; use one of {sorted(_DTYPES)}")
  return _DTYPES[name]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shapes and numerics of a Qwen2-architecture decoder (HF `Qwen2Config` names)."""

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int = 0  # 0: hidden_size // num_heads
  rope_theta: float = 1_000_000.0
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = True
  max_position_embeddings: int = 32768
  bos_token_id: int | None = None
  eos_token_id: int | tuple[int, ...] | None = None
  dtype: str = "float32"  # compute dtype
  param_dtype: str = "float32"  # base-weight dtype (LoRA weights stay float32)
  remat: bool = False  # rematerialise each decoder layer in the backward pass
  # Attention over more than one query (prefill, scoring, update): auto | plain | blockwise |
  # cudnn | cpu (`_attention.resolve`; auto: cudnn on GPU in bf16, the C++ kernel "cpu" on CPU
  # in float32, plain on CPU otherwise, else blockwise).
  attention: str = "auto"
  attention_block: int = 512  # keys per block of the blockwise attention
  attention_segments: int = 16  # cuDNN without a mask array: the most sequences in one row

  def __post_init__(self):
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                 "num_heads", "num_kv_heads"):
      if getattr(self, name) <= 0:
        raise UserError(f"model.{name}: must be > 0, got {getattr(self, name)}")
    if self.num_heads % self.num_kv_heads:
      raise UserError(f"model.num_heads: {self.num_heads} is not a multiple of "
                       f"num_kv_heads {self.num_kv_heads}")
    if self.head_dim == 0:
      if self.hidden_size % self.num_heads:
        raise UserError(f"model.hidden_size: {self.hidden_size} not divisible by "
                         f"num_heads {self.num_heads}")
      object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
    if self.head_dim % 2:
      raise UserError(f"model.head_dim: must be even for rotary embeddings, got {self.head_dim}")
    as_dtype(self.dtype)
    as_dtype(self.param_dtype)
    if self.attention not in ATTENTION:
      raise UserError(f"model.attention: unknown {self.attention!r}; use one of {list(ATTENTION)}")
    if self.attention_block <= 0:
      raise UserError(f"model.attention_block: must be > 0, got {self.attention_block}")
    if self.attention_segments <= 0:
      raise UserError(f"model.attention_segments: must be > 0, got {self.attention_segments}")
    if isinstance(self.eos_token_id, list):
      object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))

  @property
  def eos_ids(self) -> tuple[int, ...]:
    e = self.eos_token_id
    return () if e is None else (e,) if isinstance(e, int) else tuple(e)

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)

  @classmethod
  def from_hf(cls, hf: dict[str, Any], **overrides) -> "ModelConfig":
    """Builds a config from the dict of an HF `config.json`."""
    model_type = hf.get("model_type")
    if model_type not in ("qwen2", None):
      raise UserError(f"model_type: unsupported {model_type!r} (only 'qwen2')")
    if hf.get("use_sliding_window"):
      raise UserError("use_sliding_window: sliding-window attention is not supported")
    if hf.get("rope_scaling"):
      raise UserError("rope_scaling: scaled rotary embeddings are not supported")
    rope_params = hf.get("rope_parameters") or {}  # transformers >= 5 layout
    rope_type = rope_params.get("rope_type", rope_params.get("type", "default"))
    if rope_type != "default":
      raise UserError(f"rope_parameters.rope_type: {rope_type!r} is not supported (only 'default')")
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
      raise UserError(f"hidden_act: unsupported {act!r} (only 'silu')")
    # transformers' Qwen2Config default is 10000 when neither key is present.
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
    kw.update(overrides)
    return cls(**kw)

  def to_hf(self) -> dict[str, Any]:
    """The HF `config.json` dict for this config (float32 or bfloat16 weights)."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size,
        "num_hidden_layers": self.num_layers,
        "num_attention_heads": self.num_heads,
        "num_key_value_heads": self.num_kv_heads,
        "head_dim": self.head_dim,
        "hidden_act": "silu",
        "rope_theta": self.rope_theta,
        "rms_norm_eps": self.rms_norm_eps,
        "tie_word_embeddings": self.tie_word_embeddings,
        "max_position_embeddings": self.max_position_embeddings,
        "bos_token_id": self.bos_token_id,
        "eos_token_id": (list(self.eos_token_id) if isinstance(self.eos_token_id, tuple)
                         else self.eos_token_id),
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": self.num_layers,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
        "torch_dtype": self.param_dtype,  # older transformers and vLLM
        "dtype": self.param_dtype,  # transformers >= 5
    }


def _qwen25(hidden, inter, layers, heads, kv, vocab, tied, max_pos=32768):
  return ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                     num_layers=layers, num_heads=heads, num_kv_heads=kv, head_dim=hidden // heads,
                     rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=tied,
                     max_position_embeddings=max_pos, bos_token_id=151643, eos_token_id=151643)


PRESETS: dict[str, ModelConfig] = {
    "qwen2.5-0.5b": _qwen25(896, 4864, 24, 14, 2, 151936, True),
    "qwen2.5-1.5b": _qwen25(1536, 8960, 28, 12, 2, 151936, True, 131072),
    "qwen2.5-3b": _qwen25(2048, 11008, 36, 16, 2, 151936, True),
    "qwen2.5-7b": _qwen25(3584, 18944, 28, 28, 4, 152064, False, 131072),
    # The workload of the sampler and step benchmarks.
    "bench-tiny": ModelConfig(vocab_size=1024, hidden_size=256, intermediate_size=704,
                              num_layers=4, num_heads=4, num_kv_heads=2, rope_theta=10000.0,
                              tie_word_embeddings=True, max_position_embeddings=2048,
                              bos_token_id=0, eos_token_id=1),
    # Unit tests.
    "test-tiny": ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=2,
                             num_heads=4, num_kv_heads=2, rope_theta=10000.0,
                             tie_word_embeddings=False, max_position_embeddings=256,
                             bos_token_id=0, eos_token_id=1),
}


def preset(name: str, **overrides) -> ModelConfig:
  """A named config (`PRESETS`), with fields overridden (e.g. `num_layers=2`)."""
  if name not in PRESETS:
    raise UserError(f"model.preset: unknown {name!r}; known: {', '.join(sorted(PRESETS))}")
  return PRESETS[name].replace(**overrides)


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """Low-rank adapters W + (alpha / rank) * A @ B on the named projections."""

  rank: int = 32
  alpha: float = 64.0
  targets: tuple[str, ...] = LORA_TARGETS

  def __post_init__(self):
    if self.rank <= 0:
      raise UserError(f"lora.rank: must be > 0, got {self.rank}")
    if self.alpha <= 0:
      raise UserError(f"lora.alpha: must be > 0, got {self.alpha}")
    targets = tuple(self.targets)
    object.__setattr__(self, "targets", targets)
    bad = [t for t in targets if t not in LORA_TARGETS]
    if bad or not targets:
      raise UserError(f"lora.targets: unknown {bad or 'empty list'}; choose from {list(LORA_TARGETS)}")

  @property
  def scale(self) -> float:
    return self.alpha / self.rank
