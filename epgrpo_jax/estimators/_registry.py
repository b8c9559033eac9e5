"""The registry of advantage estimators, by the name `advantage.estimator` gives."""

from __future__ import annotations

from typing import Callable

import jax

from epgrpo_jax.core import advantages
from epgrpo_jax.io.errors import UserError

# (rewards [P, G], entropy, logp_old, logp_ref [P, G, T] float32 constants, mask [P, G, T] bool,
#  cfg) -> (advantage [P, G, T], parts, metrics {name: scalar})
Estimator = Callable[..., tuple[jax.Array, advantages.Components, dict[str, jax.Array]]]

_ESTIMATORS: dict[str, Estimator] = {}


def register(name: str) -> Callable[[Estimator], Estimator]:
  """Decorator: registers an estimator under `name` (the value of `advantage.estimator`)."""

  def add(fn: Estimator) -> Estimator:
    if _ESTIMATORS.get(name, fn) is not fn:
      raise ValueError(f"advantage estimator {name!r} is registered already ({_ESTIMATORS[name]})")
    _ESTIMATORS[name] = fn
    return fn

  return add


def unregister(name: str) -> None:
  """Removes `name` from the registry (a test's toy estimator)."""
  _ESTIMATORS.pop(name, None)


def names() -> list[str]:
  return sorted(_ESTIMATORS)


def lookup(name: str) -> Estimator:
  """The estimator registered as `name`; an unknown name is the config's error (exit 2)."""
  if name not in _ESTIMATORS:
    raise UserError(f"advantage.estimator: unknown {name!r}; use one of {names()}")
  return _ESTIMATORS[name]


def estimate(rewards_PxG, entropy_PxGxT, logp_old_PxGxT, logp_ref_PxGxT, mask_PxGxT,
             cfg: advantages.AdvantageConfig):
  """`cfg.estimator`'s `(adv_PxGxT, parts, metrics)`, its inputs checked and made constants
  (`advantages.advantage_inputs`). Pure and traceable; `cfg` is static under jit."""
  inputs = advantages.advantage_inputs(rewards_PxG, entropy_PxGxT, logp_old_PxGxT,
                                       logp_ref_PxGxT, mask_PxGxT)
  return lookup(cfg.estimator)(*inputs, cfg)
