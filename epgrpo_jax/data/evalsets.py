"""Evaluation benchmarks (MATH500, AMC23, Minerva Math, AIME24, AIME25): loading.

Each benchmark is read from a local JSONL (plain or gzipped), JSON-array or
Parquet file; the verl layout (`prompt[0].content`, `reward_model.ground_truth`)
is understood too. Where the rows come from, in order: an explicit `path` (a
file, a folder saved by `datasets`' `save_to_disk`, or a Hugging Face dataset
id, see `epgrpo_jax.io.catalog`); `<data_dir>/<file>` (or
`<data_dir>/benchmarks/<file>`, either also as `<file>.gz`); the same under
`$EPGRPO_DATA_DIR`; the copy shipped with the package (`epgrpo_jax/datasets`);
the benchmark's usual Hugging Face dataset when the `datasets` library is
installed and not offline; otherwise a one-line error saying what to pass.

Rows without a problem or an answer are skipped and counted (`LoadStats`,
logged as a warning), never dropped silently. Answers are kept as strings
("025" stays "025"; 27.0 becomes "27"); equivalence is the checker's job
(`epgrpo_jax.rewards`).

This is the evaluation *data* loader; the repository's top-level
`benchmarks/` folder holds speed scripts, which are unrelated.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import logging
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from epgrpo_jax.io import catalog
from epgrpo_jax.io.errors import MissingFileError, UserError
from epgrpo_jax.io.paths import expand_home
from epgrpo_jax.rewards import extract_boxed
from epgrpo_jax.io.records import get_field, read_rows

log = logging.getLogger("epgrpo_jax.data.evalsets")

DATA_DIR_ENV = "EPGRPO_DATA_DIR"


@dataclasses.dataclass(frozen=True)
class Problem:
  """One evaluation problem: a unique id, the problem text, the gold answer."""

  id: str
  problem: str
  answer: str
  meta: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False)


@dataclasses.dataclass
class LoadStats:
  """What a load read, kept and skipped (by reason)."""

  source: str = ""
  rows: int = 0
  loaded: int = 0
  skipped: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  repaired: int = 0  # rows whose control characters were turned back into LaTeX

  def summary(self) -> str:
    skips = ", ".join(f"{k}={v}" for k, v in sorted(self.skipped.items()) if v) or "none"
    return (f"{self.source}: {self.loaded}/{self.rows} rows loaded; skipped: {skips}; "
            f"repaired: {self.repaired}")


# ----------------------------------------------------------------------------
# Gold answers


_UNIT_TAIL = re.compile(r"\\(?:text|mathrm)\s*\{[^{}]*\}\s*$")


def minerva_answer(raw: str) -> str:
  """A Minerva gold answer cleaned for checking.

  The Qwen2.5-Math harness skips its unit-word list for minerva_math (single
  letters such as m, s, g are physics symbols there) and only drops a trailing
  `\\text{...}`; we do the same, plus: stray `$`, numpy spellings
  (`np.arcsin` -> `\\arcsin`), `\\exp{x}` -> `e^{x}` and `-1./3` -> `-1/3`.
  Python-style `4.5e33` is left to `rewards.prepare`.
  """
  s = re.sub(r"(?<!\\)\$", " ", raw.replace("\n", " "))
  s = re.sub(r"\bnp\.(?=[a-z])", r"\\", s)
  s = re.sub(r"\\exp\s*\{([^{}]*)\}", r"e^{\1}", s)
  s = re.sub(r"(\d)\.(?=\s*/)", r"\1", s)
  tail = _UNIT_TAIL.sub("", s).strip()
  if tail:
    s = tail
  return re.sub(r"\s+", " ", s).strip()


def answer_text(value: Any) -> str | None:
  """A gold answer as a string (27.0 -> "27"; None/empty -> None)."""
  if value is None or isinstance(value, bool):
    return None
  if isinstance(value, float):
    if value != value:  # NaN
      return None
    value = int(value) if value.is_integer() else value
  if isinstance(value, (list, tuple)):  # verl ground truths are sometimes lists
    if len(value) != 1:
      return None
    return answer_text(value[0])
  text = str(value).strip()
  return text or None


# ----------------------------------------------------------------------------
# Registry


@dataclasses.dataclass(frozen=True)
class BenchmarkSpec:
  """Where a benchmark lives and how its rows map to `Problem`s."""

  name: str
  file: str  # file name in a data dir (and, gzipped, in the package's datasets/benchmarks)
  hf: tuple[tuple[str, str], ...]  # usual Hugging Face (dataset id, split), first tried
  problem_fields: tuple[str, ...] = ("problem", "question", "prompt.0.content")
  answer_fields: tuple[str, ...] = ("answer", "reward_model.ground_truth")
  id_fields: tuple[str, ...] = ("id", "unique_id", "idx", "extra_info.id", "extra_info.index")
  solution_field: str = ""  # gold = last \boxed{} of this field when no answer field
  clean_answer: Callable[[str], str] | None = None
  repair_tabs: bool = False  # TAB+letter was a "\t..." LaTeX command (bad JSON escape)
  meta_fields: tuple[str, ...] = ()

  @property
  def expected(self) -> str:
    if self.solution_field:
      return (f"a JSONL with fields {self.problem_fields[0]}, {self.answer_fields[0]} "
              f"(or {self.solution_field} with a \\boxed{{}} answer)")
    return f"a JSONL with fields {self.problem_fields[0]}, {self.answer_fields[0]}"


# Hugging Face ids below are the usual ones, from memory; they are not checked
# here (no network). Local files take precedence.
BENCHMARKS: dict[str, BenchmarkSpec] = {
    "math500": BenchmarkSpec(
        "math500", "math500.jsonl", (("HuggingFaceH4/MATH-500", "test"),),
        meta_fields=("subject", "level")),
    "amc23": BenchmarkSpec("amc23", "amc23.jsonl", (("math-ai/amc23", "test"),)),
    "minerva": BenchmarkSpec(
        "minerva", "minerva_math.jsonl", (("math-ai/minervamath", "test"),),
        solution_field="solution", clean_answer=minerva_answer, meta_fields=("type",)),
    "aime24": BenchmarkSpec(
        "aime24", "aime24.jsonl", (("HuggingFaceH4/aime_2024", "train"), ("math-ai/aime24", "test"))),
    "aime25": BenchmarkSpec(
        "aime25", "aime25.jsonl", (("math-ai/aime25", "test"),), repair_tabs=True),
}
ALIASES = {"math_500": "math500", "math-500": "math500", "minerva_math": "minerva",
           "minervamath": "minerva", "amc": "amc23", "aime_2024": "aime24",
           "aime_2025": "aime25"}


def get_spec(name: str) -> BenchmarkSpec:
  key = name.strip().lower()
  key = ALIASES.get(key, key)
  if key not in BENCHMARKS:
    raise KeyError(f"benchmark {name!r}: unknown; known: {', '.join(BENCHMARKS)}")
  return BENCHMARKS[key]


def parse_benchmark_files(items: Iterable[str]) -> dict[str, str]:
  """['aime24=PATH', ...] (the --benchmark-file flag) -> {'aime24': 'PATH'}."""
  out = {}
  for item in items:
    name, sep, path = item.partition("=")
    if not sep or not name.strip() or not path.strip():
      raise UserError(f"--benchmark-file {item!r}: expected NAME=PATH, e.g. aime24=data/aime24.jsonl")
    out[get_spec(name).name] = expand_home(path.strip())
  return out


# ----------------------------------------------------------------------------
# Reading rows


# Bad JSON escapes turn "\frac" into FORM FEED + "rac" and "\binom" into
# BACKSPACE + "inom"; neither control character is ever real problem text.
_CONTROL_ESCAPES = {"\x0c": "\\f", "\x08": "\\b"}
_TAB_COMMAND = re.compile(r"\t(?=[a-zA-Z])")
_INSTRUCTION_TAIL = re.compile(
    r"\s*Let's think step by step and output the final answer within \\boxed\{\}\.?\s*$")


def _repair(text: str, tabs: bool) -> str:
  for bad, good in _CONTROL_ESCAPES.items():
    text = text.replace(bad, good)
  if tabs:
    text = _TAB_COMMAND.sub(r"\\t", text)
  return text


def _first(row: Any, fields: Sequence[str]) -> Any:
  for f in fields:
    value = get_field(row, f)
    if value is not None and not (isinstance(value, str) and not value.strip()):
      return value
  return None


def rows_to_problems(spec: BenchmarkSpec, rows: Iterable[Any],
                     stats: LoadStats | None = None, limit: int | None = None) -> list[Problem]:
  """`Problem`s of `rows` under `spec`, counting skipped rows in `stats`."""
  stats = stats if stats is not None else LoadStats(source=spec.name)
  problems: list[Problem] = []
  seen: set[str] = set()
  for index, row in enumerate(rows):
    if limit is not None and len(problems) >= limit:
      break
    stats.rows += 1
    if not isinstance(row, Mapping):
      stats.skipped["not_an_object"] += 1
      continue
    problem = _first(row, spec.problem_fields)
    if not isinstance(problem, str) or not problem.strip():
      stats.skipped["missing_problem"] += 1
      continue
    answer = answer_text(_first(row, spec.answer_fields))
    if answer is None and spec.solution_field:
      solution = get_field(row, spec.solution_field)
      answer = extract_boxed(solution) if isinstance(solution, str) else None
    if answer is not None and spec.clean_answer is not None:
      answer = spec.clean_answer(answer) or None
    if answer is None:
      stats.skipped["missing_answer"] += 1
      continue
    repaired = _repair(problem, spec.repair_tabs)
    stats.repaired += repaired != problem
    problem = _INSTRUCTION_TAIL.sub("", repaired).strip()
    pid = answer_text(_first(row, spec.id_fields)) or str(index)
    if pid in seen:
      pid = f"{pid}#{index}"
    seen.add(pid)
    meta = {f: row[f] for f in spec.meta_fields if f in row}
    problems.append(Problem(pid, problem, answer, meta))
  stats.loaded = len(problems)
  return problems


# ----------------------------------------------------------------------------
# Loading


def _offline() -> bool:
  return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
             for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def shipped_file(spec: BenchmarkSpec) -> Path:
  """Where the package keeps its copy of the benchmark (gzipped)."""
  return catalog.DATA_DIR / "benchmarks" / f"{spec.file}.gz"


def _local_file(spec: BenchmarkSpec, data_dir: str | Path | None) -> tuple[Path | None, list[str]]:
  """The benchmark's file in `data_dir`, else under `$EPGRPO_DATA_DIR`, else the shipped copy."""
  looked = []
  for base in (data_dir, os.environ.get(DATA_DIR_ENV)):
    if not base:
      continue
    base = Path(expand_home(str(base)))
    for folder in (base, base / "benchmarks"):
      for cand in (folder / spec.file, folder / f"{spec.file}.gz"):
        looked.append(str(cand))
        if cand.is_file():
          return cand, looked
  cand = shipped_file(spec)
  looked.append(str(cand))
  return (cand if cand.is_file() else None), looked


