"""Answers: extraction from a completion, normalisation, the fast path, and gold answers.

A completion's answer is the content of its last complete `\\boxed{...}` (or
`\\fbox{...}`), optionally with a fallback when there is none. Gold answers are
parsed once (`parse_gold`). Two answers are compared first by a cheap fast path
(`_decide`: equal strings after light normalisation, or equal plain numbers);
what it leaves undecided goes to math-verify (`verify`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any

import numpy as np

from epgrpo_jax.io.errors import UserError
from epgrpo_jax.rewards.config import _DEFAULT_CFG, RewardConfig
from epgrpo_jax.rewards.verify import _parse_gold_text


# ----------------------------------------------------------------------------
# Extraction


_BOX_CMD = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_ANSWER_IS = re.compile(
    r"\banswer\b(?:\*\*)?\s*(?:is|:|=)\s*:?[ \t]*(?:\*\*)?[ \t]*([^\n]+?)[ \t]*(?:\*\*)?[ \t]*(?:$|\n)",
    re.IGNORECASE | re.MULTILINE)
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def _group_end(text: str, start: int) -> int:
  """Index of the `}` closing the `{` at `start`, or -1; `\\{` `\\}` do not count."""
  depth = 0
  i, n = start, len(text)
  while i < n:
    ch = text[i]
    if ch == "\\":
      i += 2
      continue
    if ch == "{":
      depth += 1
    elif ch == "}":
      depth -= 1
      if depth == 0:
        return i
    i += 1
  return -1


def extract_boxed(text: str) -> str | None:
  """Content of the last complete `\\boxed{...}` / `\\fbox{...}` in `text`, stripped.

  Nested braces are matched. `\\boxed 5` (no braces) gives the token after the
  space. An unclosed box (a truncated completion) is passed over in favour of
  an earlier complete one. Empty content counts as no answer (None).
  """
  if not text or "\\" not in text:
    return None
  for m in reversed(list(_BOX_CMD.finditer(text))):
    j = m.end()
    if j < len(text) and text[j] == "{":
      end = _group_end(text, j)
      if end < 0:
        continue
      content = text[j + 1:end].strip()
    elif j < len(text) and text[j] in " \t":
      token = re.match(r"[ \t]+([^\s$]+)", text[j:])
      if token is None:
        continue
      content = token.group(1).rstrip(".,;")
    else:
      continue
    if content:
      return content
  return None


def _answer_is(text: str) -> str | None:
  found = None
  for m in _ANSWER_IS.finditer(text):
    found = m.group(1)
  if found is None:
    return None
  found = found.strip()
  while found and found[-1] in ".$ " and not found.endswith("\\$"):
    found = found[:-1]
  found = found.lstrip("$ ")
  return found or None


def _last_number(text: str) -> str | None:
  found = None
  for m in _NUMBER.finditer(text):
    found = m.group(0)
  return found.replace(",", "") if found else None


def extract_answer(text: str, cfg: RewardConfig | None = None) -> tuple[str | None, bool]:
  """(answer or None, whether it came from a \\boxed{}) under `cfg.fallback`."""
  boxed = extract_boxed(text)
  if boxed is not None:
    return boxed, True
  fallback = (cfg or _DEFAULT_CFG).fallback
  answer = None
  if fallback in ("answer_is", "any"):
    answer = _answer_is(text)
  if answer is None and fallback in ("last_number", "any"):
    answer = _last_number(text)
  return answer, False


# ----------------------------------------------------------------------------
# Normalisation and the fast path


_UNESCAPED_DOLLAR = re.compile(r"(?<!\\)\$")
_SCI = re.compile(r"([-+]?(?:\d+\.?\d*|\.\d+))[eE]([-+]?\d+)")
_SPACES = re.compile(r"\s+|\\[!,;: ]")
_CHOICE = re.compile(r"\\(?:text|textbf|mathrm|mathbf)\{\(?([A-E])\)?\}|\(([A-E])\)")
_TEXT_WORD = re.compile(r"\\(?:text|textrm|mathrm)\{([A-Za-z ]+)\}")
_PLAIN_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_PLAIN_INT = re.compile(r"[-+]?\d+")
_THOUSANDS = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_SCI_LATEX = re.compile(r"([-+]?)(?:(\d+\.?\d*|\.\d+)(?:\\times|\\cdot))?10\^(?:\{([-+]?\d+)\}|(\d))")
_UNIT_TAIL = re.compile(r"\\(?:text|textrm|mathrm|mbox)\{[^{}]*\}(?:\^\{?\d\}?)?$")


def prepare(answer: str) -> str:
  """The LaTeX handed to math-verify: stripped, math-mode `$` removed, trailing
  period dropped, and a bare `4.5e33` rewritten as `4.5\\times 10^{33}` (which
  LaTeX parsing would otherwise read as 4.5 * e * 33)."""
  s = _UNESCAPED_DOLLAR.sub("", answer).strip()
  while s.endswith(".") and not s.endswith("\\."):
    s = s[:-1].rstrip()
  m = _SCI.fullmatch(s)
  if m:
    s = f"{m.group(1)}\\times 10^{{{int(m.group(2))}}}"
  return s


def light_normalise(s: str) -> str:
  """Spacing, `\\left`/`\\right`, `\\dfrac`, `\\text{}` words and `(B)` choices
  normalised away; used only for the exact-match fast path."""
  s = _SPACES.sub("", s)
  s = s.replace("\\left", "").replace("\\right", "")
  s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
  m = _CHOICE.fullmatch(s)
  if m:
    return m.group(1) or m.group(2)
  m = _TEXT_WORD.fullmatch(s)
  if m:
    return m.group(1)
  return s


def _as_number(s: str) -> tuple[float, int | None] | None:
  """(value, exact int or None) for a plain number, else None.

  `s` is light-normalised (no spaces). Accepted: `-12`, `0.5`, `.5`, `1,234`,
  `4.5e33`, `4.5\\times10^{33}`, `10^{-5}`, each optionally followed by one
  `\\text{...}`/`\\mathrm{...}`/`\\mbox{...}` unit (which is dropped).
  """
  if len(s) > 300:
    return None
  unit = _UNIT_TAIL.search(s)
  if unit and unit.start() > 0:
    s = s[:unit.start()]
  if _THOUSANDS.fullmatch(s):
    s = s.replace(",", "")
  m = _SCI_LATEX.fullmatch(s)
  if m:
    s = f"{m.group(1)}{m.group(2) or '1'}e{m.group(3) or m.group(4)}"
  if not _PLAIN_NUMBER.fullmatch(s):
    return None
  try:
    value = float(s)
  except ValueError:
    return None
  if not math.isfinite(value):
    return None
  return value, (int(s) if _PLAIN_INT.fullmatch(s) else None)


def _decide(answer_norm: str, gold: Gold, cfg: RewardConfig) -> bool | None:
  """A verdict without sympy, or None to ask math-verify.

  Fast path (`cfg.fast_path`): equal light-normalised strings, or plain
  numbers equal to rel. 1e-9. Numeric rule (`cfg.numeric_rel_tol` >= 0): when
  both sides are plain numbers they are compared here (integers exactly,
  others to that relative tolerance), because math-verify rounds to 6
  decimal places and so equates e.g. 2.88e-19 and 1.325e-27.
  """
  if cfg.fast_path and answer_norm == gold.norm:
    return True
  if gold.number is None or not (cfg.fast_path or cfg.numeric_rel_tol >= 0):
    return None
  a = _as_number(answer_norm)
  if a is None:
    return None
  (av, ai), (gv, gi) = a, gold.number
  if cfg.fast_path and ((ai is not None and ai == gi)
                        or math.isclose(av, gv, rel_tol=1e-9, abs_tol=0.0)):
    return True
  if cfg.numeric_rel_tol < 0:
    return None
  if ai is not None and gi is not None:
    return ai == gi
  return math.isclose(av, gv, rel_tol=cfg.numeric_rel_tol, abs_tol=0.0)


# ----------------------------------------------------------------------------
# Gold answers


@dataclasses.dataclass(frozen=True)
class Gold:
  """A gold answer, normalised once. `text` is what math-verify parses."""

  raw: str
  text: str
  norm: str
  number: tuple[float, int | None] | None

  @property
  def parsed(self) -> list:
    """math-verify's parse of the gold (cached per process)."""
    return list(_parse_gold_text(self.text))


