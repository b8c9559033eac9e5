"""Reading rows from JSON Lines, JSON-array and Parquet files.

Bad JSON Lines lines (not UTF-8, not JSON; e.g. the truncated last line of a
killed run) are skipped, counted by reason and logged with their line number.
"""

from __future__ import annotations

import collections
import json
import logging
from pathlib import Path
from typing import Any

from epgrpo_jax.errors import MissingFileError, UserError

log = logging.getLogger("epgrpo_jax.rows")
UTF8_BOM = b"\xef\xbb\xbf"  # some editors start UTF-8 files with it; it is not part of the data


def jsonl_rows(path: str | Path, raw: bytes | None = None,
               skipped: collections.Counter | None = None) -> list[Any]:
  """The records of a JSON Lines file (`raw`: its bytes, when already read); skipped lines
  are counted in `skipped` as "not_utf8" or "bad_json"."""
  raw = (Path(path).read_bytes() if raw is None else raw).removeprefix(UTF8_BOM)
  skipped = collections.Counter() if skipped is None else skipped
  rows = []
  for lineno, line in enumerate(raw.split(b"\n"), 1):
    if not line.strip():
      continue
    try:
      rows.append(json.loads(line.decode("utf-8")))
    except UnicodeDecodeError:
      skipped["not_utf8"] += 1
      log.warning("%s:%d: skipped (not UTF-8)", path, lineno)
    except json.JSONDecodeError:
      skipped["bad_json"] += 1
      log.warning("%s:%d: skipped (invalid JSON)", path, lineno)
  return rows


def json_array_rows(path: str | Path, raw: bytes) -> list:
  """The rows of a JSON file: a top-level array, or the one list of a {"data": [...]} object."""
  try:
    data = json.loads(raw.removeprefix(UTF8_BOM).decode("utf-8"))
  except UnicodeDecodeError:
    raise UserError(f"{path}: not UTF-8") from None
  except json.JSONDecodeError as e:
    raise UserError(f"{path}: invalid JSON ({e.msg} at line {e.lineno})") from None
  if isinstance(data, dict):  # {"data": [...]} or {"rows": [...]}
    lists = [v for v in data.values() if isinstance(v, list)]
    data = lists[0] if len(lists) == 1 else None
  if not isinstance(data, list):
    raise UserError(f"{path}: expected a JSON array of rows")
  return data


def read_rows(path: str | Path, skipped: collections.Counter | None = None) -> list[Any]:
  """Rows of a JSONL, JSON-array (`.json`, or content starting with "[") or Parquet file;
  bad JSONL lines are counted in `skipped`."""
  path = Path(path)
  if not path.is_file():
    raise MissingFileError(f"{path}: file not found")
  if path.suffix.lower() == ".parquet":
    import pyarrow.parquet as pq
    try:
      return pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises several types
      raise UserError(f"{path}: unreadable Parquet file ({type(e).__name__}: {e})") from None
  raw = path.read_bytes()
  if path.suffix.lower() == ".json" or raw.removeprefix(UTF8_BOM).lstrip().startswith(b"["):
    return json_array_rows(path, raw)
  return jsonl_rows(path, raw, skipped)