def _hf_rows(spec: BenchmarkSpec) -> tuple[list[dict], str]:
  errors = []
  for dataset_id, split in spec.hf:
    try:
      return catalog.hf_rows(dataset_id, split), f"hf:{dataset_id}[{split}]"
    except Exception as e:  # network, auth, schema: try the next id
      errors.append(f"{dataset_id}: {type(e).__name__}")
  raise OSError("; ".join(errors))


def _explicit_rows(spec: BenchmarkSpec, path: str | Path,
                   skipped: collections.Counter) -> tuple[list, str]:
  """Rows of an explicit `path`: a file, a saved `datasets` folder or a Hugging Face id."""
  file = Path(expand_home(str(path)))
  split = spec.hf[0][1] if spec.hf else "test"
  if file.exists():
    return read_rows(file, skipped, split=split), str(file)
  ref = catalog.hf_reference(str(path))
  if ref is None:
    raise MissingFileError(f"benchmark {spec.name!r}: file not found: {file}")
  if not catalog.has_datasets():
    raise MissingFileError(f"benchmark {spec.name!r}: {path} is not a file, and reading it as a "
                            f"Hugging Face dataset needs the `datasets` library "
                            f"({catalog.DATASETS_HINT})")
  dataset_id, split = ref[0], ref[1] or split
  return catalog.hf_rows(dataset_id, split), f"hf:{dataset_id}[{split}]"


