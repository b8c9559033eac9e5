"""Answer extraction, math answer checking and parallel reward scoring.

A completion's answer is the content of its last complete `\\boxed{...}` (or
`\\fbox{...}`), optionally with a fallback when there is none. Gold answers are
parsed once (`parse_gold`). Two answers are compared by a cheap fast path
(equal strings after light normalisation, or equal plain numbers) and
otherwise by math-verify (`parse` + `verify`), which understands fractions,
decimals, choices, units, sets, intervals and symbolic expressions.

math-verify's own timeouts use SIGALRM, which only works in the main thread and
cannot interrupt long C-level arithmetic (`2^{2^{2^{100}}}` hangs inside sympy
and CPython big-integer code). So math-verify runs here with its timeouts off,
in worker processes that a dispatcher thread kills and replaces when an item
uses up its CPU-time budget (`CheckPool`). Workers are plain `python -I`
subprocesses (exec'd, never forked from the multithreaded JAX parent) that load
this file by path, so they never import the trainer's main module, the
`epgrpo_jax` package, or JAX.

This module is import-light: numpy and the standard library only at top level;
math-verify/sympy are imported lazily (in workers, or in the parent only for
inline checks).
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import dataclasses
import functools
import json
import logging
import math
import os
import re
import socket
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as _mp_wait
from typing import Any, Callable, Sequence

import numpy as np

from epgrpo_jax.io.errors import UserError

log = logging.getLogger("epgrpo_jax.rewards")

FALLBACKS = ("none", "answer_is", "last_number", "any")
STATUSES = ("fast", "verified", "no_answer", "too_long", "timeout", "error", "custom")
DEFAULT_CHECKER = "math_verify"


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


def overlong_penalty(lengths_B: np.ndarray, *, max_len: int, buffer: int,
                     factor: float = 1.0) -> np.ndarray:
  """DAPO's soft overlong punishment (DAPO eq. 13), float32 [B]; zeros when `buffer` is 0.

  With L_max = `max_len` and L_cache = `buffer`: 0 for |y| <= L_max - L_cache,
  `((L_max - L_cache) - |y|) / L_cache` up to L_max, -1 beyond; times `factor`.
  """
  lengths_B = np.asarray(lengths_B, np.float64)
  if buffer <= 0:
    return np.zeros(lengths_B.shape, np.float32)
  start = max_len - buffer
  return (factor * np.clip((start - lengths_B) / buffer, -1.0, 0.0)).astype(np.float32)


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


# ----------------------------------------------------------------------------
# math-verify (runs in workers, or inline)


def _silence_math_verify():
  import math_verify.grader
  import math_verify.parser
  # We run with math-verify's timeouts off on purpose; its one-time warning
  # about that is noise.
  math_verify.grader.TIMEOUT_WARNING_SHOWN = True
  math_verify.parser.TIMEOUT_WARNING_SHOWN = True
  for name in ("math_verify", "latex2sympy2_extended"):
    logging.getLogger(name).setLevel(logging.ERROR)


@functools.lru_cache(maxsize=1)
def _mv():
  import math_verify
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


def _resolve_checker(spec: str) -> Callable[[str, str], bool]:
  if spec == DEFAULT_CHECKER:
    return verify_prepared
  module, _, qualname = spec.partition(":")
  if not module or not qualname:
    raise UserError(f"checker: expected 'math_verify' or 'module:function', got {spec!r}")
  return _import_callable(module, qualname)


def _import_callable(module: str, qualname: str) -> Callable:
  import importlib
  obj: Any = importlib.import_module(module)
  for part in qualname.split("."):
    obj = getattr(obj, part)
  return obj


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


# ----------------------------------------------------------------------------
# Worker processes


_BOOT = (
    "import importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location('_epgrpo_reward_worker', sys.argv[1])\n"
    "mod = importlib.util.module_from_spec(spec)\n"
    "sys.modules[spec.name] = mod\n"
    "spec.loader.exec_module(mod)\n"
    "mod._worker_main(sys.argv[2:])\n")


def _worker_main(argv: list[str]) -> None:
  """Entry point of a worker process: answer (id, answer, gold) messages."""
  import signal
  fd, mem_mb, checker, paths = int(argv[0]), int(argv[1]), argv[2], json.loads(argv[3])
  parent_pid = int(argv[4])
  sys.path.extend(p for p in paths if p not in sys.path)
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
  try:  # die with the dispatcher thread that started us (Linux)
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
  except Exception:
    pass
  if os.getppid() != parent_pid:
    return
  if mem_mb > 0:
    try:
      import resource
      limit = mem_mb * 2**20
      resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except (ImportError, ValueError, OSError):
      pass
  conn = Connection(fd)
  check = _resolve_checker(checker)
  if checker == DEFAULT_CHECKER:
    verify_prepared("\\frac{1}{2}", "0.5")  # warm-up: imports, regex compiles
  conn.send(("ready", os.getpid(), "jax" in sys.modules))
  while True:
    try:
      msg = conn.recv()
    except (EOFError, OSError):
      return
    if msg is None:
      return
    tid, answer, gold = msg
    try:
      reply = (tid, True, bool(check(answer, gold)))
    except Exception as e:  # never str(e): sympy objects can hang when printed
      reply = (tid, False, type(e).__name__)
    try:
      conn.send(reply)
    except (EOFError, OSError):
      return


@dataclasses.dataclass(eq=False)
class _Worker:
  proc: subprocess.Popen
  conn: Connection
  started: float
  ready: bool = False
  has_jax: bool = False
  item: tuple[_Job, int] | None = None
  dispatched: float = 0.0  # wall clock when the item was sent
  cpu0: float | None = None  # the worker's CPU seconds then (None: no /proc)
  deadline: float = 0.0  # next time to look at the item


@dataclasses.dataclass(eq=False)
class _Job:
  pairs: list[tuple[str, str]]
  timeout_s: float
  future: concurrent.futures.Future
  finish: Callable[[list[tuple[str, Any]]], Any]
  results: list[tuple[str, Any] | None] = dataclasses.field(default_factory=list)
  remaining: int = 0


_POOLS: weakref.WeakSet = weakref.WeakSet()


class CheckPool:
  """Worker processes that check (answer, gold) pairs with a per-item deadline.

  A dispatcher thread hands one item at a time to each idle worker. An item
  that has used `timeout_s` seconds of the worker's CPU time (read from
  /proc, so a busy machine does not turn slow checks into timeouts), or
  `WALL_FACTOR * timeout_s` wall seconds, gets status "timeout"; its worker is
  killed (SIGKILL) and replaced, so a hung check never blocks later ones.
  Without /proc the wall clock alone counts, at `timeout_s`. A checker
  exception or a worker crash gives status "error". Results are (status,
  value) with status in {"ok", "timeout", "error"}.
  """

  WALL_FACTOR = 10.0

  def __init__(self, num_workers: int, *, checker: str = DEFAULT_CHECKER,
               memory_limit_mb: int = 4096, startup_timeout_s: float = 120.0):
    if num_workers < 1:
      raise ValueError(f"num_workers: must be >= 1, got {num_workers}")
    self.num_workers = num_workers
    self._checker = checker
    self._mem_mb = int(memory_limit_mb or 0)
    self._startup_timeout_s = startup_timeout_s
    self._lock = threading.Lock()
    self._queue: collections.deque[tuple[_Job, int]] = collections.deque()
    self._closed = False
    self._broken: str | None = None
    self._startup_failures = 0
    self._workers: list[_Worker] = []  # touched by the dispatcher thread only
    # Keys fixed up front, so that readers copying it never see it grow.
    self.stats = collections.Counter(
        {"checked": 0, "timeouts": 0, "errors": 0, "restarts": 0, "jax_in_worker": 0})
    self._wake_r, self._wake_w = socket.socketpair()
    self._wake_r.setblocking(False)
    self._wake_w.setblocking(False)
    self._thread = threading.Thread(target=self._run, name="reward-check-pool", daemon=True)
    self._thread.start()
    _POOLS.add(self)

  # -- public

  def submit(self, pairs: Sequence[tuple[str, str]], timeout_s: float,
             finish: Callable[[list[tuple[str, Any]]], Any] = list) -> concurrent.futures.Future:
    """Future of `finish(results)`, results in the order of `pairs`."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_running_or_notify_cancel()
    job = _Job(list(pairs), float(timeout_s), future, finish)
    job.results = [None] * len(job.pairs)
    job.remaining = len(job.pairs)
    if not job.pairs:
      _complete(job)
      return future
    with self._lock:
      if self._closed:
        raise RuntimeError("reward check pool: closed")
      if self._broken:
        raise RuntimeError(f"reward check pool: broken ({self._broken})")
      self._queue.extend((job, i) for i in range(len(job.pairs)))
    self._wake()
    return future

  def close(self, wait: bool = True) -> None:
    with self._lock:
      if self._closed:
        return
      self._closed = True
    self._wake()
    if wait and threading.current_thread() is not self._thread:
      self._thread.join(timeout=30)

  @property
  def broken(self) -> str | None:
    return self._broken

  # -- dispatcher thread

  def _wake(self):
    try:
      self._wake_w.send(b"x")
    except (BlockingIOError, OSError):
      pass

  def _spawn(self) -> None:
    parent, child = socket.socketpair()
    try:
      args = [sys.executable, "-I", "-c", _BOOT, os.path.abspath(__file__), str(child.fileno()),
              str(self._mem_mb), self._checker, json.dumps([p for p in sys.path if p]),
              str(os.getpid())]
      proc = subprocess.Popen(args, pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, close_fds=True)
    except BaseException:
      parent.close()
      raise
    finally:
      child.close()
    self._workers.append(_Worker(proc, Connection(parent.detach()), time.monotonic()))

  def _kill(self, w: _Worker) -> None:
    self._workers.remove(w)
    try:
      w.proc.kill()
    except OSError:
      pass
    try:
      w.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
      pass
    w.conn.close()

  def _record(self, job: _Job, i: int, status: str, value: Any) -> None:
    if job.results[i] is not None:
      return
    job.results[i] = (status, value)
    job.remaining -= 1
    self.stats["checked"] += 1
    if status == "timeout":
      self.stats["timeouts"] += 1
    elif status == "error":
      self.stats["errors"] += 1
    if job.remaining == 0:
      _complete(job)

  def _lost(self, w: _Worker, status: str, value: Any) -> None:
    item = w.item
    self._kill(w)
    self.stats["restarts"] += 1
    if item is not None:
      self._record(*item, status, value)

  def _on_message(self, w: _Worker) -> None:
    try:
      msg = w.conn.recv()
    except (EOFError, OSError):
      code = w.proc.poll()
      if not w.ready:
        self._startup_failed(w, f"worker exited during start-up (code {code})")
      else:
        self._lost(w, "error", f"worker died (code {code})")
      return
    if msg[0] == "ready":
      w.ready = True
      w.has_jax = bool(msg[2])
      self.stats["jax_in_worker"] += int(w.has_jax)
      self._startup_failures = 0
      return
    tid, ok, value = msg
    if w.item is None or id(w.item[0]) != tid[0] or w.item[1] != tid[1]:
      return  # stale reply
    job, i = w.item
    w.item = None
    self._record(job, i, "ok" if ok else "error", value)

  def _startup_failed(self, w: _Worker, why: str) -> None:
    self._kill(w)
    self._startup_failures += 1
    log.warning("reward worker: %s", why)
    if self._startup_failures >= 3:
      self._broken = f"{why}; 3 start-ups in a row failed"

  def _dispatch(self) -> None:
    for w in self._workers:
      if not w.ready or w.item is not None:
        continue
      with self._lock:
        if not self._queue:
          return
        job, i = self._queue.popleft()
      answer, gold = job.pairs[i]
      try:
        w.conn.send(((id(job), i), answer, gold))
      except (OSError, ValueError):
        with self._lock:
          self._queue.appendleft((job, i))
        continue  # the EOF is seen and handled on the next wait
      w.item = (job, i)
      w.dispatched = time.monotonic()
      w.cpu0 = _cpu_seconds(w.proc.pid)
      w.deadline = w.dispatched + job.timeout_s

  def _check_deadlines(self) -> None:
    now = time.monotonic()
    for w in list(self._workers):
      if w.item is not None and now >= w.deadline:
        budget = w.item[0].timeout_s
        cpu = _cpu_seconds(w.proc.pid) if w.cpu0 is not None else None
        if cpu is None or now - w.dispatched >= self.WALL_FACTOR * budget:
          self._lost(w, "timeout", None)
        elif cpu - w.cpu0 >= budget:
          self._lost(w, "timeout", None)
        else:
          left = budget - (cpu - w.cpu0)
          w.deadline = min(now + max(0.05, left), w.dispatched + self.WALL_FACTOR * budget)
      elif not w.ready and now - w.started > self._startup_timeout_s:
        self._startup_failed(w, f"not ready after {self._startup_timeout_s:.0f} s")

  def _next_wait(self) -> float | None:
    now = time.monotonic()
    ends = [w.deadline for w in self._workers if w.item is not None]
    ends += [w.started + self._startup_timeout_s for w in self._workers if not w.ready]
    return max(0.0, min(ends) - now) if ends else None

  def _run(self) -> None:
    try:
      while True:
        with self._lock:
          if self._closed:
            break
        if self._broken:
          self._fail_all(RuntimeError(f"reward check pool: broken ({self._broken})"))
          break
        while len(self._workers) < self.num_workers:
          self._spawn()
        self._dispatch()
        objs: list[Any] = [w.conn for w in self._workers] + [self._wake_r]
        ready = _mp_wait(objs, self._next_wait())
        for obj in ready:
          if obj is self._wake_r:
            try:
              while self._wake_r.recv(4096):
                pass
            except (BlockingIOError, OSError):
              pass
            continue
          w = next((w for w in self._workers if w.conn is obj), None)
          if w is not None:
            self._on_message(w)
        self._check_deadlines()
    except BaseException as e:  # keep the trainer informed rather than hanging
      self._broken = f"dispatcher crashed: {type(e).__name__}: {e}"
      log.exception("reward check pool dispatcher crashed")
    finally:
      self._shutdown()

  def _fail_all(self, exc: BaseException) -> None:
    with self._lock:
      jobs = {id(job): job for job, _ in self._queue}
      self._queue.clear()
    for w in self._workers:
      if w.item is not None:
        jobs[id(w.item[0])] = w.item[0]
    for job in jobs.values():
      if not job.future.done():
        job.future.set_exception(exc)

  def _shutdown(self) -> None:
    with self._lock:
      self._closed = True
    self._fail_all(RuntimeError("reward check pool: closed"))
    for w in self._workers:
      try:
        w.conn.send(None)
      except (OSError, ValueError):
        pass
    end = time.monotonic() + 1.0
    for w in list(self._workers):
      try:
        w.proc.wait(timeout=max(0.01, end - time.monotonic()))
      except subprocess.TimeoutExpired:
        pass
      self._kill(w)
    self._wake_r.close()
    self._wake_w.close()


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_seconds(pid: int) -> float | None:
  """User + system CPU seconds of process `pid` (Linux /proc), else None."""
  try:
    with open(f"/proc/{pid}/stat", "rb") as f:
      fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK
  except (OSError, IndexError, ValueError):
    return None


