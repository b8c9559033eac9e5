"""A user's reward function, `reward.function: "module:function"`, in place of answer checking."""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, Callable, Sequence

import numpy as np

from epgrpo_jax.io.errors import UserError
from epgrpo_jax.rewards.answers import parse_gold
from epgrpo_jax.rewards.config import RewardResult
from epgrpo_jax.rewards.verify import _import_callable

log = logging.getLogger("epgrpo_jax.rewards")


@functools.lru_cache(maxsize=16)
def resolve_reward_function(spec: str) -> Callable[[list[str], list[str]], Sequence[float]]:
  """The callable named by `reward.function` ("module:function"); raises a one-line error."""
  module, _, qualname = spec.partition(":")
  try:
    fn = _import_callable(module, qualname)
  except (ImportError, AttributeError) as e:
    raise UserError(f"reward.function: cannot import {spec!r} ({type(e).__name__}: {e})") from None
  if not callable(fn):
    raise UserError(f"reward.function: {spec!r} is not callable")
  return fn


def custom_rewards(spec: str, completions: Sequence[str], golds: Sequence[Any]) -> RewardResult:
  """Rewards from the `reward.function` named by `spec` (host process, no timeout).

  The function scores the whole batch. If it raises or returns anything but one
  finite number per completion, it is called again one completion at a time; a
  completion whose call still fails scores 0 and is counted in `errors` (status
  "error"), with a warning. It never stops the run.
  """
  start = time.perf_counter()
  fn = resolve_reward_function(spec)
  answers = [parse_gold(g).raw for g in golds]
  n = len(completions)
  status = ["custom"] * n
  reward = _call_reward(fn, list(completions), answers)
  if reward is None:
    reward = np.zeros(n, np.float32)
    for i in range(n):
      one = _call_reward(fn, [completions[i]], [answers[i]])
      if one is None:
        status[i] = "error"
      else:
        reward[i] = one[0]
  errors = status.count("error")
  if errors:
    log.warning("reward.function %s failed on %d of %d completions; they score 0", spec, errors, n)
  return RewardResult(reward=reward, accuracy=reward.copy(), format=np.zeros(n, np.float32),
                      answers=[None] * n, status=status, errors=errors,
                      seconds=time.perf_counter() - start)


def _call_reward(fn, completions: list[str], answers: list[str]) -> np.ndarray | None:
  """`fn`'s rewards as float32 [N], or None if it raised or gave a wrong or non-finite result."""
  try:
    reward = np.asarray(list(fn(completions, answers)), np.float32)
  except Exception as e:  # a user function: any failure is that batch's, not the run's
    log.debug("reward.function raised %s: %s", type(e).__name__, e)
    return None
  if reward.shape != (len(completions),) or not np.all(np.isfinite(reward)):
    return None
  return reward
