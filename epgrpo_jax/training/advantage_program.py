"""The advantage as a jitted device program: `compute_advantages` and its `ep/*` diagnostics,
with explicit shardings of the P groups."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from epgrpo_jax.core import advantages
from epgrpo_jax.parallel import distributed, sharding


def advantage_step(rewards_PxG, entropy_PxGxT, logp_old_PxGxT, logp_ref_PxGxT, mask_PxGxT, *,
                   cfg: advantages.AdvantageConfig):
  """The advantage and its diagnostics (gate, components, polarity, zero variance, buckets)."""
  adv, c = advantages.compute_advantages(rewards_PxG, entropy_PxGxT, logp_old_PxGxT,
                                         logp_ref_PxGxT, mask_PxGxT, cfg)
  m = mask_PxGxT.astype(bool)
  n = jnp.maximum(m.sum(), 1)
  mean = lambda x: jnp.sum(jnp.where(m, x, 0.0)) / n
  outcome_sign = jnp.sign(c.outcome)[..., None]
  signed = m & (outcome_sign != 0)
  flips = signed & (jnp.sign(adv) != outcome_sign)
  gate_mean = mean(c.gate)
  zv = c.zero_variance
  buckets = jax.nn.one_hot(c.bucket, cfg.num_buckets) * m[..., None]
  occupancy = buckets.sum(axis=(0, 1, 2)) / n
  cells_PxK = buckets.sum(axis=(1, 2))  # tokens per (group, bucket)
  has_tokens_P = m.any(axis=(1, 2))
  metrics = {
      "ep/gate_mean": gate_mean,
      "ep/gate_std": jnp.sqrt(mean(jnp.square(c.gate - gate_mean))),
      "ep/outcome_adv_mean": mean(c.outcome_token),
      "ep/outcome_adv_abs_mean": mean(jnp.abs(c.outcome_token)),
      "ep/progress_adv_mean": mean(c.progress),
      "ep/progress_adv_abs_mean": mean(jnp.abs(c.progress)),
      "ep/final_adv_mean": mean(adv),
      "ep/final_adv_abs_mean": mean(jnp.abs(adv)),
      "ep/polarity_flip_frac": flips.sum() / jnp.maximum(signed.sum(), 1),
      "ep/zero_variance_frac": zv.mean(),
      "ep/anchor_groups_frac": (zv & jnp.any(c.anchor != 0, axis=-1)).mean(),
      "ep/zero_variance_token_frac": jnp.sum(m & zv[:, None, None]) / n,
      "ep/bucket_occupancy_min": occupancy.min(),
      "ep/bucket_occupancy_max": occupancy.max(),
      "ep/bucket_empty_frac": jnp.sum((cells_PxK == 0) & has_tokens_P[:, None])
                              / jnp.maximum(has_tokens_P.sum() * cfg.num_buckets, 1),
      "ep/signal_abs_mean": mean(jnp.abs(c.signal)),
  }
  return adv, c, metrics


class AdvantageProgram:
  """`advantage_step` jitted with explicit shardings; called like it (with `cfg=`).

  Groups P are split over data x fsdp when those divide P (else replicated);
  the metrics are replicated. One program per (P sharding, config).
  """

  def __init__(self, mesh: jax.sharding.Mesh):
    self.mesh = mesh
    self._programs: dict[Any, Any] = {}

  def __call__(self, rewards_PxG, entropy_PxGxT, logp_old_PxGxT, logp_ref_PxGxT, mask_PxGxT, *,
               cfg: advantages.AdvantageConfig):
    groups, program = self.program(np.shape(rewards_PxG), cfg)
    args = (rewards_PxG, entropy_PxGxT, logp_old_PxGxT, logp_ref_PxGxT, mask_PxGxT)
    return program(*(distributed.put(x, groups) for x in args))

  def program(self, shape_PxG: tuple[int, ...], cfg: advantages.AdvantageConfig):
    """(the groups' sharding, the jitted program) for P groups (`shape_PxG`) and `cfg`."""
    groups = sharding.leading_sharding(self.mesh, shape_PxG)
    program = self._programs.get((groups, cfg))
    if program is None:
      program = jax.jit(functools.partial(advantage_step, cfg=cfg), in_shardings=(groups,) * 5,
                        out_shardings=(groups, groups, sharding.replicated(self.mesh)))
      self._programs[(groups, cfg)] = program
    return groups, program
