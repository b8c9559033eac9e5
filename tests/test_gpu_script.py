"""benchmarks/gpu.sh --dry-run: the GPU script's programs, at tiny shapes on CPU, all run."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                    reason="needs bash and coreutils timeout")
def test_gpu_script_dry_run(tmp_path):
  out = tmp_path / "figures.txt"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device, as on a GPU
  # The suite's interpreter need not be the first `python` on PATH (a venv run without
  # activating it): here that one fails, and the script must run every part under $PYTHON.
  (tmp_path / "bin").mkdir()
  (tmp_path / "bin" / "python").write_text("#!/bin/sh\necho 'not the interpreter of the tests' >&2\nexit 3\n")
  (tmp_path / "bin" / "python").chmod(0o755)
  env.update(PYTHON=sys.executable, PATH=f"{tmp_path / 'bin'}{os.pathsep}{env.get('PATH', '')}")
  proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu.sh"), "--dry-run", "--out", str(out)],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  text = out.read_text()
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "FAILED" not in text, text[-4000:]
  for figure in ("tokens/s", "update / loss+backward+optimizer", "MFU", "blockwise", "plain",
                 "model FLOPs", "profiled step, device op time", "attention", "lm_head",
                 "compiled footprint", "useful-slot fraction", "compiled while timed: 0",
                 "decode attention: ", "valid-slot reads: prompts", "--profile",
                 "profile continuous: ", "device op time per decode step", "cache_write",
                 "1 device: k=1 / k=0 = "):
    assert figure in text, f"{figure!r} missing from the dry run's figures:\n{text[-4000:]}"
  for side in ("static", "continuous"):  # the decode step's parts found by their name scopes
    line = re.search(rf"profile {side}: .*per decode step.*", text)
    assert line and not re.search(r"(attention|projections) 0\.000 ms", line.group(0)), text[-4000:]


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                    reason="needs bash and coreutils timeout")
def test_gpu_script_runs_only_the_parts_asked_for(tmp_path):
  # A device call is limited to 10 minutes: --parts runs a subset (here the attention part alone).
  out = tmp_path / "figures.txt"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(PYTHON=sys.executable)
  proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu.sh"), "--dry-run", "--parts", "3",
                         "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  text = out.read_text()
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  ran = re.findall(r"^=== \S+ (\S+\.py)", text, flags=re.M)
  assert ran == ["attention.py"], text[-3000:]
  bad = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu.sh"), "--dry-run", "--parts", "3,7",
                        "--out", str(tmp_path / "bad.txt")], cwd=ROOT, env=env, capture_output=True, text=True)
  assert bad.returncode == 2 and "--parts" in bad.stderr and not (tmp_path / "bad.txt").exists()


def test_scripts_start_the_interpreter_they_were_started_from():
  """No bare `python` in what tests and benchmarks launch: Python code passes sys.executable,
  shell scripts go through $PYTHON (whose default is the `python` on PATH)."""
  bare = []
  for path in sorted([*ROOT.glob("tests/*.py"), *ROOT.glob("benchmarks/*.py"), *ROOT.glob("epgrpo_jax/**/*.py")]):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.List) and node.elts and isinstance(node.elts[0], ast.Constant) \
          and node.elts[0].value in ("python", "python3"):
        bare.append(f"{path.relative_to(ROOT)}:{node.lineno}")
  for path in sorted(ROOT.glob("benchmarks/*.sh")):
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
      code = line.split("#")[0]
      if re.search(r"(?<![-\w/.$\"])(?<!-m )(python3?|pip)(?=\s|$)", code):
        bare.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}")
  assert not bare, bare
