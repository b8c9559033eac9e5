"""Problem/answer datasets: reading, validation with counted skips, prompts, Grain batches.

Rows come from JSONL, a JSON array, or Parquet; fields are named by config
(dotted paths reach nested fields, e.g. `reward_model.ground_truth`). A row that
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
import numpy as np

from epgrpo_jax.errors import UserError
from epgrpo_jax.rows import read_rows

log = logging.getLogger("epgrpo_jax.data")

SKIP_REASONS = ("bad_json", "not_utf8", "not_an_object", "missing_problem", "missing_answer",
                "empty_problem", "empty_answer", "prompt_too_long", "unparsable_answer")

# The paper's math prompt, used when a model has no chat template.
MATH_TEMPLATE = ("{problem}\nPlease reason step by step, and put your final answer within "
                 "\\boxed{}.")


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Where problems come from and how they become prompts."""

  train_files: tuple[str, ...] = ()  # empty: the embedded arithmetic task
  heldout_file: str = ""  # empty: the embedded task's held-out split (or none)
  problem_field: str = "problem"
  answer_field: str = "answer"
  id_field: str = ""
  prompt_template: str = MATH_TEMPLATE  # user message; must contain {problem}
  use_chat_template: bool = True  # wrap the user message in the tokenizer's chat template
  system_prompt: str = ""  # empty: the chat template's default
  max_prompt_tokens: int = 512
  heldout_limit: int = 0  # 0: every held-out problem
  shuffle: bool = True

  def __post_init__(self):
    if "{problem}" not in self.prompt_template:
      raise UserError("data.prompt_template: must contain {problem}")
    if self.max_prompt_tokens < 1:
      raise UserError(f"data.max_prompt_tokens: must be >= 1, got {self.max_prompt_tokens}")
    if self.heldout_limit < 0:
      raise UserError(f"data.heldout_limit: must be >= 0, got {self.heldout_limit}")
    for f in self.train_files:
      if not Path(f).is_file():
        raise UserError(f"data.train_files: file not found: {f}")
    if self.heldout_file and not Path(self.heldout_file).is_file():
      raise UserError(f"data.heldout_file: file not found: {self.heldout_file}")


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


def get_field(row: dict, dotted: str) -> Any:
  """`row['a']['b']` for 'a.b'; integer parts index lists ('prompt.0.content')."""
  node: Any = row
  for part in dotted.split("."):
    if isinstance(node, dict) and part in node:
      node = node[part]
    elif isinstance(node, (list, tuple)) and part.lstrip("-").isdigit() and -len(node) <= int(part) < len(node):
      node = node[int(part)]
    else:
      return None
  return node


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
    user = self.cfg.prompt_template.replace("{problem}", problem)
    if not self.chat:
      return user
    messages = [{"role": "user", "content": user}]
    if self.cfg.system_prompt:
      messages.insert(0, {"role": "system", "content": self.cfg.system_prompt})
    return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

  def ids(self, problem: str) -> list[int]:
    return list(self.tokenizer(self.text(problem), add_special_tokens=False)["input_ids"])


def prepare(rows: Sequence[dict], renderer: PromptRenderer, cfg: DataConfig, skips: SkipCounts,
            source: str = "", answer_ok: Callable[[str], bool] | None = None,
            answer_of: Callable[[dict], Any] | None = None) -> list[Example]:
  """Validates rows into Examples; every unusable row is counted under its reason."""
  examples = []
  for i, row in enumerate(rows):
    if not isinstance(row, dict):
      skips["not_an_object"] += 1
      continue
    raw_problem = get_field(row, cfg.problem_field)
    raw_answer = answer_of(row) if answer_of else get_field(row, cfg.answer_field)
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
    rid = _text(get_field(row, cfg.id_field)) if cfg.id_field else None
    examples.append(Example(id=rid or f"{Path(source).stem}:{i}", problem=problem, answer=answer,
                            prompt_ids=tuple(ids)))
  return examples


def load_examples(files: Sequence[str | Path], renderer: PromptRenderer, cfg: DataConfig,
                  answer_ok: Callable[[str], bool] | None = None) -> tuple[list[Example], SkipCounts]:
  """All usable examples of `files`; raises if none is usable."""
  skips = SkipCounts()
  examples: list[Example] = []
  for f in files:
    examples += prepare(read_rows(f, skips), renderer, cfg, skips, source=str(f), answer_ok=answer_ok)
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


def pad_left(seqs: Sequence[Sequence[int]], length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
  """Left-pads token lists to `length`: (ids [N, length] int32, mask [N, length] bool)."""
  ids = np.full((len(seqs), length), pad_id, np.int32)
  mask = np.zeros((len(seqs), length), bool)
  for i, s in enumerate(seqs):
    if len(s) > length:
      raise ValueError(f"sequence of {len(s)} tokens does not fit in {length}")
    if s:
      ids[i, length - len(s):] = s
      mask[i, length - len(s):] = True
  return ids, mask