def _complete(job: _Job) -> None:
  if job.future.done():
    return
  try:
    job.future.set_result(job.finish(job.results))
  except BaseException as e:
    job.future.set_exception(e)


@atexit.register
def _close_all_pools():
  for pool in list(_POOLS):
    pool.close(wait=True)


_SHARED_POOL: CheckPool | None = None
_SHARED_LOCK = threading.Lock()


def _shared_pool() -> CheckPool:
  global _SHARED_POOL
  with _SHARED_LOCK:
    if _SHARED_POOL is None or _SHARED_POOL.broken or _SHARED_POOL._closed:
      _SHARED_POOL = CheckPool(1)
    return _SHARED_POOL


# ----------------------------------------------------------------------------
# Single checks


_DEFAULT_CFG = RewardConfig()


def _answer_of(text: str, cfg: RewardConfig) -> str | None:
  if "\\boxed" in text or "\\fbox" in text:
    return extract_answer(text, cfg)[0]
  return text.strip() or None


def check(completion_or_answer: str, gold: Gold | str | int | float, *,
          timeout_s: float | None = None, cfg: RewardConfig | None = None) -> bool:
  """Whether a completion (its last \\boxed{}) or a bare answer equals `gold`.

  With `timeout_s=None` math-verify runs inline, without a timeout (trusted
  input only). With a timeout (CPU seconds, as in `CheckPool`) it runs in a
  shared one-worker process pool, so it works from any thread; a timed-out
  check is False (counted in `check_stats()`).
  """
  cfg = cfg or _DEFAULT_CFG
  g = parse_gold(gold)
  answer = _answer_of(completion_or_answer, cfg)
  if answer is None or len(answer) > cfg.max_answer_chars:
    return False
  answer = prepare(answer)
  verdict = _decide(light_normalise(answer), g, cfg)
  if verdict is not None:
    return verdict
  if timeout_s is None:
    return verify_prepared(answer, g.text)
  [(status, value)] = _shared_pool().submit([(answer, g.text)], timeout_s).result()
  return status == "ok" and bool(value)


