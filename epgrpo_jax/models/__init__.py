"""Qwen2 model, LoRA and checkpoint I/O."""

from epgrpo_jax.models._attention import resolve as resolve_attention
from epgrpo_jax.models._config import (ATTENTION, LORA_TARGETS, PRESETS, LoraConfig, ModelConfig,
                                      as_dtype, preset)
from epgrpo_jax.models._lora import (BASE, LORA, Linear, dense_products, lora_layers, matmul, merge_lora,
                                    one_device_program, unmerge_lora)
from epgrpo_jax.models._decoder import (Cache, Qwen2, activation_constraint, attend, decode_kernel,
                                     init_cache, rope, rope_cos_sin, rope_table)
from epgrpo_jax.models._hf_io import (HF_TO_NNX, TOKENIZER_FILES, from_pretrained, hf_state_dict,
                                      load_hf_config, save_pretrained)
from epgrpo_jax.models._tokenizer import (PLAIN_TEMPLATE, check_vocab, encode_prompts, load_tokenizer,
                                          render_prompt, stop_token_ids)
