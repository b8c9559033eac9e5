"""Problem/answer datasets: reading, validation with counted skips, prompts, Grain batches.

Rows come from JSONL (plain or gzipped), a JSON array, Parquet, a folder saved
by `datasets`, a Hugging Face dataset id, or a data set shipped with the
package, by name (`epgrpo_jax.io.catalog`: a training set such as
`simplelr_math_l3to5`, or a benchmark such as `math500`). Fields are named by
config (dotted paths reach nested fields, e.g. `reward_model.ground_truth`);
a named set brings its own field names. A row that
cannot be used is skipped and counted under a reason; nothing is silently
dropped or truncated. Training batches are drawn by a Grain `MapDataset` of row
indices (shuffled per epoch by seed, sharded per process) whose iterator state
is checkpointed with the run.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from pathlib import Path
from typing import Any, Callable, Sequence

import grain

from epgrpo_jax.data import evalsets
from epgrpo_jax.io import catalog
from epgrpo_jax.io.errors import MissingFileError, UserError
from epgrpo_jax.io.paths import UserPath, expand_home
from epgrpo_jax.models import render_prompt
from epgrpo_jax.io.records import check_saved_dataset, data_stem, get_field, read_rows

log = logging.getLogger("epgrpo_jax.data.pipeline")

SKIP_REASONS = ("bad_json", "not_utf8", "not_an_object", "missing_problem", "missing_answer",
                "empty_problem", "empty_answer", "prompt_too_long", "unparsable_answer")

# The paper's math prompt, used when a model has no chat template.
MATH_TEMPLATE = ("{problem}\nPlease reason step by step, and put your final answer within "
                 "\\boxed{}.")


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Where problems come from and how they become prompts."""

  train_files: tuple[UserPath, ...] = ()  # paths or names (`resolve_source`); empty: the embedded task
  heldout_file: UserPath = ""  # a path or name; empty: the embedded task's held-out split (or none)
  problem_field: str = "problem"
  answer_field: str = "answer"
  id_field: str = ""
  prompt_template: str = MATH_TEMPLATE  # user message with {problem}; the embedded task uses "{problem}"
  use_chat_template: bool = True  # wrap the user message in the tokenizer's chat template
  system_prompt: str = ""  # empty: the chat template's default
  max_prompt_tokens: int = 512
  heldout_limit: int = 0  # 0: every held-out problem (the embedded task: embedded.heldout_problems)
  shuffle: bool = True

  def __post_init__(self):
    if "{problem}" not in self.prompt_template:
      raise UserError("data.prompt_template: must contain {problem}")
    if self.max_prompt_tokens < 1:
      raise UserError(f"data.max_prompt_tokens: must be >= 1, got {self.max_prompt_tokens}")
    if self.heldout_limit < 0:
      raise UserError(f"data.heldout_limit: must be >= 0, got {self.heldout_limit}")
    for f in self.train_files:
      resolve_source(f, "data.train_files")
    if self.heldout_file:
      resolve_source(self.heldout_file, "data.heldout_file")


# The split read from a Hugging Face id or a saved DatasetDict, per config field.
DEFAULT_SPLIT = {"data.train_files": "train", "data.heldout_file": "test"}


@dataclasses.dataclass(frozen=True)
class Source:
  """Where one entry of `data.train_files` (or `data.heldout_file`) reads its rows from.

  kind: "file", "saved" (a `save_to_disk` folder), "train_set" or "benchmark"
  (shipped with the package, by name) or "hf" (a Hugging Face dataset id).
  """

  text: str
  kind: str
  path: Path | None = None
  name: str = ""
  split: str = ""


def _names() -> str:
  return ", ".join([*catalog.TRAIN_SETS, *evalsets.BENCHMARKS])


def resolve_source(value: str | Path, field: str = "data.train_files") -> Source:
  """What `value` names: an existing file or saved `datasets` folder, else a shipped data set's
  name, else a Hugging Face dataset id (with the `datasets` library); otherwise a one-line
  `ValueError` that names `field`."""
  text = str(value)
  split = DEFAULT_SPLIT.get(field, "train")
  path = Path(expand_home(text))
  if path.is_file():
    return Source(text, "file", path)
  if path.is_dir():
    check_saved_dataset(path, field)
    return Source(text, "saved", path, split=split)
  found = catalog.train_set(text)
  if found is not None:
    return Source(text, "train_set", found.path, found.name)
  try:
    return Source(text, "benchmark", name=evalsets.get_spec(text).name)
  except KeyError:
    pass
  ref = catalog.hf_reference(text)
  if ref is not None and catalog.has_datasets():
    return Source(text, "hf", name=ref[0], split=ref[1] or split)
  if ref is not None:
    raise UserError(f"{field}: {text!r} is neither a file nor a known data set ({_names()}); as a "
                     f"Hugging Face dataset id it needs the `datasets` library "
                     f"({catalog.DATASETS_HINT})")
  if path.suffix or "/" in text or "\\" in text:
    raise MissingFileError(f"{field}: file not found: {text}")
  raise UserError(f"{field}: {text!r} is neither a file nor a known data set ({_names()})")


def source_rows(src: Source,
                skips: collections.Counter) -> tuple[list[Any], tuple[str, ...] | None, str]:
  """(rows, (problem, answer, id) fields or None for the config's, source label) of `src`."""
  if src.kind == "benchmark":
    problems, stats = evalsets.load_benchmark_with_stats(src.name)
    skips.update(stats.skipped)
    rows = [{"problem": p.problem, "answer": p.answer, "id": p.id} for p in problems]
    return rows, ("problem", "answer", "id"), src.name
  if src.kind == "train_set":
    entry = catalog.TRAIN_SETS[src.name]
    fields = (entry.problem_field, entry.answer_field, "")
    return read_rows(entry.path, skips), fields, str(entry.path)
  if src.kind == "hf":
    return catalog.hf_rows(src.name, src.split), None, src.name
  return read_rows(src.path, skips, split=src.split or None), None, str(src.path)


