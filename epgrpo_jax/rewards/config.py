"""What a reward scorer is told (RewardConfig) and what it gives back (RewardResult)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from epgrpo_jax.io.errors import UserError

FALLBACKS = ("none", "answer_is", "last_number", "any")
STATUSES = ("fast", "verified", "no_answer", "too_long", "timeout", "error", "custom")


@dataclasses.dataclass(frozen=True)
class RewardConfig:
  """How completions are turned into rewards.

  reward = accuracy_weight * correct + format_weight * boxed
           - format_penalty * (not boxed)
  """

  accuracy_weight: float = 1.0
  format_weight: float = 0.0
  format_penalty: float = 0.0
  # When a completion has no \boxed{}: "none" (answer missing, the training
  # default), "answer_is" ("the answer is X" / "Answer: X"), "last_number"
  # (the last number in the text), or "any" (answer_is, then last_number).
  fallback: str = "none"
  timeout_s: float = 5.0  # CPU seconds per checked item (see CheckPool)
  fast_path: bool = True  # skip sympy for equal strings / equal plain numbers
  # Plain numbers on both sides are compared numerically (integers exactly),
  # not by math-verify; < 0 turns this off.
  numeric_rel_tol: float = 1e-6
  max_answer_chars: int = 1000  # longer extracted answers score 0 unchecked
  # A custom reward instead of answer checking: "module:function", called in the
  # host process as function(completions, answers) -> list[float] (answers are the
  # gold answer strings). Its value is the reward (and `accuracy`); the weights,
  # fallback and workers above are then unused.
  function: str = ""
  # DAPO's soft overlong punishment, added to the reward by the trainer: 0 up to
  # max_new_tokens - overlong_buffer tokens, then falling linearly to
  # -overlong_penalty_factor at max_new_tokens (`overlong_penalty`). 0: off.
  overlong_buffer: int = 0
  overlong_penalty_factor: float = 1.0

  def __post_init__(self):
    if self.function:
      module, _, qualname = self.function.partition(":")
      if not module or not qualname:
        raise UserError(f"reward.function: expected 'module:function', got {self.function!r}")
    if self.fallback not in FALLBACKS:
      raise UserError(f"reward.fallback: must be one of {FALLBACKS}, got {self.fallback!r}")
    if not self.timeout_s > 0:
      raise UserError(f"reward.timeout_s: must be > 0, got {self.timeout_s}")
    if not math.isfinite(self.numeric_rel_tol):
      raise UserError(f"reward.numeric_rel_tol: must be finite, got {self.numeric_rel_tol}")
    if self.max_answer_chars < 1:
      raise UserError(f"reward.max_answer_chars: must be >= 1, got {self.max_answer_chars}")
    for name in ("accuracy_weight", "format_weight", "format_penalty"):
      if not math.isfinite(getattr(self, name)):
        raise UserError(f"reward.{name}: must be finite, got {getattr(self, name)}")
    if (isinstance(self.overlong_buffer, bool) or not isinstance(self.overlong_buffer, int)
        or self.overlong_buffer < 0):
      raise UserError(f"reward.overlong_buffer: must be an int >= 0, got {self.overlong_buffer!r}")
    if not (math.isfinite(self.overlong_penalty_factor) and self.overlong_penalty_factor >= 0):
      raise UserError(f"reward.overlong_penalty_factor: must be finite and >= 0, got "
                       f"{self.overlong_penalty_factor}")


@dataclasses.dataclass
class RewardResult:
  """Per-completion rewards and what produced them."""

  reward: np.ndarray  # float32 [N]
  accuracy: np.ndarray  # float32 [N], 1 correct / 0
  format: np.ndarray  # float32 [N], 1 if a \boxed{} answer exists
  answers: list[str | None]  # extracted answers (before normalisation)
  status: list[str]  # one of STATUSES per completion
  timeouts: int = 0  # completions whose check timed out
  errors: int = 0  # completions whose check raised or whose worker died
  fast: int = 0  # completions decided by the fast path
  checked: int = 0  # distinct (answer, gold) pairs sent to math-verify
  seconds: float = 0.0  # submit -> result
  overlong_penalty: np.ndarray | None = None  # float32 [N], included in `reward` (trainer)


_DEFAULT_CFG = RewardConfig()
