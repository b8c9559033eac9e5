"""Run logging: metrics to JSONL and TensorBoard, progress bars, only on process 0."""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any, Iterable

import numpy as np

log = logging.getLogger("epgrpo_jax")

# Metric names shown in the progress bar (short label -> key).
PROGRESS_KEYS = {"reward": "reward", "kl": "kl", "tok/s": "tokens_per_second"}


def to_float(v: Any) -> float:
  v = float(np.asarray(v))
  return v


class MetricsWriter:
  """Appends one JSON object per step to `metrics.jsonl` and TensorBoard scalars."""

  def __init__(self, run_dir: str | Path, *, enabled: bool = True, tensorboard: bool = True,
               wandb_project: str = "", config: dict | None = None):
    self.run_dir = Path(run_dir)
    self.enabled = enabled
    self._tb = self._wandb = None
    if not enabled:
      return
    self.run_dir.mkdir(parents=True, exist_ok=True)
    self._jsonl = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
    if tensorboard:
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), flush_secs=10)
    if wandb_project:
      try:
        import wandb
      except ImportError:
        log.warning("logging.wandb_project is set but wandb is not installed; skipping W&B")
      else:
        self._wandb = wandb.init(project=wandb_project, dir=str(self.run_dir), config=config)

  def write(self, step: int, metrics: dict[str, Any], prefix: str = "") -> None:
    if not self.enabled:
      return
    values = {prefix + k: to_float(v) for k, v in metrics.items()}
    record = {"step": step, **{k: (v if math.isfinite(v) else str(v)) for k, v in values.items()}}
    self._jsonl.write(json.dumps(record) + "\n")
    if self._tb is not None:
      for k, v in values.items():
        self._tb.add_scalar(k, v, step)
    if self._wandb is not None:
      self._wandb.log(values, step=step)

  def write_json(self, name: str, obj: Any) -> None:
    if self.enabled:
      (self.run_dir / name).write_text(json.dumps(obj, indent=2) + "\n")

  def append_jsonl(self, name: str, records: Iterable[dict]) -> None:
    if self.enabled:
      with open(self.run_dir / name, "a") as f:
        for r in records:
          f.write(json.dumps(r) + "\n")

  def close(self) -> None:
    if not self.enabled:
      return
    self._jsonl.close()
    if self._tb is not None:
      self._tb.close()
    if self._wandb is not None:
      self._wandb.finish()


class Progress:
  """A tqdm bar on a terminal, plain log lines every `every` updates elsewhere."""

  def __init__(self, total: int, desc: str, *, initial: int = 0, enabled: bool = True,
               every: int = 10, stream=None):
    self.total, self.desc, self.n = total, desc, initial
    self.enabled, self.every = enabled, max(1, every)
    self.stream = stream or sys.stderr
    self.start = time.perf_counter()
    self.start_n = initial
    self._bar = None
    if enabled and self.stream.isatty():
      from tqdm.auto import tqdm
      self._bar = tqdm(total=total, initial=initial, desc=desc, file=self.stream,
                       dynamic_ncols=True)

  def update(self, values: dict[str, float] | None = None, n: int = 1) -> None:
    self.n += n
    if not self.enabled:
      return
    shown = {k: f"{v:.4g}" for k, v in (values or {}).items()}
    if self._bar is not None:
      self._bar.set_postfix(shown, refresh=False)
      self._bar.update(n)
    elif self.n % self.every == 0 or self.n == self.total:
      elapsed = time.perf_counter() - self.start
      rate = (self.n - self.start_n) / max(elapsed, 1e-9)
      eta = (self.total - self.n) / rate if rate > 0 else float("inf")
      items = " ".join(f"{k}={v}" for k, v in shown.items())
      print(f"{self.desc} {self.n}/{self.total} {items} eta={_fmt_time(eta)}", file=self.stream,
            flush=True)

  def write(self, line: str) -> None:
    if not self.enabled:
      return
    if self._bar is not None:
      self._bar.write(line)
    else:
      print(line, file=self.stream, flush=True)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()


def _fmt_time(seconds: float) -> str:
  if not math.isfinite(seconds):
    return "?"
  m, s = divmod(int(seconds), 60)
  h, m = divmod(m, 60)
  return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"
