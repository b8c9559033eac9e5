"""The arithmetic problems: difficulty levels, step-by-step solutions, the two splits, answers.

A problem such as ``Compute 7*5-3*2.`` comes with a solution of one binary
operation per line, in the usual order, ending in the boxed answer::

    7*5=35
    3*2=6
    35-6=29
    \\boxed{29}
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import re
from typing import Any, Sequence

from epgrpo_jax.rewards import extract_boxed

VERSION = "arithmetic-v1"
_MAX_VALUE = 999  # every operand, intermediate result and answer lies in [0, _MAX_VALUE]


@dataclasses.dataclass(frozen=True)
class Level:
  """A difficulty level: expression templates, operand ranges, and a result bound.

  In a template, an upper-case letter is an operand drawn from `big`, a
  lower-case one from `small`; each ``~`` becomes ``+`` or ``-``. Every
  intermediate result and the answer lie in ``[0, max_value]``.
  """

  templates: tuple[str, ...]
  small: tuple[int, int] = (0, 9)
  big: tuple[int, int] = (10, 99)
  max_value: int = 999
  heldout_fraction: float = 0.2  # the share of the level's problems reserved for held-out


LEVELS: dict[int, Level] = {
    1: Level(("a~b",), max_value=9, heldout_fraction=0.3),  # one step of the single-digit table
    2: Level(("a~b~c",), max_value=9),  # two steps, single digits throughout
    3: Level(("a~b~c~d",), max_value=9),  # three steps, single digits throughout
    4: Level(("a*b",), small=(2, 9), heldout_fraction=0.3),  # the times table: 2-digit results
    5: Level(("a*b~c", "a~b*c"), small=(2, 9)),  # precedence, then 2-digit +- 1-digit
    6: Level(("a*b~c*d", "(a+b)*c"), small=(2, 9)),  # 2-digit +- 2-digit, 2-digit * 1-digit
}


def _tokenize_expr(expr: str) -> list[int | str]:
  return [int(t) if t.isdigit() else t for t in re.findall(r"\d+|[-+*()]", expr)]


def _apply(a: int, op: str, b: int) -> int:
  return a + b if op == "+" else a - b if op == "-" else a * b


def solve(expr: str, slip: float = 0.0, rng: random.Random | None = None) -> tuple[list[str], int]:
  """Evaluates `expr` one binary operation at a time, in the usual order.

  Innermost parentheses first; within a group, ``*`` left to right, then
  ``+``/``-`` left to right. Returns the steps ``"a op b=c"`` and the value.
  With `slip` > 0, each result is, with that probability, replaced by a near
  miss (one digit off by one) that later steps then use: an imperfect
  demonstrator, whose final answer is then usually wrong.
  """
  toks = _tokenize_expr(expr)
  steps = []
  while len(toks) > 1:
    if ")" in toks:
      j = toks.index(")")
      i = max(k for k in range(j) if toks[k] == "(")
    else:
      i, j = -1, len(toks)
    group = toks[i + 1:j]
    if len(group) == 1:  # "(x)" -> "x"
      toks[i:j + 1] = group
      continue
    ops = [k for k, t in enumerate(group) if t == "*"] or [k for k, t in enumerate(group)
                                                         if t in ("+", "-")]
    k = ops[0]
    a, op, b = group[k - 1], group[k], group[k + 1]
    c = _apply(a, op, b)
    if slip and rng is not None and rng.random() < slip:
      c = _near_miss(c, rng)
    steps.append(f"{a}{op}{b}={c}")
    group[k - 1:k + 2] = [c]
    toks[i + 1:j] = group
  return steps, int(toks[0])


def _near_miss(c: int, rng: random.Random) -> int:
  """`c` with one digit moved up or down by one (never `c`; the sign is kept)."""
  if c < 0:
    return -_near_miss(-c, rng)
  digits = list(str(c))
  i = rng.randrange(len(digits))
  d = int(digits[i]) + rng.choice((-1, 1))
  if d < 0 or d > 9 or (d == 0 and i == 0 and len(digits) > 1):
    d = int(digits[i]) - (d - int(digits[i]))
  digits[i] = str(d)
  return int("".join(digits))


def solution_text(steps: Sequence[str], answer: int) -> str:
  """The reference completion: one step a line, then the boxed answer."""
  return "".join(s + "\n" for s in steps) + f"\\boxed{{{answer}}}"


def problem_text(expr: str) -> str:
  return f"Compute {expr}."


def _sample_expr(level: Level, rng: random.Random) -> str:
  out = []
  for ch in rng.choice(level.templates):
    if ch.isalpha():
      lo, hi = level.big if ch.isupper() else level.small
      out.append(str(rng.randint(lo, hi)))
    elif ch == "~":
      out.append(rng.choice("+-"))
    else:
      out.append(ch)
  return "".join(out)


def _valid(expr: str, max_value: int) -> bool:
  steps, value = solve(expr)
  return all(0 <= int(s.split("=")[1]) <= max_value for s in steps) and 0 <= value <= max_value


def make_problem(expr: str, level: int) -> dict[str, Any]:
  """A JSONL row: problem, answer (a string, as in math datasets), level, solution."""
  steps, value = solve(expr)
  return {"problem": problem_text(expr), "answer": str(value), "level": level,
          "solution": solution_text(steps, value), "expression": expr}


def _is_heldout(expr: str, seed: int, fraction: float) -> bool:
  h = int.from_bytes(hashlib.sha256(f"{seed}:{expr}".encode()).digest()[:8], "big")
  return h / 2**64 < fraction


def generate_splits(seed: int = 0, train_per_level: int = 1500, heldout_per_level: int = 50,
                    levels: dict[int, Level] | None = None) -> tuple[list[dict], list[dict]]:
  """Train and held-out rows, reproducible from `seed`, with disjoint expressions.

  Which split an expression may go to is fixed by a hash of (seed, expression),
  so the splits never share a problem. Each level gets (up to)
  `heldout_per_level` held-out problems and exactly `train_per_level` train
  rows: distinct problems while the level has enough of them, then its train
  problems again (level 1 has about 90), so that train is balanced by level.
  """
  levels = LEVELS if levels is None else levels
  train, heldout = [], []
  for lvl, spec in levels.items():
    rng = random.Random(f"{seed}:{VERSION}:{lvl}")
    seen: set[str] = set()
    rows_t, rows_h = [], []
    misses = 0
    while (len(rows_t) < train_per_level or len(rows_h) < heldout_per_level) and misses < 2000:
      expr = _sample_expr(spec, rng)
      if expr in seen or not _valid(expr, min(spec.max_value, _MAX_VALUE)):
        misses += 1
        continue
      misses = 0
      seen.add(expr)
      target, want = ((rows_h, heldout_per_level) if _is_heldout(expr, seed, spec.heldout_fraction)
                      else (rows_t, train_per_level))
      if len(target) < want:
        target.append(make_problem(expr, lvl))
    if not rows_t:
      raise ValueError(f"level {lvl}: no train problem could be generated")
    unique = len(rows_t)
    rows_t += [rows_t[i % unique] for i in range(train_per_level - unique)]
    train += rows_t
    heldout += rows_h
  random.Random(f"{seed}:{VERSION}:shuffle").shuffle(train)
  random.Random(f"{seed}:{VERSION}:shuffle-heldout").shuffle(heldout)
  return train, heldout


def is_correct(completion: str, answer: str | int) -> bool:
  """Exact integer match of the last boxed answer."""
  boxed = extract_boxed(completion)
  if boxed is None:
    return False
  boxed = boxed.strip()
  if not re.fullmatch(r"-?\d+", boxed):
    return False
  return int(boxed) == int(answer)