def _gold_string(answer: Any) -> str:
  if isinstance(answer, Gold):
    return answer.raw
  if isinstance(answer, (bool, np.bool_)):
    raise TypeError(f"gold answer: bool is not an answer ({answer!r})")
  if isinstance(answer, (int, np.integer)):
    return str(int(answer))
  if isinstance(answer, (float, np.floating)):
    value = float(answer)
    if not math.isfinite(value):
      raise UserError(f"gold answer: not finite ({answer!r})")
    return str(int(value)) if value.is_integer() else repr(value)
  if isinstance(answer, str):
    return answer.strip()
  raise TypeError(f"gold answer: expected str/int/float, got {type(answer).__name__}")


def _braces_balance(text: str) -> bool:
  """Whether every `{` has its `}` (escaped braces `\\{`, `\\}` are literal and skipped)."""
  depth = 0
  for i, ch in enumerate(text):
    if ch in "{}" and i and text[i - 1] == "\\":
      continue
    depth += 1 if ch == "{" else -1 if ch == "}" else 0
    if depth < 0:
      return False
  return depth == 0


@functools.lru_cache(maxsize=65536)
def _gold_from_string(raw: str) -> Gold:
  if not raw:
    raise UserError("gold answer: empty")
  if not _braces_balance(raw):
    raise UserError(f"gold answer: unbalanced braces ({raw[:40]!r})")
  text = prepare(raw)
  norm = light_normalise(text)
  return Gold(raw=raw, text=text, norm=norm, number=_as_number(norm))


def parse_gold(answer: Any) -> Gold:
  """A `Gold` from a str/int/float answer (27.0 -> "27"; "025" stays, and
  equals 25 when checked). Cached by value."""
  if isinstance(answer, Gold):
    return answer
  return _gold_from_string(_gold_string(answer))
