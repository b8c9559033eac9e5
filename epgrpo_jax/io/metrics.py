"""Run logging: metrics to JSONL and TensorBoard, progress bars, only on process 0.

Also the small readers the plots, tests and notebooks use: `read_metrics`
(metrics.jsonl), `read_tensorboard_scalars` (event files, without TensorFlow or
TensorBoard) and `token_strings` (one display string per generated token).
"""

from __future__ import annotations

import codecs
import json
import logging
import math
import re
import struct
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
from tqdm.auto import tqdm

from epgrpo_jax.io.atomic import keep_jsonl_records, open_for_append, write_text_atomic
from epgrpo_jax.io.records import jsonl_rows

log = logging.getLogger("epgrpo_jax")

# Metric names shown in the progress bar (short label -> key).
PROGRESS_KEYS = {"reward": "reward", "kl": "kl", "tok/s": "tokens_per_second"}
_TB_INVALID = re.compile(r"[^-/\w.]")


def to_float(v: Any) -> float:
  return float(np.asarray(v))


def tb_tag(key: str) -> str:
  """The TensorBoard tag of a metric key: `pass@4` -> `pass_at_4`, other odd characters -> `_`."""
  return _TB_INVALID.sub("_", key.replace("@", "_at_")).lstrip("/")


class MetricsWriter:
  """Appends one JSON object per step to `metrics.jsonl` and TensorBoard scalars.

  Non-finite values are written to the JSONL as strings ("nan", "inf") so the
  file stays valid JSON; TensorBoard tags go through `tb_tag`.
  """

  def __init__(self, run_dir: str | Path, *, enabled: bool = True, tensorboard: bool = True,
               wandb_project: str = "", config: dict | None = None):
    self.run_dir = Path(run_dir)
    self.enabled = enabled
    self._tb = self._wandb = None
    if not enabled:
      return
    self.run_dir.mkdir(parents=True, exist_ok=True)
    self._jsonl = None  # opened at the first record, after `resume_from`
    if tensorboard:
      from tensorboardX import SummaryWriter  # 1.5 s to import; only runs that log to TensorBoard
      self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), flush_secs=10)
    if wandb_project:
      try:
        import wandb  # optional dependency
      except ImportError:
        log.warning("logging.wandb_project is set but wandb is not installed; skipping W&B")
      else:
        self._wandb = wandb.init(project=wandb_project, dir=str(self.run_dir), config=config)

  def write(self, step: int, metrics: dict[str, Any], prefix: str = "") -> None:
    if not self.enabled:
      return
    values = {prefix + k: to_float(v) for k, v in metrics.items()}
    record = {"step": step, **{k: (v if math.isfinite(v) else str(v)) for k, v in values.items()}}
    if self._jsonl is None:
      self._jsonl = open_for_append(self.run_dir / "metrics.jsonl")
    self._jsonl.write(json.dumps(record) + "\n")
    if self._tb is not None:
      for k, v in values.items():
        self._tb.add_scalar(tb_tag(k), v, step)
    if self._wandb is not None:
      self._wandb.log(values, step=step)

  def resume_from(self, step: int, names: Iterable[str]) -> None:
    """Before a (re)started run writes: each JSON Lines output in `names` keeps only its records
    of steps <= `step` (the restored checkpoint's; -1 on a fresh start) and lines that parse.
    Later steps are computed again, so their earlier records would appear twice."""
    if not self.enabled:
      return
    assert self._jsonl is None, "resume_from must come before the first record"
    for name in names:
      dropped = keep_jsonl_records(self.run_dir / name, lambda r: _step_of(r) <= step)
      if dropped:
        log.warning("%s: dropped %d line(s) of steps after %d (computed again) or cut off by an "
                    "interrupted write", self.run_dir / name, dropped, step)

  def write_json(self, name: str, obj: Any) -> None:
    if self.enabled:
      write_text_atomic(self.run_dir / name, json.dumps(obj, indent=2) + "\n")

  def append_jsonl(self, name: str, records: Iterable[dict]) -> None:
    if self.enabled:
      with open_for_append(self.run_dir / name) as f:
        for r in records:
          f.write(json.dumps(r, ensure_ascii=False) + "\n")

  def flush(self) -> None:
    if self.enabled:
      if self._jsonl is not None:
        self._jsonl.flush()
      if self._tb is not None:
        self._tb.flush()

  def close(self) -> None:
    if not self.enabled:
      return
    if self._jsonl is not None:
      self._jsonl.close()
    if self._tb is not None:
      self._tb.close()
    if self._wandb is not None:
      self._wandb.finish()


