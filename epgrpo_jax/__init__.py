"""EP-GRPO and GRPO in JAX / Flax NNX.

The public names below (the advantage pipeline, the loss, the configuration,
sampler and rewards) load on first use. The training loop is
`epgrpo_jax.training.loop.train`.
"""

import importlib

from epgrpo_jax.parallel.tpu_env import quiet_absent_tpu

quiet_absent_tpu()  # before JAX loads: an installed libtpu stays silent where no TPU is attached

# Everything loads on first use, so that importing one module (`epgrpo_jax.rewards` in a reward
# worker, `epgrpo_jax.io.errors`) does not pull in JAX through this file.
_LAZY = {
    "VARIANTS": "epgrpo_jax.core.advantages",
    "AdvantageConfig": "epgrpo_jax.core.advantages",
    "Components": "epgrpo_jax.core.advantages",
    "compute_advantages": "epgrpo_jax.core.advantages",
    "LossConfig": "epgrpo_jax.core.losses",
    "policy_loss": "epgrpo_jax.core.losses",
    "token_logprob_entropy": "epgrpo_jax.core.token_stats",
    "TrainConfig": "epgrpo_jax.training.config",
    "load_config": "epgrpo_jax.training.config",
    "Sampler": "epgrpo_jax.rollout.sampling",
    "SamplingConfig": "epgrpo_jax.rollout.sampling",
    "RewardConfig": "epgrpo_jax.rewards",
    "RewardScorer": "epgrpo_jax.rewards",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
  if name in _LAZY:
    return getattr(importlib.import_module(_LAZY[name]), name)
  raise AttributeError(f"module 'epgrpo_jax' has no attribute {name!r}")
