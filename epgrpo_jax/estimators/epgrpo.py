"""`epgrpo`: EP-GRPO's token advantage (eqs. 3, 15-26) and its ablations (Table IV), which are
its switches `advantage.entropy_gate`, `progress_signal` and `zero_variance_anchor`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from epgrpo_jax.core import advantages
from epgrpo_jax.estimators._outcome import masked_mean, outcome_metrics
from epgrpo_jax.estimators._registry import register


def epgrpo_metrics(adv_PxGxT: jax.Array, c: advantages.Components, mask_PxGxT: jax.Array, *,
                   num_buckets: int) -> dict[str, jax.Array]:
  """The `ep/*` diagnostics: the shared ones, and the gate, the progress part, polarity flips
  (tokens whose final advantage's sign is not their outcome's), the anchored groups and the
  buckets' occupancy."""
  m = mask_PxGxT
  n = jnp.maximum(m.sum(), 1)
  mean = lambda x: masked_mean(x, m)
  outcome_sign = jnp.sign(c.outcome)[..., None]
  signed = m & (outcome_sign != 0)
  flips = signed & (jnp.sign(adv_PxGxT) != outcome_sign)
  gate_mean = mean(c.gate)
  zv = c.zero_variance
  buckets = jax.nn.one_hot(c.bucket, num_buckets) * m[..., None]
  occupancy = buckets.sum(axis=(0, 1, 2)) / n
  cells_PxK = buckets.sum(axis=(1, 2))  # tokens per (group, bucket)
  has_tokens_P = m.any(axis=(1, 2))
  return {
      **outcome_metrics(adv_PxGxT, c.outcome_token, zv, m),
      "ep/gate_mean": gate_mean,
      "ep/gate_std": jnp.sqrt(mean(jnp.square(c.gate - gate_mean))),
      "ep/progress_adv_mean": mean(c.progress),
      "ep/progress_adv_abs_mean": mean(jnp.abs(c.progress)),
      "ep/polarity_flip_frac": flips.sum() / jnp.maximum(signed.sum(), 1),
      "ep/anchor_groups_frac": (zv & jnp.any(c.anchor != 0, axis=-1)).mean(),
      "ep/bucket_occupancy_min": occupancy.min(),
      "ep/bucket_occupancy_max": occupancy.max(),
      "ep/bucket_empty_frac": jnp.sum((cells_PxK == 0) & has_tokens_P[:, None])
                              / jnp.maximum(has_tokens_P.sum() * num_buckets, 1),
      "ep/signal_abs_mean": mean(jnp.abs(c.signal)),
  }


@register("epgrpo")
def epgrpo(rewards_PxG, entropy_PxGxT, logp_old_PxGxT, logp_ref_PxGxT, mask_PxGxT,
           cfg: advantages.AdvantageConfig):
  """`compute_advantages` with its diagnostics."""
  adv_PxGxT, c = advantages.compute_advantages(rewards_PxG, entropy_PxGxT, logp_old_PxGxT,
                                               logp_ref_PxGxT, mask_PxGxT, cfg)
  return adv_PxGxT, c, epgrpo_metrics(adv_PxGxT, c, mask_PxGxT, num_buckets=cfg.num_buckets)