def _step_of(record: Any) -> float:
  """A record's step; a record without one belongs to no step (it is kept)."""
  step = record.get("step") if isinstance(record, dict) else None
  return step if isinstance(step, int) and not isinstance(step, bool) else -math.inf


class Progress:
  """A tqdm bar on a terminal; plain log lines elsewhere (files, notebooks, CI).

  `update(values, n, tokens=k)` advances by `n` and shows `values` (kept until
  replaced) and, when `tokens` are counted, the token rate `tok/s`. On a
  terminal tqdm adds the ETA; otherwise a line `desc n/total k=v ... eta=M:SS`
  is printed on the first update, every `every` updates, at least every
  `interval_s` seconds, and at the end. `plain=False` prints no such lines
  (for loops that log their own) but still draws the bar on a terminal.
  """

  def __init__(self, total: int, desc: str, *, initial: int = 0, enabled: bool = True,
               every: int = 10, interval_s: float = 60.0, plain: bool = True, stream=None):
    self.total, self.desc, self.n = total, desc, initial
    self.enabled, self.every, self.interval_s, self.plain = enabled, max(1, every), interval_s, plain
    self.stream = stream or sys.stderr
    self.start = self._last_line = time.perf_counter()
    self.start_n = initial
    self.values: dict[str, float] = {}
    self.tokens = 0
    self._bar = None
    if enabled and _isatty(self.stream):
      self._bar = tqdm(total=total, initial=initial, desc=desc, file=self.stream,
                       dynamic_ncols=True)

  @property
  def elapsed(self) -> float:
    return time.perf_counter() - self.start

  @property
  def eta(self) -> float:
    """Seconds left at the mean rate since the start (inf before the first update)."""
    rate = (self.n - self.start_n) / max(self.elapsed, 1e-9)
    return (self.total - self.n) / rate if rate > 0 else float("inf")

  def eta_str(self) -> str:
    return _fmt_time(self.eta)

  def update(self, values: dict[str, float] | None = None, n: int = 1, *,
             tokens: int | None = None) -> None:
    self.n += n
    if values:
      self.values.update(values)
    if tokens is not None:
      self.tokens += tokens
      self.values["tok/s"] = self.tokens / max(self.elapsed, 1e-9)
    if not self.enabled:
      return
    shown = {k: _fmt_value(v) for k, v in self.values.items()}
    if self._bar is not None:
      if values or tokens is not None:
        self._bar.set_postfix(shown, refresh=False)
      self._bar.update(n)
      return
    now = time.perf_counter()
    due = (self.n - self.start_n == n or self.n % self.every == 0 or self.n >= self.total
           or now - self._last_line >= self.interval_s)
    if self.plain and due:
      self._last_line = now
      items = "".join(f" {k}={v}" for k, v in shown.items())
      print(f"{self.desc} {self.n}/{self.total}{items} elapsed={_fmt_time(self.elapsed)} "
            f"eta={self.eta_str()}", file=self.stream, flush=True)

  def write(self, line: str) -> None:
    """A line to the progress stream, above the bar on a terminal."""
    if not self.enabled:
      return
    if self._bar is not None:
      self._bar.write(line)
    else:
      print(line, file=self.stream, flush=True)

  def print(self, *args: Any, file=None, flush: bool = True, **kw: Any) -> None:
    """`print`, but above the bar when one is drawn (so the bar is not broken)."""
    if self._bar is not None:
      self._bar.write(" ".join(str(a) for a in args), file=file or sys.stdout)
    else:
      print(*args, file=file, flush=flush, **kw)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
      self._bar = None


