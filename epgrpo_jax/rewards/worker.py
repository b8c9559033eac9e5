"""The reward worker process: checks (answer, gold) pairs sent by `pool.CheckPool`.

A worker is a plain `python -I` subprocess (exec'd, never forked from the
multithreaded JAX parent) whose boot (`pool._BOOT`) loads the parent's copy of
`epgrpo_jax` by path and imports this module, so it never imports the trainer's
main module or JAX (a test checks that): only `epgrpo_jax.rewards` (numpy and the
standard library), `io.errors`, and math-verify once it checks.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
from multiprocessing.connection import Connection

from epgrpo_jax.rewards.verify import DEFAULT_CHECKER, _resolve_checker, verify_prepared


def main(argv: list[str]) -> None:
  """Entry point of a worker process: answer (id, answer, gold) messages."""
  fd, mem_mb, checker, paths = int(argv[0]), int(argv[1]), argv[2], json.loads(argv[3])
  parent_pid = int(argv[4])
  sys.path.extend(p for p in paths if p not in sys.path)
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
  try:  # die with the dispatcher thread that started us (Linux)
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
  except Exception:
    pass
  if os.getppid() != parent_pid:
    return
  if mem_mb > 0:
    try:
      import resource  # POSIX only (ImportError below): the package itself imports anywhere
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
