"""EP-GRPO and GRPO in JAX / Flax NNX.

The public names below (the advantage pipeline, the loss, the configuration,
sampler and rewards) load on first use. The training loop is
`epgrpo_jax.trainer.train`.
"""

# Everything loads on first use, so that importing one module (`epgrpo_jax.rewards` in a reward
# worker, `epgrpo_jax.errors`) does not pull in JAX through this file.
_LAZY = {
    "VARIANTS": "epgrpo_jax.advantages",
    "AdvantageConfig": "epgrpo_jax.advantages",
    "Components": "epgrpo_jax.advantages",
    "compute_advantages": "epgrpo_jax.advantages",
    "LossConfig": "epgrpo_jax.losses",
    "policy_loss": "epgrpo_jax.losses",
    "token_logprob_entropy": "epgrpo_jax.losses",
    "TrainConfig": "epgrpo_jax.config",
    "load_config": "epgrpo_jax.config",
    "Sampler": "epgrpo_jax.sampling",
    "SamplingConfig": "epgrpo_jax.sampling",
    "RewardConfig": "epgrpo_jax.rewards",
    "RewardScorer": "epgrpo_jax.rewards",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
  if name in _LAZY:
    import importlib
    return getattr(importlib.import_module(_LAZY[name]), name)
  raise AttributeError(f"module 'epgrpo_jax' has no attribute {name!r}")
