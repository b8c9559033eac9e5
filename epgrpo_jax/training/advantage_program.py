"""The advantage as a jitted device program: the configured estimator (`advantage.estimator`)
with its `ep/*` diagnostics, with explicit shardings of the P groups."""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

from epgrpo_jax import estimators
from epgrpo_jax.core import advantages
from epgrpo_jax.parallel import distributed, sharding


def advantage_step(rewards_PxG, entropy_PxGxT, logp_old_PxGxT, logp_ref_PxGxT, mask_PxGxT, *,
                   cfg: advantages.AdvantageConfig):
  """`(advantage, parts, metrics)` of the estimator `cfg.estimator` names (`epgrpo_jax.estimators`)."""
  return estimators.estimate(rewards_PxG, entropy_PxGxT, logp_old_PxGxT, logp_ref_PxGxT,
                             mask_PxGxT, cfg)


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
