"""benchmarks/gpu.sh --dry-run: the GPU script's programs, at tiny shapes on CPU, all run."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                    reason="needs bash and coreutils timeout")
def test_gpu_script_dry_run(tmp_path):
  out = tmp_path / "figures.txt"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device, as on a GPU
  proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu.sh"), "--dry-run", "--out", str(out)],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  text = out.read_text()
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "FAILED" not in text, text[-4000:]
  for figure in ("tokens/s", "update / loss+backward+optimizer", "MFU", "blockwise", "plain"):
    assert figure in text, f"{figure!r} missing from the dry run's figures:\n{text[-4000:]}"
