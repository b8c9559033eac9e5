"""RewardScorer (batched scoring on the worker pool), check (one answer), and the formulas on
scored batches: DAPO's overlong penalty and pass@k."""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
import weakref
from typing import Any, Callable, Sequence

import numpy as np

from epgrpo_jax.rewards.answers import Gold, _decide, extract_answer, light_normalise, parse_gold, prepare
from epgrpo_jax.rewards.config import _DEFAULT_CFG, RewardConfig, RewardResult
from epgrpo_jax.rewards.custom import custom_rewards, resolve_reward_function
from epgrpo_jax.rewards.pool import CheckPool
from epgrpo_jax.rewards.verify import DEFAULT_CHECKER, _checker_spec, _resolve_checker, verify_prepared


# ----------------------------------------------------------------------------
# Single checks


_SHARED_POOL: CheckPool | None = None
_SHARED_LOCK = threading.Lock()


def _shared_pool() -> CheckPool:
  global _SHARED_POOL
  with _SHARED_LOCK:
    if _SHARED_POOL is None or _SHARED_POOL.broken or _SHARED_POOL.closed:
      _SHARED_POOL = CheckPool(1)
    return _SHARED_POOL


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
# DAPO's overlong penalty and pass@k


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
