"""Model and LoRA configuration: one frozen dataclass each, with presets. The mapping to and from
an HF config.json is the family's (`models.registry.config_from_hf` / `config_to_hf`)."""

from __future__ import annotations

import dataclasses
import jax.numpy as jnp

from epgrpo_jax.io.errors import UserError

# Every projection of the shared decoder (`models/_decoder.py`): the default adapter targets. A
# family declares which it supports (`registry.Family.lora_targets`), checked when it is built.
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
ATTENTION = ("auto", "plain", "blockwise", "cudnn")
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def check_attention(name: str) -> None:
  """Raises a config error unless `name` is a `model.attention` value."""
  if name == "cpu":
    raise UserError("model.attention: 'cpu' is not a value; use auto (on a CPU in float32 it "
                    "runs the C++ kernel)")
  if name not in ATTENTION:
    raise UserError(f"model.attention: unknown {name!r}; use one of {list(ATTENTION)}")


def as_dtype(name: str):
  """The jnp dtype for 'float32', 'bfloat16' or 'float16'."""
  if name not in _DTYPES:
    raise UserError(f"dtype: unsupported {name!r}; use one of {sorted(_DTYPES)}")
  return _DTYPES[name]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shapes and numerics of a decoder; `model_type` (config.json's) names its family."""

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
  # cudnn (`kernels.seam.resolve`; auto: cudnn on GPU in bf16, the C++ causal kernel on CPU
  # in float32 where it builds, plain on CPU otherwise, else blockwise).
  attention: str = "auto"
  attention_block: int = 512  # keys per block of the blockwise attention
  attention_segments: int = 16  # cuDNN without a mask array: the most sequences in one row
  model_type: str = "qwen2"  # the family (`models.registry`)
  # Decoder flags (`models/_decoder.py`), set by the family from config.json; each family's
  # module accepts only its own values.
  attention_bias: bool = True  # biases on q, k and v (o has none): Qwen2 yes, Qwen3 no
  qk_norm: bool = False  # RMSNorm over head_dim on each q and k head before the rotary (Qwen3)
  # Llama 3.1's rotary frequencies for long contexts (HF rope_type "llama3"): (factor,
  # low_freq_factor, high_freq_factor, original_max_position_embeddings); None: unscaled.
  rope_scaling: tuple[float, float, float, int] | None = None

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
    check_attention(self.attention)
    if self.attention_block <= 0:
      raise UserError(f"model.attention_block: must be > 0, got {self.attention_block}")
    if self.attention_segments <= 0:
      raise UserError(f"model.attention_segments: must be > 0, got {self.attention_segments}")
    if self.rope_scaling is not None:
      if len(self.rope_scaling) != 4:
        raise UserError(f"model.rope_scaling: expected (factor, low_freq_factor, high_freq_factor, "
                        f"original_max_position_embeddings), got {self.rope_scaling!r}")
      object.__setattr__(self, "rope_scaling", tuple(self.rope_scaling))
    if isinstance(self.eos_token_id, list):
      object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))

  @property
  def eos_ids(self) -> tuple[int, ...]:
    e = self.eos_token_id
    return () if e is None else (e,) if isinstance(e, int) else tuple(e)

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)


def _qwen25(hidden, inter, layers, heads, kv, vocab, tied, max_pos=32768):
  return ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                     num_layers=layers, num_heads=heads, num_kv_heads=kv, head_dim=hidden // heads,
                     rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=tied,
                     max_position_embeddings=max_pos, bos_token_id=151643, eos_token_id=151643)


def _qwen3(hidden, inter, layers, heads, kv):
  return ModelConfig(vocab_size=151936, hidden_size=hidden, intermediate_size=inter,
                     num_layers=layers, num_heads=heads, num_kv_heads=kv, head_dim=128,
                     rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True,
                     max_position_embeddings=40960, bos_token_id=151643, eos_token_id=151645,
                     model_type="qwen3", attention_bias=False, qk_norm=True)


def _llama3(hidden, inter, layers, heads, head_dim, tied, rope_factor):
  """Llama 3.1 / 3.2 Instruct: 8 KV heads, the 128,256-token vocabulary, theta 5e5 and the
  "llama3" rotary rule over an original context of 8,192 (low 1, high 4) to 131,072 positions;
  the Instruct files' three end ids (<|end_of_text|>, <|eom_id|>, <|eot_id|>)."""
  return ModelConfig(vocab_size=128256, hidden_size=hidden, intermediate_size=inter,
                     num_layers=layers, num_heads=heads, num_kv_heads=8, head_dim=head_dim,
                     rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=tied,
                     max_position_embeddings=131072, bos_token_id=128000,
                     eos_token_id=(128001, 128008, 128009), model_type="llama",
                     attention_bias=False, qk_norm=False, rope_scaling=(rope_factor, 1.0, 4.0, 8192))


PRESETS: dict[str, ModelConfig] = {
    "qwen2.5-0.5b": _qwen25(896, 4864, 24, 14, 2, 151936, True),
    "qwen2.5-1.5b": _qwen25(1536, 8960, 28, 12, 2, 151936, True, 131072),
    "qwen2.5-3b": _qwen25(2048, 11008, 36, 16, 2, 151936, True),
    "qwen2.5-7b": _qwen25(3584, 18944, 28, 28, 4, 152064, False, 131072),
    # The Qwen3-1.7B and Qwen3-4B config.json shapes (head_dim 128 whatever hidden / heads).
    "qwen3-1.7b": _qwen3(2048, 6144, 28, 16, 8),
    "qwen3-4b": _qwen3(2560, 9728, 36, 32, 8),
    # The config.json shapes of Llama-3.2-1B/3B-Instruct (tied, rope factor 32) and
    # Llama-3.1-8B-Instruct (untied, factor 8).
    "llama3.2-1b": _llama3(2048, 8192, 16, 32, 64, True, 32.0),
    "llama3.2-3b": _llama3(3072, 8192, 28, 24, 128, True, 32.0),
    "llama3.1-8b": _llama3(4096, 14336, 32, 32, 128, False, 8.0),
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