@dataclasses.dataclass(frozen=True)
class Example:
  """One usable problem: its text, gold answer, and tokenised prompt."""

  id: str
  problem: str
  answer: str
  prompt_ids: tuple[int, ...]


class SkipCounts(collections.Counter):
  """Skipped rows per reason."""

  def summary(self) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(self.items()) if v) or "none"


def _is_scalar(value: Any) -> bool:
  """None (reported as missing), a string or a number; a list, object or bool is not text."""
  return value is None or (isinstance(value, (str, int, float)) and not isinstance(value, bool))


def _text(value: Any) -> str | None:
  if value is None:
    return None
  if isinstance(value, float) and value.is_integer():
    value = int(value)  # AMC-style float answers: 27.0 -> "27"
  return str(value).strip()


class PromptRenderer:
  """Problem text -> prompt string -> token ids, with the chat template or a plain one."""

  def __init__(self, tokenizer, cfg: DataConfig):
    self.tokenizer = tokenizer
    self.cfg = cfg
    self.chat = cfg.use_chat_template and bool(getattr(tokenizer, "chat_template", None))

  def text(self, problem: str) -> str:
    user = self.cfg.prompt_template.replace("{problem}", problem)  # LaTeX braces stay literal
    if not self.chat:
      return user
    return render_prompt(self.tokenizer, user, system=self.cfg.system_prompt or None)

  def ids(self, problem: str) -> list[int]:
    return list(self.tokenizer(self.text(problem), add_special_tokens=False)["input_ids"])


def prepare(rows: Sequence[dict], renderer: PromptRenderer, cfg: DataConfig, skips: SkipCounts,
            source: str = "", answer_ok: Callable[[str], bool] | None = None,
            answer_of: Callable[[dict], Any] | None = None,
            fields: Sequence[str] | None = None) -> list[Example]:
  """Validates rows into Examples; every unusable row is counted under its reason.

  `fields`: (problem, answer, id) field names, in place of the config's.
  """
  problem_field, answer_field, id_field = fields or (cfg.problem_field, cfg.answer_field,
                                                     cfg.id_field)
  examples = []
  for i, row in enumerate(rows):
    if not isinstance(row, dict):
      skips["not_an_object"] += 1
      continue
    raw_problem = get_field(row, problem_field)
    raw_answer = answer_of(row) if answer_of else get_field(row, answer_field)
    problem, answer = _text(raw_problem), _text(raw_answer)
    reason = None
    if not _is_scalar(raw_problem):
      reason = "problem_not_text"
    elif not _is_scalar(raw_answer):
      reason = "answer_not_text"
    elif problem is None:
      reason = "missing_problem"
    elif answer is None:
      reason = "missing_answer"
    elif not problem:
      reason = "empty_problem"
    elif not answer:
      reason = "empty_answer"
    elif answer_ok is not None and not answer_ok(answer):
      reason = "unparsable_answer"
    ids = renderer.ids(problem) if reason is None else []
    if reason is None and len(ids) > cfg.max_prompt_tokens:
      reason = "prompt_too_long"
    if reason is not None:
      skips[reason] += 1
      log.debug("%s row %d: skipped (%s)", source, i, reason)
      continue
    rid = _text(get_field(row, id_field)) if id_field else None
    examples.append(Example(id=rid or f"{data_stem(source)}:{i}", problem=problem, answer=answer,
                            prompt_ids=tuple(ids)))
  return examples


def load_examples(files: Sequence[str | Path], renderer: PromptRenderer, cfg: DataConfig,
                  answer_ok: Callable[[str], bool] | None = None,
                  field: str = "data.train_files") -> tuple[list[Example], SkipCounts]:
  """All usable examples of `files` (paths or names, see `resolve_source`; `field` is the
  config field they come from); raises if none is usable."""
  skips = SkipCounts()
  examples: list[Example] = []
  for f in files:
    rows, fields, source = source_rows(resolve_source(f, field), skips)
    examples += prepare(rows, renderer, cfg, skips, source=source, answer_ok=answer_ok,
                        fields=fields)
  if not examples:
    names = ", ".join(map(str, files))
    raise UserError(f"{names}: no usable row (skipped: {skips.summary()}; fields "
                     f"data.problem_field={cfg.problem_field!r}, data.answer_field={cfg.answer_field!r})")
  return examples, skips


def batch_iterator(num_examples: int, batch_size: int, *, seed: int, shuffle: bool = True,
                   shard_index: int = 0, shard_count: int = 1) -> grain.DatasetIterator:
  """An endless, checkpointable iterator of this process's part of each global index batch.

  Every process walks the same global batches of `batch_size` indices (each
  epoch reshuffled); process `shard_index` of `shard_count` gets the slice
  `[shard_index * b, (shard_index + 1) * b)`, b = batch_size / shard_count, of
  each. The global batches, and so a run, do not depend on the number of processes.
  """
  if batch_size % shard_count:
    raise UserError(f"train.prompts_per_step: {batch_size} is not divisible by the "
                     f"{shard_count} processes")
  if num_examples < batch_size:
    raise UserError(f"train.prompts_per_step: {batch_size} prompts per step but only "
                     f"{num_examples} usable rows")
  ds = grain.MapDataset.range(num_examples)
  if shuffle:
    ds = ds.shuffle(seed=seed)
  per = batch_size // shard_count
  lo = shard_index * per
  ds = ds.repeat(None).batch(batch_size, drop_remainder=True)
  return iter(ds if shard_count == 1 else ds.map(lambda batch: batch[lo:lo + per]))
