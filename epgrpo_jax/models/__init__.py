"""Qwen2 model, LoRA and checkpoint I/O."""

from epgrpo_jax.models._config import LORA_TARGETS, PRESETS, LoraConfig, ModelConfig, as_dtype, preset
from epgrpo_jax.models._lora import BASE, LORA, Linear, lora_layers, merge_lora, unmerge_lora
from epgrpo_jax.models._qwen2 import Cache, Qwen2, init_cache, rope
