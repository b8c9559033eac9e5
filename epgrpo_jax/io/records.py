"""Reading rows from JSON Lines, JSON-array and Parquet files, and from data sets saved on disk.

JSON files may be compressed (`.gz`, `.xz`). A folder written by the optional
`datasets` library's `save_to_disk` is read with its `load_from_disk`.
Bad JSON Lines lines (not UTF-8, not JSON; e.g. the truncated last line of a
killed run) are skipped, counted by reason and logged with their line number.
"""

from __future__ import annotations

import codecs
import collections
import gzip
import json
import logging
import lzma
from pathlib import Path
from typing import Any, Mapping, Sequence

from epgrpo_jax.io import catalog
from epgrpo_jax.io.errors import MissingFileError, UserError

log = logging.getLogger("epgrpo_jax.io.records")

_DECOMPRESS = {".gz": gzip.decompress, ".xz": lzma.decompress}


def data_name(path: str | Path) -> str:
  """A file's name without a compression suffix ("a.jsonl.gz" -> "a.jsonl")."""
  path = Path(path)
  return path.stem if path.suffix.lower() in _DECOMPRESS else path.name


def data_stem(path: str | Path) -> str:
  """A file's name without its format and compression suffixes ("a.jsonl.gz" -> "a")."""
  return Path(data_name(path)).stem


def jsonl_rows(path: str | Path, raw: bytes | None = None,
               skipped: collections.Counter | None = None) -> list[Any]:
  """The records of a JSON Lines file (`raw`: its bytes, when already read); skipped lines
  are counted in `skipped` as "not_utf8" or "bad_json"."""
  # Some editors start UTF-8 files with a byte-order mark; it is not part of the data.
  raw = (Path(path).read_bytes() if raw is None else raw).removeprefix(codecs.BOM_UTF8)
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
    data = json.loads(raw.decode("utf-8"))
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


def check_saved_dataset(path: str | Path, what: str) -> None:
  """Raises a one-line `ValueError` (starting with `what`) unless `path` is a folder written by
  `datasets`' `save_to_disk` and the `datasets` library is installed to read it."""
  path = Path(path)
  if not ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file()):
    raise UserError(f"{what}: {path} is a folder, but not a data set saved with datasets' "
                     f"save_to_disk")
  if not catalog.has_datasets():
    raise UserError(f"{what}: reading the saved data set {path} needs the optional `datasets` "
                     f"library ({catalog.DATASETS_HINT})")


def saved_dataset_rows(path: str | Path, split: str | None = None) -> list[Any]:
  """Rows of a folder written by `datasets`' `save_to_disk`: a Dataset, or of a DatasetDict
  its split `split` (its only split when it has one and `split` is not among them)."""
  path = Path(path)
  check_saved_dataset(path, str(path))
  import datasets  # optional dependency (checked above)
  ds = datasets.load_from_disk(str(path))
  if isinstance(ds, datasets.DatasetDict):
    splits = list(ds)
    if split not in ds and len(splits) == 1:
      split = splits[0]
    if split not in ds:
      raise UserError(f"{path}: no split {split!r} (splits: {', '.join(splits)})")
    ds = ds[split]
  return list(ds)


def read_rows(path: str | Path, skipped: collections.Counter | None = None,
              split: str | None = None) -> list[Any]:
  """Rows of a JSONL, JSON-array (`.json`, or content starting with "[") or Parquet file, the
  JSON ones possibly gzip- or xz-compressed, or of a saved `datasets` folder (`split` picks a
  split of a DatasetDict); bad JSONL lines are counted in `skipped`."""
  path = Path(path)
  if path.is_dir():
    return saved_dataset_rows(path, split)
  if not path.is_file():
    raise MissingFileError(f"{path}: file not found")
  if path.suffix.lower() == ".parquet":
    import pyarrow.parquet as pq  # 0.3 s to import, only for Parquet files (records loads everywhere)
    try:
      return pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises several types
      raise UserError(f"{path}: unreadable Parquet file ({type(e).__name__}: {e})") from None
  raw = path.read_bytes()
  decompress = _DECOMPRESS.get(path.suffix.lower())
  if decompress is not None:
    try:
      raw = decompress(raw)
    except (OSError, EOFError, lzma.LZMAError) as e:
      raise UserError(f"{path}: unreadable {path.suffix} file ({e})") from None
  raw = raw.removeprefix(codecs.BOM_UTF8)
  if Path(data_name(path)).suffix.lower() == ".json" or raw.lstrip().startswith(b"["):
    return json_array_rows(path, raw)
  return jsonl_rows(path, raw, skipped)


def get_field(row: Any, dotted: str) -> Any:
  """`row['a'][0]['b']` for 'a.0.b' (a negative index counts from the end); None when any
  part is missing."""
  node = row
  for part in dotted.split("."):
    if isinstance(node, Mapping) and part in node:
      node = node[part]
    elif (isinstance(node, Sequence) and not isinstance(node, (str, bytes))
          and part.lstrip("-").isdigit() and -len(node) <= int(part) < len(node)):
      node = node[int(part)]
    else:
      return None
  return node
