"""CheckPool: worker processes that check (answer, gold) pairs, killed at their deadline.

math-verify's own timeouts use SIGALRM, which only works in the main thread and
cannot interrupt long C-level arithmetic (`2^{2^{2^{100}}}` hangs inside sympy
and CPython big-integer code). So checks run in worker processes
(`rewards.worker`) that a dispatcher thread kills and replaces when an item
uses up its CPU-time budget. Workers are plain `python -I` subprocesses (exec'd,
never forked from the multithreaded JAX parent) that import no JAX.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as _mp_wait
from typing import Any, Callable, Sequence

from epgrpo_jax.rewards.verify import DEFAULT_CHECKER

log = logging.getLogger("epgrpo_jax.rewards")


# The worker's boot: load `epgrpo_jax` from this very file's package by path (sys.argv[1], its
# directory), then import the worker module from it. Nothing depends on PYTHONPATH or an install,
# and `epgrpo_jax/__init__.py` and `rewards/__init__.py` import no JAX.
_BOOT = (
    "import importlib.util, os, sys\n"
    "spec = importlib.util.spec_from_file_location('epgrpo_jax', os.path.join(sys.argv[1], "
    "'__init__.py'), submodule_search_locations=[sys.argv[1]])\n"
    "mod = importlib.util.module_from_spec(spec)\n"
    "sys.modules[spec.name] = mod\n"
    "spec.loader.exec_module(mod)\n"
    "from epgrpo_jax.rewards.worker import main\n"
    "main(sys.argv[2:])\n")
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../epgrpo_jax


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

  @property
  def closed(self) -> bool:
    return self._closed

  # -- dispatcher thread

  def _wake(self):
    try:
      self._wake_w.send(b"x")
    except (BlockingIOError, OSError):
      pass

  def _spawn(self) -> None:
    parent, child = socket.socketpair()
    try:
      args = [sys.executable, "-I", "-c", _BOOT, _PACKAGE_DIR, str(child.fileno()),
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