def load_benchmark_with_stats(name: str, path: str | Path | None = None,
                              data_dir: str | Path | None = None,
                              limit: int | None = None) -> tuple[list[Problem], LoadStats]:
  """`load_benchmark`, also returning what was read and skipped."""
  spec = get_spec(name)
  if limit is not None and limit < 0:
    raise UserError(f"benchmark {spec.name!r}: limit must be >= 0, got {limit}")
  stats = LoadStats()
  if path is not None:
    rows, stats.source = _explicit_rows(spec, path, stats.skipped)
  else:
    file, looked = _local_file(spec, data_dir)
    if file is not None:
      rows, stats.source = read_rows(file, stats.skipped), str(file)
    else:
      where = f"looked in: {', '.join(looked)}" if looked else f"no data dir and no ${DATA_DIR_ENV}"
      hint = (f"pass --benchmark-file {spec.name}=PATH (expected {spec.expected})")
      if importlib.util.find_spec("datasets") is None or _offline():
        raise MissingFileError(f"benchmark {spec.name!r}: no local file ({where}); {hint}")
      try:
        rows, stats.source = _hf_rows(spec)
      except Exception as e:
        raise MissingFileError(f"benchmark {spec.name!r}: no local file ({where}) and Hugging "
                                f"Face failed ({e}); {hint}") from None
  problems = rows_to_problems(spec, rows, stats, limit)
  if sum(stats.skipped.values()):
    log.warning("benchmark %s: %s", spec.name, stats.summary())
  return problems, stats


def load_benchmark(name: str, path: str | Path | None = None,
                   data_dir: str | Path | None = None,
                   limit: int | None = None) -> list[Problem]:
  """The problems of benchmark `name` (see the module docstring for where from).

  `limit` keeps the first `limit` usable problems. Skipped rows are logged.
  """
  return load_benchmark_with_stats(name, path, data_dir, limit)[0]


def load_benchmarks(names: Sequence[str], files: Mapping[str, str] | None = None,
                    data_dir: str | Path | None = None,
                    limit: int | None = None) -> dict[str, list[Problem]]:
  """Several benchmarks; `files` maps names to explicit paths (--benchmark-file)."""
  files = {get_spec(k).name: v for k, v in (files or {}).items()}
  out = {}
  for name in names:
    spec = get_spec(name)
    out[spec.name] = load_benchmark(spec.name, files.get(spec.name), data_dir, limit)
  return out
