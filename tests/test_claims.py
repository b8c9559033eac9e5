"""Claims of the README that are about the project itself: exit codes, test profiles."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

from hypothesis import settings

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def test_hypothesis_example_counts_come_from_the_profile_alone():
  # A test may scale the profile's count (settings.default.max_examples // n), never fix its own.
  assert settings.get_profile("ci").max_examples == 500
  assert settings.get_profile("dev").max_examples == 50
  pinned = []
  for path in sorted(TESTS.glob("test_*.py")):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "settings":
        pinned += [f"{path.name}:{node.lineno}" for kw in node.keywords
                   if kw.arg == "max_examples" and isinstance(kw.value, ast.Constant)]
  assert not pinned, pinned


def _run_main_with(raise_stmt: str) -> subprocess.CompletedProcess:
  code = ("import sys\nfrom epgrpo_jax.io import commandline as cli, errors\n"
          f"def fn():\n  {raise_stmt}\n"
          "sys.exit(cli.run_main(fn))\n")
  return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                        timeout=60, env=dict(os.environ))


def test_a_bug_exits_1_with_its_traceback():
  # Exceptions a bug raises deep in our code or a library, of the types user errors once shared.
  for stmt in ("raise ValueError('shapes (3,) and (4,) do not broadcast')",
               "raise FileNotFoundError('/tmp/orbax-internal/_METADATA')",
               "raise KeyError('trainable')"):
    proc = _run_main_with(stmt)
    assert proc.returncode == 1, (stmt, proc.stderr)
    assert "Traceback (most recent call last)" in proc.stderr, stmt
    # The traceback is the raised bug's own (not, say, an import failing before it).
    assert proc.stderr.splitlines()[-1].startswith(stmt.split()[1].split("(")[0] + ":"), proc.stderr


def test_user_and_run_errors_are_one_line():
  proc = _run_main_with("raise errors.UserError('train.steps: must be > 0, got 0')")
  assert (proc.returncode, proc.stderr) == (2, "error: train.steps: must be > 0, got 0\n")
  proc = _run_main_with("raise errors.MissingFileError('/data/x.jsonl: file not found')")
  assert (proc.returncode, proc.stderr) == (2, "error: /data/x.jsonl: file not found\n")
  proc = _run_main_with("raise errors.RunError('3 consecutive non-finite updates')")
  assert proc.returncode == 1 and "Traceback" not in proc.stderr
  assert proc.stderr.startswith("error: RunError: 3 consecutive non-finite updates")
