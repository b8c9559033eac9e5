"""Files that are either complete or absent: write to a temporary name, then rename."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Iterable

from epgrpo_jax.io.errors import UserError

log = logging.getLogger("epgrpo_jax.io.atomic")


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
  """Opens a JSON Lines file for appending. A last line without its newline is a record cut off
  by a crash: it is removed (a whole JSON value there only gets its newline), so that every line
  parses and the next record starts on a line of its own."""
  path = Path(path)
  if path.exists() and path.stat().st_size:
    with open(path, "rb") as f:
      f.seek(-1, os.SEEK_END)
      whole = f.read(1) == b"\n"
    if not whole:  # rare: read the file once to find the last line
      raw = path.read_bytes()
      start = raw.rfind(b"\n") + 1
      if _parses(raw[start:]):
        with open(path, "ab") as f:
          f.write(b"\n")
      else:
        log.warning("%s: removed a last line cut off by an interrupted write (%d bytes)", path,
                    len(raw) - start)
        os.truncate(path, start)
  return open(path, "a", buffering=1, encoding="utf-8")


def keep_jsonl_records(path: str | Path, keep: Callable[[Any], bool]) -> int:
  """Rewrites a JSON Lines file (atomically) with only its lines that parse and satisfy `keep`;
  returns how many lines went. The file is left untouched when every line stays."""
  path = Path(path)
  if not path.is_file():
    return 0
  lines = path.read_bytes().split(b"\n")
  lines = lines[:-1] if lines and not lines[-1] else lines
  kept = [line for line in lines if _parses(line) and keep(json.loads(line))]
  if len(kept) < len(lines):
    write_text_atomic(path, "".join(line.decode("utf-8") + "\n" for line in kept))
  return len(lines) - len(kept)


def _parses(line: bytes) -> bool:
  try:
    json.loads(line.decode("utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError):
    return False
  return bool(line.strip())


def output_dir(path: str | Path, flag: str) -> Path:
  """Creates the directory a command writes to (`flag` names it); a path that exists and is not
  a directory, or cannot be created, is a one-line error naming the flag."""
  path = Path(path)
  if path.exists() and not path.is_dir():
    raise UserError(f"{flag} {path}: exists and is not a directory")
  try:
    path.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise UserError(f"{flag} {path}: cannot create ({e.strerror})") from None
  return path


def output_file(path: str | Path, flag: str) -> Path:
  """Checks a file a command will write (`flag` names it) and creates its directory: a path that
  is a directory, or whose directory cannot be made, is a one-line error naming the flag."""
  path = Path(path)
  if path.is_dir():
    raise UserError(f"{flag} {path}: is a directory; name the file to write")
  output_dir(path.parent, flag)
  return path


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
