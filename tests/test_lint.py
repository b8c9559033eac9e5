"""Static checks of the whole repository (the rules are in pyproject.toml, [tool.ruff])."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
  proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", "."],
                        cwd=REPO, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stdout + proc.stderr
