"""EP-GRPO and GRPO in JAX / Flax NNX.

The advantage pipeline and the loss are imported here; the configuration,
sampler and rewards load on first use (they pull in Flax, Grain, Orbax and
transformers). The training loop is `epgrpo_jax.trainer.train`.
"""

from epgrpo_jax.advantages import VARIANTS, AdvantageConfig, Components, compute_advantages
from epgrpo_jax.losses import LossConfig, policy_loss, token_logprob_entropy

_LAZY = {
    "TrainConfig": "epgrpo_jax.config",
    "load_config": "epgrpo_jax.config",
    "Sampler": "epgrpo_jax.sampling",
    "SamplingConfig": "epgrpo_jax.sampling",
    "RewardConfig": "epgrpo_jax.rewards",
    "RewardScorer": "epgrpo_jax.rewards",
}

__all__ = ["VARIANTS", "AdvantageConfig", "Components", "compute_advantages", "LossConfig",
           "policy_loss", "token_logprob_entropy", *_LAZY]


def __getattr__(name: str):
  if name in _LAZY:
    import importlib
    return getattr(importlib.import_module(_LAZY[name]), name)
  raise AttributeError(f"module 'epgrpo_jax' has no attribute {name!r}")
