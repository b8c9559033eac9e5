"""The Qwen2 / Qwen2.5 family (config.json `model_type: qwen2`): its module, HF weight table,
sharding axes and LoRA targets, registered with `models.registry`."""

from epgrpo_jax.models._config import LORA_TARGETS
from epgrpo_jax.models._decoder import init_cache
from epgrpo_jax.models.qwen2 import hf, sharding
from epgrpo_jax.models.qwen2.model import Qwen2
from epgrpo_jax.models.registry import Family, register

FAMILY = register(Family(
    model_type="qwen2",
    module=Qwen2,
    config_from_hf=hf.config_from_hf,
    config_to_hf=hf.config_to_hf,
    weights=hf.WEIGHTS,
    hf_names=hf.hf_names,
    param_axes=sharding.PARAM_AXES,
    lora_targets=LORA_TARGETS,  # every projection of the shared decoder
    init_cache=init_cache,
    ignored=hf.IGNORED,
))

__all__ = ["FAMILY", "Qwen2"]
