"""Advantage estimators: named functions from a step's rewards and scores to token advantages,
selected by `advantage.estimator` (docs/method.md, "Estimators").

An estimator is `fn(rewards_PxG, entropy_PxGxT, logp_old_PxGxT, logp_ref_PxGxT, mask_PxGxT,
cfg) -> (adv_PxGxT, parts, metrics)`: the token advantage, its named parts (`Components`) and
its diagnostics (`ep/*` scalars). Each public module of this package defines and registers
some (`@register("name")`); they are all imported here, so a new estimator is one new file.
"""

import importlib
import pkgutil

from epgrpo_jax.estimators._registry import Estimator, estimate, lookup, names, register, unregister

__all__ = ["Estimator", "estimate", "lookup", "names", "register", "unregister"]

# Every public module is an estimator's: importing it registers it.
for _module in pkgutil.iter_modules(__path__):
  if not _module.name.startswith("_"):
    importlib.import_module(f"{__name__}.{_module.name}")
