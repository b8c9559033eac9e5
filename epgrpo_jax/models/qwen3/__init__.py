"""The Qwen3 dense family (config.json `model_type: qwen3`): its module, HF weight table,
sharding axes and LoRA targets, registered with `models.registry`."""

from epgrpo_jax.models._config import LORA_TARGETS
from epgrpo_jax.models._decoder import init_cache
from epgrpo_jax.models.qwen3 import hf, sharding
from epgrpo_jax.models.qwen3.model import Qwen3
from epgrpo_jax.models.registry import Family, register

FAMILY = register(Family(
    model_type="qwen3",
    module=Qwen3,
    config_from_hf=hf.config_from_hf,
    config_to_hf=hf.config_to_hf,
    weights=hf.WEIGHTS,
    hf_names=hf.hf_names,
    param_axes=sharding.PARAM_AXES,
    lora_targets=LORA_TARGETS,  # the same seven projections; the q/k norms stay frozen
    init_cache=init_cache,
    ignored=hf.IGNORED,
))

__all__ = ["FAMILY", "Qwen3"]