def check_stats() -> dict[str, int]:
  """Counters of the shared pool behind `check(..., timeout_s=...)`."""
  pool = _SHARED_POOL
  return dict(pool.stats) if pool is not None else {}


# ----------------------------------------------------------------------------
# Batched scoring


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


def _default_workers() -> int:
  try:
    cores = len(os.sched_getaffinity(0))
  except AttributeError:
    cores = os.cpu_count() or 1
  return max(1, min(8, cores))


class RewardScorer:
  """Scores completions against gold answers on a pool of worker processes.

  `submit(...)` returns a `concurrent.futures.Future[RewardResult]` at once, so
  reward checking can overlap accelerator work; `score(...)` waits. With
  `num_workers=0` checks run inline in `submit` (no timeouts; for debugging).
  A check that raises or times out scores 0 and is counted; it never raises.
  With `cfg.function` set, the named function scores in this process instead
  (no workers are started unless `num_workers` asks for them).
  Use as a context manager, or call `close()`.
  """

  def __init__(self, cfg: RewardConfig | None = None, num_workers: int | None = None, *,
               checker: str | Callable[[str, str], bool] | None = None,
               memory_limit_mb: int = 4096):
    self.cfg = cfg or RewardConfig()
    if self.cfg.function:
      resolve_reward_function(self.cfg.function)  # fail at start, not at the first step
      if num_workers is None:
        num_workers = 0
    self.num_workers = _default_workers() if num_workers is None else int(num_workers)
    self._inline_checker = checker if callable(checker) else None
    self._checker_spec = (_checker_spec(checker) if self.num_workers > 0 or not callable(checker)
                          else DEFAULT_CHECKER)
    self._pool = None
    if self.num_workers > 0:
      self._pool = CheckPool(self.num_workers, checker=self._checker_spec,
                             memory_limit_mb=memory_limit_mb)
    self._closer = weakref.finalize(self, _close_pool, self._pool)

  @property
  def stats(self) -> dict[str, int]:
    """Pool counters since start: checked, timeouts, errors, restarts."""
    return dict(self._pool.stats) if self._pool is not None else {}

  def score(self, completions: Sequence[str], golds: Sequence[Any],
            cfg: RewardConfig | None = None) -> RewardResult:
    """`submit(...).result()`."""
    return self.submit(completions, golds, cfg).result()

  def submit(self, completions: Sequence[str], golds: Sequence[Any],
             cfg: RewardConfig | None = None) -> concurrent.futures.Future:
    """Future[RewardResult]; `golds[i]` (Gold, str, int or float) is the gold
    answer of `completions[i]`. `cfg` overrides the scorer's config for this
    call (e.g. an evaluation fallback on the training pool)."""
    if len(completions) != len(golds):
      raise ValueError(f"score: {len(completions)} completions but {len(golds)} golds")
    start = time.perf_counter()
    cfg = cfg or self.cfg
    if cfg.function:
      future: concurrent.futures.Future = concurrent.futures.Future()
      future.set_running_or_notify_cancel()
      future.set_result(custom_rewards(cfg.function, completions, golds))
      return future
    n = len(completions)
    gold_objs = [parse_gold(g) for g in golds]
    answers: list[str | None] = [None] * n
    fmt = np.zeros(n, np.float32)
    acc = np.zeros(n, np.float32)
    status = ["no_answer"] * n
    pending: dict[tuple[str, str], list[int]] = {}
    for i, text in enumerate(completions):
      answer, boxed = extract_answer(text or "", cfg)
      answers[i] = answer
      fmt[i] = float(boxed)
      if answer is None:
        continue
      if len(answer) > cfg.max_answer_chars:
        status[i] = "too_long"
        continue
      prepared = prepare(answer)
      verdict = _decide(light_normalise(prepared), gold_objs[i], cfg)
      if verdict is not None:
        acc[i] = float(verdict)
        status[i] = "fast"
        continue
      pending.setdefault((prepared, gold_objs[i].text), []).append(i)
    keys = list(pending)

    def finish(results: list[tuple[str, Any]]) -> RewardResult:
      for key, (st, value) in zip(keys, results):
        for i in pending[key]:
          if st == "ok":
            acc[i] = float(bool(value))
            status[i] = "verified"
          else:
            status[i] = st
      reward = (cfg.accuracy_weight * acc + cfg.format_weight * fmt
                - cfg.format_penalty * (1.0 - fmt)).astype(np.float32)
      return RewardResult(
          reward=reward, accuracy=acc, format=fmt, answers=answers, status=status,
          timeouts=status.count("timeout"), errors=status.count("error"),
          fast=status.count("fast"), checked=len(keys),
          seconds=time.perf_counter() - start)

    if self._pool is None:
      future: concurrent.futures.Future = concurrent.futures.Future()
      future.set_running_or_notify_cancel()
      check_fn = self._inline_checker or _resolve_checker(self._checker_spec)
      results = []
      for answer, gold_text in keys:
        try:
          results.append(("ok", bool(check_fn(answer, gold_text))))
        except Exception as e:
          results.append(("error", type(e).__name__))
      future.set_result(finish(results))
      return future
    return self._pool.submit(keys, cfg.timeout_s, finish)

  def close(self) -> None:
    self._closer()

  def __enter__(self) -> RewardScorer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def _close_pool(pool: CheckPool | None) -> None:
  if pool is not None:
    pool.close()


