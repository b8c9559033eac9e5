"""Files that are either complete or absent: write to a temporary name, then rename."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

from epgrpo_jax.io.errors import UserError


def write_text_atomic(path: str | Path, text: str) -> Path:
  """Writes `text` to `path` so that a reader (or a crash) never sees half a file."""
  path = Path(path)
  tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
  try:
    with open(tmp, "w", encoding="utf-8") as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  finally:
    tmp.unlink(missing_ok=True)
  return path


def open_for_append(path: str | Path):
  """Opens a line-oriented file for appending; a last line cut off by a crash is ended first,
  so the next record starts on a line of its own instead of being glued onto the broken one."""
  path = Path(path)
  if path.exists() and path.stat().st_size:
    with open(path, "rb") as f:
      f.seek(-1, os.SEEK_END)
      cut = f.read(1) != b"\n"
    if cut:
      with open(path, "a", encoding="utf-8") as f:
        f.write("\n")
  return open(path, "a", buffering=1, encoding="utf-8")


def check_output_paths(root: str | Path, field: str, *, dirs: Iterable[str] = (),
                       files: Iterable[str] = ()) -> None:
  """Raises a one-line error naming `field` if an output under `root` is of the wrong kind: one
  of `dirs` that exists and is not a directory, or one of `files` that is a directory. Run
  before any work, so that a run does not fail at its end, when it writes them."""
  root = Path(root)
  for name in dirs:
    if (root / name).exists() and not (root / name).is_dir():
      raise UserError(f"{field}: {root / name} exists and is not a directory (it is written as "
                      f"one); move it away")
  for name in files:
    if (root / name).is_dir():
      raise UserError(f"{field}: {root / name} is a directory (it is written as a file); move "
                      f"it away")
