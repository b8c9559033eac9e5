"""The state of a run between steps: what a checkpoint holds and restores."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx


@dataclasses.dataclass
class RunState:
  """Everything a checkpoint restores."""

  trainable: nnx.State
  opt_state: Any
  key: jax.Array
  step: int = 0
  consecutive_skips: int = 0
  skipped_updates: int = 0
  num_tokens: int = 0
  num_samples: int = 0  # completions sampled (dynamic sampling draws more than P x G a step)

  def tree(self) -> dict:
    return {"trainable": self.trainable, "opt_state": self.opt_state,
            "key": jax.random.key_data(self.key)}

  def meta(self) -> dict:
    return {"step": self.step, "consecutive_skips": self.consecutive_skips,
            "skipped_updates": self.skipped_updates, "num_tokens": self.num_tokens,
            "num_samples": self.num_samples}
