"""The data shipped with the package, by name, and rows from Hugging Face data sets.

`epgrpo_jax/datasets/` holds gzipped copies of the five evaluation benchmarks
(`benchmarks/`, read through `epgrpo_jax.data.evalsets`) and of the training
problems of the paper configs (`train/`); its README gives each file's source,
licence and derivation. A training set is named here (`TRAIN_SETS`); a
benchmark by its `epgrpo_jax.data.evalsets` name. Config fields and command-line
flags that take data accept such a name as well as a path.

A Hugging Face dataset id (`OWNER/NAME`, optionally `:SPLIT`, optionally
prefixed `hf:`) is read with the optional `datasets` library
(`pip install 'epgrpo-jax[datasets]'`); a folder written by
`datasets.Dataset.save_to_disk` is read by `epgrpo_jax.io.records.read_rows`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from pathlib import Path
from typing import Any

from epgrpo_jax.io.paths import expand_home

DATA_DIR = Path(__file__).resolve().parents[1] / "datasets"
DATASETS_HINT = "pip install 'epgrpo-jax[datasets]'"


@dataclasses.dataclass(frozen=True)
class TrainSet:
  """A shipped training set: its file (relative to `DATA_DIR`) and field names."""

  name: str
  file: str
  problem_field: str
  answer_field: str
  rows: int

  @property
  def path(self) -> Path:
    return DATA_DIR / self.file


TRAIN_SETS: dict[str, TrainSet] = {
    # The SimpleRL-Zoo "MATH level 3-5" problems, the paper configs' stand-in for the
    # paper's (unpublished) 8,000 Skywork-OR1 problems.
    "simplelr_math_l3to5": TrainSet(
        "simplelr_math_l3to5", "train/simplelr_qwen_level3to5_train.derived.jsonl.gz",
        "question", "answer", 8523),
}
TRAIN_ALIASES = {"simplelr_qwen_level3to5": "simplelr_math_l3to5"}


def train_set(name: str) -> TrainSet | None:
  """The shipped training set called `name` (case-insensitive; aliases too), or None."""
  key = name.strip().lower()
  return TRAIN_SETS.get(TRAIN_ALIASES.get(key, key))


# ----------------------------------------------------------------------------
# Hugging Face


HF_PREFIX = "hf:"
_HF_ID = re.compile(r"^([A-Za-z0-9][\w.-]*/[\w.-]+)(?::([\w.-]+))?$")
_FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".gz", ".xz", ".csv", ".txt", ".yaml")


def has_datasets() -> bool:
  """Whether the optional `datasets` library is installed."""
  return importlib.util.find_spec("datasets") is not None


def hf_reference(value: str) -> tuple[str, str | None] | None:
  """(dataset id, split or None) of `hf:OWNER/NAME[:SPLIT]`, or of a bare `OWNER/NAME[:SPLIT]`
  that does not end like a file name; None for anything else."""
  text = value.strip()
  explicit = text.startswith(HF_PREFIX)
  text = text[len(HF_PREFIX):] if explicit else text
  m = _HF_ID.match(text)
  if m is None or (not explicit and m.group(1).lower().endswith(_FILE_SUFFIXES)):
    return None
  return m.group(1), m.group(2)


def hf_rows(dataset_id: str, split: str) -> list[dict[str, Any]]:
  """The rows of split `split` of the Hugging Face dataset `dataset_id` (may download)."""
  if not has_datasets():
    raise ModuleNotFoundError(f"{dataset_id}: reading a Hugging Face dataset needs the optional "
                              f"`datasets` library ({DATASETS_HINT})")
  import datasets  # optional dependency (checked above)
  return list(datasets.load_dataset(dataset_id, split=split))


def cache_dir() -> Path:
  """Where built data (the embedded task, its warm start) is cached: $EPGRPO_DATA_DIR, else
  ~/.cache/epgrpo_jax."""
  env = os.environ.get("EPGRPO_DATA_DIR")
  return Path(expand_home(env)) if env else Path.home() / ".cache" / "epgrpo_jax"