def _isatty(stream) -> bool:
  try:
    return bool(stream.isatty())
  except (AttributeError, ValueError):
    return False


def _fmt_value(v: Any) -> str:
  try:
    return f"{float(v):.4g}"
  except (TypeError, ValueError):
    return str(v)


def _fmt_time(seconds: float) -> str:
  if not math.isfinite(seconds):
    return "?"
  m, s = divmod(int(seconds), 60)
  h, m = divmod(m, 60)
  return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


# ----------------------------------------------------------------------------
# Readers


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
  """The records of RUN_DIR/metrics.jsonl, non-finite strings turned back into floats.

  Training steps and held-out evaluations are separate records (the latter
  have `heldout/*` keys). A truncated last line (a killed run) is skipped with a warning.
  """
  out = []
  for rec in jsonl_rows(Path(run_dir) / "metrics.jsonl"):
    for k, v in rec.items():
      if isinstance(v, str) and v.lower() in ("nan", "inf", "-inf"):
        rec[k] = float(v)
    out.append(rec)
  return out


def _tfrecords(path: Path) -> Iterable[bytes]:
  """The payloads of a TFRecord file (length, crc, data, crc); stops at a truncated record."""
  with open(path, "rb") as f:
    while True:
      header = f.read(12)
      if len(header) < 12:
        return
      (length,) = struct.unpack("<Q", header[:8])
      data = f.read(length)
      if len(data) < length or len(f.read(4)) < 4:
        return
      yield data


def read_tensorboard_scalars(path: str | Path) -> dict[str, list[tuple[int, float]]]:
  """tag -> [(step, value)] of every scalar in the event files under `path` (or one file)."""
  from tensorboardX.proto import event_pb2  # 1.5 s to import (see MetricsWriter)

  path = Path(path)
  files = sorted(path.rglob("events.out.tfevents.*")) if path.is_dir() else [path]
  out: dict[str, list[tuple[int, float]]] = {}
  for f in files:
    for payload in _tfrecords(f):
      event = event_pb2.Event.FromString(payload)
      if not event.HasField("summary"):
        continue
      for v in event.summary.value:
        if v.HasField("simple_value"):
          out.setdefault(v.tag, []).append((int(event.step), float(v.simple_value)))
  return out


# ----------------------------------------------------------------------------
# Token display strings


def _byte_decoder() -> dict[str, int]:
  """GPT-2 / Qwen byte-level BPE: the printable character that stands for each byte."""
  bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
      list(range(ord("®"), ord("ÿ") + 1))
  cs = bs[:]
  extra = 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + extra)
      extra += 1
  return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_DECODER = _byte_decoder()


def token_strings(tokenizer, ids: Sequence[int]) -> list[str]:
  """One string per token id whose concatenation is the decoded text.

  Byte-level BPE pieces are turned back into bytes and decoded incrementally,
  so a character split over two tokens shows on the token that completes it
  (the first gets ""). Special tokens keep their text (e.g. `<|im_end|>`);
  other tokenizers fall back to decoding each id alone.
  """
  ids = [int(i) for i in ids]
  pieces = tokenizer.convert_ids_to_tokens(ids)
  special = set(getattr(tokenizer, "all_special_ids", ()) or ())
  decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
  out = []
  for i, piece in zip(ids, pieces):
    raw = None
    if piece is not None and i not in special and all(c in _BYTE_DECODER for c in piece):
      raw = bytes(_BYTE_DECODER[c] for c in piece)
    if raw is None:
      pending = decoder.decode(b"", final=True)
      decoder.reset()
      text = piece if (i in special and piece is not None) else tokenizer.decode([i])
      out.append(pending + text)
    else:
      out.append(decoder.decode(raw))
  if out:
    out[-1] += decoder.decode(b"", final=True)
  return out
