"""Shared command-line behaviour: one-line errors, exit codes, logging."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Callable

from epgrpo_jax.io.errors import RunError, UserError


USAGE_ERROR = 2


class ArgumentParser(argparse.ArgumentParser):
  """argparse whose usage errors are one line on stderr and exit 2."""

  def error(self, message: str):
    print(f"{self.prog}: error: {message}", file=sys.stderr)
    sys.exit(USAGE_ERROR)


def setup_logging(debug: bool = False) -> None:
  logging.basicConfig(level=logging.DEBUG if debug else logging.INFO,
                      format="%(asctime)s %(name)s %(levelname)s %(message)s", datefmt="%H:%M:%S", force=True)
  for noisy in ("absl", "jax._src", "orbax", "urllib3", "httpx", "transformers"):
    logging.getLogger(noisy).setLevel(logging.DEBUG if debug else logging.WARNING)


def enable_compilation_cache() -> None:
  """Persists compiled XLA programs across runs (a resumed or repeated run skips compiling).

  The directory is `$EPGRPO_COMPILATION_CACHE` (default ~/.cache/epgrpo_jax/xla); set it to
  an empty string to disable.
  """
  path = os.environ.get("EPGRPO_COMPILATION_CACHE",
                        str(Path.home() / ".cache" / "epgrpo_jax" / "xla"))
  if not path:
    return
  import jax  # every command and tool imports this module; JAX only where a command runs
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def run_main(fn: Callable[[], int], *, debug: bool = False) -> int:
  """Runs `fn` with the exit codes of `epgrpo_jax.io.errors`.

  A `UserError` (bad config, file, path or flag) is one line on stderr and exit 2; a `RunError`
  (a documented reason to stop) one line and exit 1; Ctrl-C exit 130. Anything else is a bug
  and propagates with its traceback (exit 1). `debug` adds the traceback to the one-liners.
  """
  try:
    return fn()
  except (UserError, RunError) as e:
    if debug:
      traceback.print_exc()
    if isinstance(e, UserError):
      print(f"error: {one_line(e)}", file=sys.stderr)
      return USAGE_ERROR
    print(f"error: {type(e).__name__}: {one_line(e)} (run with --debug for the traceback)",
          file=sys.stderr)
    return 1
  except KeyboardInterrupt:
    print("interrupted", file=sys.stderr)
    return 130


def one_line(e: BaseException) -> str:
  text = str(e).strip() or type(e).__name__
  return text.splitlines()[0]
