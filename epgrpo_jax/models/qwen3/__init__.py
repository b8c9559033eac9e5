"""The Qwen3 dense family (config.json `model_type: qwen3`): its module, HF weight table,
sharding axes and LoRA targets, registered with `models.registry`."""

import dataclasses

from epgrpo_jax.models import qwen2
from epgrpo_jax.models.qwen3 import hf, sharding
from epgrpo_jax.models.qwen3.model import Qwen3
from epgrpo_jax.models.registry import register

# Qwen2's family with its own module and tables; Qwen2's LoRA targets (the same seven projections; the q/k norms stay frozen),
# KV cache and ignored tensor names.
FAMILY = register(dataclasses.replace(
    qwen2.FAMILY, model_type="qwen3", module=Qwen3, config_from_hf=hf.config_from_hf,
    config_to_hf=hf.config_to_hf, weights=hf.WEIGHTS, hf_names=hf.hf_names,
    param_axes=sharding.PARAM_AXES))

__all__ = ["FAMILY", "Qwen3"]
