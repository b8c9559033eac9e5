"""math-verify, and the checker a worker runs (math-verify or a "module:function").

math-verify (`parse` + `verify`) understands fractions, decimals, choices,
units, sets, intervals and symbolic expressions. It runs here with its own
timeouts off: they use SIGALRM, which only works in the main thread and cannot
interrupt long C-level arithmetic, so the deadline is enforced by killing the
worker process instead (`pool.CheckPool`). math-verify and sympy are imported
on first use, in workers or, for inline checks, in the parent.
"""

from __future__ import annotations

import functools
import importlib
import logging
from typing import Any, Callable

from epgrpo_jax.io.errors import UserError

DEFAULT_CHECKER = "math_verify"


def _silence_math_verify():
  import math_verify.grader  # heavy (sympy): only in workers and inline checks
  import math_verify.parser  # heavy (sympy): only in workers and inline checks
  # We run with math-verify's timeouts off on purpose; its one-time warning
  # about that is noise.
  math_verify.grader.TIMEOUT_WARNING_SHOWN = True
  math_verify.parser.TIMEOUT_WARNING_SHOWN = True
  for name in ("math_verify", "latex2sympy2_extended"):
    logging.getLogger(name).setLevel(logging.ERROR)


@functools.lru_cache(maxsize=1)
def _mv():
  import math_verify  # heavy (sympy): only in workers and inline checks
  _silence_math_verify()
  configs = [math_verify.LatexExtractionConfig(), math_verify.ExprExtractionConfig()]
  return math_verify, configs


def _mv_parse(text: str) -> list:
  mv, configs = _mv()
  return mv.parse("\\boxed{" + text + "}", configs, parsing_timeout=None)


@functools.lru_cache(maxsize=8192)
def _parse_gold_text(text: str) -> tuple:
  return tuple(_mv_parse(text))


def verify_prepared(answer: str, gold_text: str) -> bool:
  """math-verify on a prepared answer and a gold `text` (no timeout: call it
  in a worker, or only on trusted input)."""
  gold = _parse_gold_text(gold_text)
  if not gold:
    return False
  target = _mv_parse(answer)
  if not target:
    return False
  mv, _ = _mv()
  return bool(mv.verify(list(gold), target, timeout_seconds=None))


# ----------------------------------------------------------------------------
# Checkers: math-verify or a user's "module:function"


def _resolve_checker(spec: str) -> Callable[[str, str], bool]:
  if spec == DEFAULT_CHECKER:
    return verify_prepared
  module, _, qualname = spec.partition(":")
  if not module or not qualname:
    raise UserError(f"checker: expected 'math_verify' or 'module:function', got {spec!r}")
  return _import_callable(module, qualname)


def _import_callable(module: str, qualname: str) -> Callable:
  obj: Any = importlib.import_module(module)
  for part in qualname.split("."):
    obj = getattr(obj, part)
  return obj


def _checker_spec(checker: str | Callable | None) -> str:
  if checker is None:
    return DEFAULT_CHECKER
  if isinstance(checker, str):
    return checker
  name = f"{checker.__module__}:{checker.__qualname__}"
  if "<" in name or checker.__module__ == "__main__":
    raise UserError(f"checker: {name} is not importable by name in a worker; use a "
                     "module-level function of an importable module")
  return name
