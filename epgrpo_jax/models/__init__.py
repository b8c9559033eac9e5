"""Causal-LM families behind one interface (`interface.CausalLM`, `registry`), LoRA and checkpoint I/O."""

from epgrpo_jax.models._config import (ATTENTION, LORA_TARGETS, PRESETS, LoraConfig, ModelConfig, check_attention,
                                      as_dtype, preset)
from epgrpo_jax.models._kernels import (XLA, Kernels, concatenated, ordered_remat, rounded_matmul,
                                       through_bits, write_row_slots, write_slots, xla_matmul,
                                       xla_rounded_product, xla_swiglu)
from epgrpo_jax.models._dense import Dense
from epgrpo_jax.models._lora import (BASE, LORA, LoRA, adapters_are_zero, dense, low_rank, lora_layers,
                                    merge_adapters, plain_kernels, rank_transposed_matmul, saved_adapters,
                                    unmerge_adapters)
from epgrpo_jax.models._decoder import attend
from epgrpo_jax.models._prompt_cache import attend_shared, grown, merge_partials, split_cache
from epgrpo_jax.models._rope import rope, rope_cos_sin, rope_table
from epgrpo_jax.models.interface import Cache, CausalLM
from epgrpo_jax.models.registry import (Family, abstract_model, build, config_from_hf, config_to_hf, family,
                                        init_cache, param_rules, register)
from epgrpo_jax.models.qwen2 import Qwen2  # registers the family
from epgrpo_jax.models.qwen3 import Qwen3  # registers the family
from epgrpo_jax.models.llama import Llama  # registers the family
from epgrpo_jax.models._hf_io import (TOKENIZER_FILES, from_pretrained, hf_state_dict, load_hf_config,
                                      save_pretrained)
from epgrpo_jax.models._tokenizer import (PLAIN_TEMPLATE, check_vocab, encode_prompts, load_tokenizer,
                                          render_prompt, stop_token_ids)