# ----------------------------------------------------------------------------
# pass@k


def pass_at_k(n, c, k: int):
  """Unbiased pass@k, 1 - C(n-c, k) / C(n, k), per problem.

  `n` samples of which `c` are correct (scalars or broadcastable arrays).
  Computed as 1 - prod_{i=n-c+1}^{n} (1 - k / i), which never forms a
  binomial coefficient. Returns a float for scalar input, else an array.
  """
  n_arr, c_arr = np.asarray(n), np.asarray(c)  # counts; float counts must be whole
  for name, arr in (("n", n_arr), ("c", c_arr)):
    if not np.issubdtype(arr.dtype, np.integer) and not np.all(np.abs(arr - np.rint(arr)) < 1e-6):
      raise ValueError(f"pass_at_k: {name} must be whole numbers")
  n_arr, c_arr = np.broadcast_arrays(np.rint(n_arr).astype(np.int64),
                                     np.rint(c_arr).astype(np.int64))
  k = int(k)
  if k < 1:
    raise ValueError(f"pass_at_k: k must be >= 1, got {k}")
  if np.any(c_arr < 0) or np.any(c_arr > n_arr):
    raise ValueError("pass_at_k: need 0 <= c <= n")
  if np.any(n_arr < k):
    raise ValueError(f"pass_at_k: k={k} exceeds the number of samples n={int(n_arr.min())}")
  scalar = n_arr.ndim == 0
  n_flat, c_flat = n_arr.reshape(-1), c_arr.reshape(-1)
  out = np.ones(n_flat.shape, np.float64)
  if n_flat.size:
    i = np.arange(1, int(n_flat.max()) + 1, dtype=np.float64)[None, :]
    use = (i > (n_flat - c_flat)[:, None]) & (i <= n_flat[:, None])
    factors = np.where(use, 1.0 - k / np.maximum(i, 1.0), 1.0)
    surely = (n_flat - c_flat) < k  # every k-subset holds a correct sample
    out = np.where(surely, 1.0, 1.0 - np.prod(factors, axis=1))
  out = out.reshape(n_arr.shape)
  return float(out) if scalar else out
