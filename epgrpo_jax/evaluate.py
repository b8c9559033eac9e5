"""Held-out evaluation: Acc (mean over samples), Fmt (boxed rate), pass@k.

`evaluate_examples` is the core (the trainer calls it on its held-out set);
the rest is the benchmark command (see docs/evaluation.md):

  python -m epgrpo_jax.evaluate --model DIR [--checkpoint CKPT] \\
      --benchmarks math500,amc23,minerva,aime24,aime25 [--samples 16] [--out DIR]

It renders each problem with the math prompt, samples with our `Sampler`,
scores with `RewardScorer` (reward checks of one batch overlap the sampling of
the next), and writes `OUT/results.md` (the table of the paper's Tables II/III),
`OUT/results.json` and `OUT/samples.jsonl`. Prompts that do not fit are
skipped and counted, never dropped silently.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import logging
import math
import sys
import time
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import jax
import numpy as np

from epgrpo_jax.io import commandline
from epgrpo_jax.io.atomic import write_text_atomic
from epgrpo_jax.parallel.distributed import to_host
from epgrpo_jax.io.errors import MissingFileError, UserError
from epgrpo_jax.rewards import RewardResult, RewardScorer, pass_at_k

if TYPE_CHECKING:
  from epgrpo_jax.data.pipeline import Example

log = logging.getLogger("epgrpo_jax.evaluate")

PASS_KS = (1, 4, 8, 16)
TABLE_KS = (4, 8, 16)  # the pass@k columns of the paper's tables
DEFAULT_BENCHMARKS = ("math500", "amc23", "minerva", "aime24", "aime25")
SKIP_REASONS = ("exceeds_context", "prompt_too_long")
# The paper's math prompt (user message). `pipeline.MATH_TEMPLATE` is the same text written for
# str.format, but `PromptRenderer` substitutes with str.replace, so its `{{}}` would stay doubled.
EVAL_TEMPLATE = "{problem}\nPlease reason step by step, and put your final answer within \\boxed{}."


@dataclasses.dataclass
class EvalResult:
  """Per-sample correctness [problems, samples] and the records behind it."""

  correct: np.ndarray  # [N, S] float
  boxed: np.ndarray  # [N, S] float
  records: list[dict[str, Any]]

  def summary(self, ks: Sequence[int] = PASS_KS) -> dict[str, float]:
    n, s = self.correct.shape
    out = {"accuracy": float(self.correct.mean()) if n else 0.0,
           "format": float(self.boxed.mean()) if n else 0.0}
    c = self.correct.sum(axis=1)
    for k in ks:
      if k <= s and n and k > 1:
        out[f"pass@{k}"] = float(np.mean(pass_at_k(np.full(n, s), c, k)))
    return out


def _fill(correct: np.ndarray, boxed: np.ndarray, records: list[dict[str, Any]],
          examples: Sequence[Any], lo: int, texts: Sequence[str], result: RewardResult,
          num_samples: int, extra: Sequence[dict[str, Any]] | None = None) -> None:
  """Writes the scores of examples[lo:lo + len(texts) // num_samples] and their records."""
  m = len(texts) // num_samples
  acc = np.asarray(result.accuracy).reshape(m, num_samples)
  fmt = np.asarray(result.format).reshape(m, num_samples)
  correct[lo:lo + m], boxed[lo:lo + m] = acc, fmt
  for i in range(m):
    ex = examples[lo + i]
    for s in range(num_samples):
      j = i * num_samples + s
      records.append({"problem_id": ex.id, "sample": s, "completion": texts[j],
                      "extracted": result.answers[j], "gold": ex.answer,
                      "correct": bool(acc[i, s]), "boxed": bool(fmt[i, s]),
                      "status": result.status[j], **(extra[j] if extra else {})})


def evaluate_examples(sampler, params, examples: Sequence[Example], tokenizer,
                      scorer: RewardScorer, *, num_samples: int, key: jax.Array,
                      prompts_per_batch: int = 64, golds: Sequence[Any] | None = None,
                      progress=None) -> EvalResult:
  """Samples `num_samples` completions per example and scores them.

  Batches are padded to `prompts_per_batch` prompts (repeating the last) so
  that every batch has the same shape and the sampler compiles once. Reward
  checking of one batch overlaps the sampling of the next. `progress` (a
  `metrics.Progress`) advances by the problems of each scored batch. Records
  also carry each completion's token count and whether it ended with a stop id.
  """
  golds = list(golds) if golds is not None else [e.answer for e in examples]
  correct = np.zeros((len(examples), num_samples), np.float32)
  boxed = np.zeros_like(correct)
  records: list[dict[str, Any]] = []
  eos = np.asarray(list(getattr(sampler, "eos_ids", ())) or [-1])
  pending = None

  def collect(pending):
    lo, texts, extra, future = pending
    _fill(correct, boxed, records, examples, lo, texts, future.result(), num_samples, extra)
    if progress is not None:
      done = lo + len(texts) // num_samples
      progress.update({"acc": float(correct[:done].mean()), "fmt": float(boxed[:done].mean())},
                      n=len(texts) // num_samples)

  for lo in range(0, len(examples), prompts_per_batch):
    hi = min(lo + prompts_per_batch, len(examples))
    batch = [examples[i].prompt_ids for i in range(lo, hi)]
    batch += [batch[-1]] * (prompts_per_batch - len(batch))
    key, sub = jax.random.split(key)
    out = sampler.sample(params, batch, num_samples=num_samples, key=sub)
    tokens, mask = to_host((out.tokens, out.mask))  # all rows, from every process
    tokens = tokens[: hi - lo].reshape((hi - lo) * num_samples, -1)
    mask = mask[: hi - lo].reshape((hi - lo) * num_samples, -1)
    seqs = [t[m].tolist() for t, m in zip(tokens, mask)]
    texts = tokenizer.batch_decode(seqs, skip_special_tokens=True)
    extra = [{"num_tokens": len(q), "finished": bool(q) and bool(np.isin(q[-1], eos))}
             for q in seqs]
    if pending is not None:
      collect(pending)
    batch_golds = [golds[i] for i in range(lo, hi) for _ in range(num_samples)]
    pending = (lo, texts, extra, scorer.submit(texts, batch_golds))
  if pending is not None:
    collect(pending)
  return EvalResult(correct=correct, boxed=boxed, records=records)


def score_completions(examples: Sequence[Any], completions: Sequence[Sequence[str]],
                      scorer: RewardScorer, golds: Sequence[Any] | None = None) -> EvalResult:
  """An `EvalResult` from given completions ([problem][sample] texts), no sampling.

  `examples` need `.id` and `.answer` (an `Example` or a `evalsets.Problem`).
  """
  if len(completions) != len(examples):
    raise ValueError(f"{len(completions)} completion lists for {len(examples)} examples")
  s = len(completions[0]) if completions else 0
  if any(len(c) != s for c in completions):
    raise ValueError("every example needs the same number of completions")
  golds = list(golds) if golds is not None else [e.answer for e in examples]
  correct = np.zeros((len(examples), s), np.float32)
  boxed = np.zeros_like(correct)
  records: list[dict[str, Any]] = []
  if s and len(examples):
    texts = [t for c in completions for t in c]
    result = scorer.score(texts, [g for g in golds for _ in range(s)])
    _fill(correct, boxed, records, examples, 0, texts, result, s)
  return EvalResult(correct=correct, boxed=boxed, records=records)


# ----------------------------------------------------------------------------
# Metrics and the table


def benchmark_metrics(result: EvalResult | None, skipped: Mapping[str, int] | None = None,
                      ks: Sequence[int] = TABLE_KS) -> dict[str, Any]:
  """Acc, Fmt, pass@k (k <= samples) and counts of one benchmark; None metrics if empty."""
  skipped = {k: int(v) for k, v in (skipped or {}).items() if v}
  n, s = result.correct.shape if result is not None else (0, 0)
  out: dict[str, Any] = {"problems": n, "samples": s, "skipped": sum(skipped.values()),
                         "skipped_reasons": skipped}
  summary = result.summary(ks) if n and s else {}
  out["accuracy"] = summary.get("accuracy")
  out["format"] = summary.get("format")
  for k in ks:
    out[f"pass@{k}"] = summary.get(f"pass@{k}") if k <= s else None
  if result is not None and n and s:
    tokens = [r["num_tokens"] for r in result.records if "num_tokens" in r]
    finished = [r["finished"] for r in result.records if "finished" in r]
    statuses = collections.Counter(r["status"] for r in result.records)
    out["mean_tokens"] = float(np.mean(tokens)) if tokens else None
    out["finished"] = float(np.mean(finished)) if finished else None
    out["check_status"] = dict(sorted(statuses.items()))
  return out


def average_metrics(per_benchmark: Mapping[str, Mapping[str, Any]],
                    ks: Sequence[int] = TABLE_KS) -> dict[str, Any]:
  """Unweighted mean over benchmarks (as the paper averages); counts are summed."""
  out: dict[str, Any] = {
      "problems": sum(m["problems"] for m in per_benchmark.values()),
      "skipped": sum(m["skipped"] for m in per_benchmark.values())}
  for key in ("accuracy", "format", *(f"pass@{k}" for k in ks)):
    values = [m.get(key) for m in per_benchmark.values()]
    values = [v for v in values if v is not None]
    out[key] = float(np.mean(values)) if values else None
  return out


def _pct(v: float | None) -> str:
  return "–" if v is None or not math.isfinite(v) else f"{100 * v:.2f}"


def markdown_table(per_benchmark: Mapping[str, Mapping[str, Any]], average: Mapping[str, Any],
                   ks: Sequence[int]) -> str:
  """Rows = benchmarks + Average; Acc, Fmt, pass@k in %, then problems scored and skipped."""
  head = ["Benchmark", "Acc", "Fmt", *(f"pass@{k}" for k in ks), "Problems", "Skipped"]
  lines = ["| " + " | ".join(head) + " |",
           "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
  rows = list(per_benchmark.items()) + [("Average", average)]
  for name, m in rows:
    cells = [name, _pct(m.get("accuracy")), _pct(m.get("format")),
             *(_pct(m.get(f"pass@{k}")) for k in ks), str(m["problems"]), str(m["skipped"])]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def skip_note(per_benchmark: Mapping[str, Mapping[str, Any]], context: int,
              max_prompt_tokens: int, max_new_tokens: int) -> str:
  """One line naming the skipped prompts per benchmark and reason ("" when none)."""
  parts = [f"{name} " + ", ".join(f"{k}={v}" for k, v in sorted(m["skipped_reasons"].items()))
           for name, m in per_benchmark.items() if m["skipped"]]
  if not parts:
    return ""
  limit = f", --max-prompt-tokens {max_prompt_tokens}" if max_prompt_tokens else ""
  return (f"Skipped prompts (not scored): {'; '.join(parts)} (model context {context} tokens, "
          f"{max_new_tokens} kept for the completion{limit}).")


def table_ks(num_samples: int) -> tuple[int, ...]:
  """The pass@k columns shown for `num_samples` samples per problem."""
  return tuple(k for k in TABLE_KS if k <= num_samples)


# ----------------------------------------------------------------------------
# Prompts


def render_examples(problems: Sequence[Any], renderer, *, max_new_tokens: int,
                    context_tokens: int, max_prompt_tokens: int = 0
                    ) -> tuple[list[Example], collections.Counter]:
  """`Example`s of `problems` (`evalsets.Problem`), skipping and counting prompts that
  do not fit: longer than `max_prompt_tokens` (0: no limit) -> "prompt_too_long", or
  prompt + `max_new_tokens` beyond the model's `context_tokens` -> "exceeds_context"."""
  from epgrpo_jax.data.pipeline import Example
  examples, skipped = [], collections.Counter()
  for p in problems:
    ids = renderer.ids(p.problem)
    if max_prompt_tokens and len(ids) > max_prompt_tokens:
      skipped["prompt_too_long"] += 1
    elif len(ids) + max_new_tokens > context_tokens:
      skipped["exceeds_context"] += 1
    elif not ids:
      raise UserError(f"problem {p.id}: empty prompt")
    else:
      examples.append(Example(id=p.id, problem=p.problem, answer=p.answer, prompt_ids=tuple(ids)))
      continue
    log.debug("problem %s: skipped (%d prompt tokens)", p.id, len(ids))
  return examples, skipped


# ----------------------------------------------------------------------------
# Checkpoints of a training run


@dataclasses.dataclass(frozen=True)
class CheckpointRef:
  """A resolved `--checkpoint`: the step directory and what the run says about it."""

  step_dir: Path
  step: int
  run_dir: Path
  run_config: dict[str, Any] | None  # RUN_DIR/config.yaml, when the trainer wrote one
  trainable: dict[str, tuple[int, ...]]  # saved trainable parameter path -> shape

  @property
  def full_finetune(self) -> bool:
    return not any(p.endswith((".lora_a", ".lora_b")) for p in self.trainable)

  @property
  def lora_rank(self) -> int | None:
    ranks = {s[-1] for p, s in self.trainable.items() if p.endswith(".lora_a")}
    return ranks.pop() if len(ranks) == 1 else None

  @property
  def lora_targets(self) -> tuple[str, ...]:
    names = {p.split(".")[-2] for p in self.trainable if p.endswith(".lora_a")}
    from epgrpo_jax.models import LORA_TARGETS
    return tuple(t for t in LORA_TARGETS if t in names)


def _step_dirs(root: Path) -> dict[int, Path]:
  """Finished Orbax step directories (temporary ones have non-numeric names)."""
  return {int(p.name): p for p in root.iterdir() if p.is_dir() and p.name.isdigit()}


def resolve_checkpoint(path: str | Path) -> CheckpointRef:
  """`RUN_DIR`, `RUN_DIR/checkpoints` (latest step) or `RUN_DIR/checkpoints/<step>`."""
  from epgrpo_jax.io.checkpointing import saved_trainable_shapes
  p = Path(path).expanduser()
  flag = f"--checkpoint {path}"
  if not p.exists():
    raise MissingFileError(f"{flag}: not found")
  if not p.is_dir():
    raise UserError(f"{flag}: not a directory (expected RUN_DIR, RUN_DIR/checkpoints "
                             "or RUN_DIR/checkpoints/<step>)")
  if p.name.isdigit() and (p / "state").is_dir():
    step_dir = p
  else:
    root = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    steps = _step_dirs(root)
    if not steps and (p / "config.json").is_file():
      raise UserError(f"{flag}: a Hugging Face model directory (e.g. RUN_DIR/policy, with the "
                       "adapters merged); pass it as --model instead")
    if not steps:
      raise MissingFileError(f"{flag}: no checkpoint step directory in {root} (expected "
                              "RUN_DIR, RUN_DIR/checkpoints or RUN_DIR/checkpoints/<step>)")
    step_dir = steps[max(steps)]
  if not (step_dir / "state").is_dir():
    raise MissingFileError(f"{flag}: {step_dir} has no 'state' item (not an epgrpo_jax "
                            "training checkpoint, or an unfinished save)")
  root = step_dir.parent
  run_dir = root.parent if root.name == "checkpoints" else root
  run_config = None
  for cand in (run_dir / "config.yaml", root / "config.yaml"):
    if cand.is_file():
      import yaml
      try:
        run_config = yaml.safe_load(cand.read_text()) or {}
      except yaml.YAMLError:
        raise UserError(f"{cand}: invalid YAML") from None
      if not isinstance(run_config, dict):
        raise UserError(f"{cand}: expected a mapping of config sections")
      break
  try:
    shapes = saved_trainable_shapes(step_dir)
  except Exception as e:  # Orbax raises several types on a damaged checkpoint
    raise UserError(f"{flag}: cannot read {step_dir / 'state'} "
                     f"({type(e).__name__}: {commandline.one_line(e)})") from None
  if not shapes:
    raise UserError(f"{flag}: {step_dir / 'state'} holds no 'trainable' parameters")
  return CheckpointRef(step_dir, int(step_dir.name), run_dir, run_config, shapes)


def _section(cfg: Mapping[str, Any] | None, name: str) -> dict[str, Any]:
  value = (cfg or {}).get(name)
  return value if isinstance(value, dict) else {}


def checkpoint_lora(ref: CheckpointRef, rank: int | None, alpha: float | None):
  """The `LoraConfig` of the run (or None for full fine-tuning): flags, then
  RUN_DIR/config.yaml, then the saved shapes; alpha has no safe default."""
  from epgrpo_jax.models import LoraConfig
  model_cfg, lora_cfg = _section(ref.run_config, "model"), _section(ref.run_config, "lora")
  full = ref.full_finetune
  if "full_finetune" in model_cfg and bool(model_cfg["full_finetune"]) != full:
    raise UserError(f"--checkpoint {ref.step_dir}: config.yaml says model.full_finetune="
                     f"{model_cfg['full_finetune']} but the checkpoint holds "
                     f"{'all weights' if full else 'LoRA adapters'}")
  if full:
    return None
  rank = rank or lora_cfg.get("rank") or ref.lora_rank
  alpha = alpha or lora_cfg.get("alpha")
  targets = tuple(lora_cfg.get("targets") or ref.lora_targets)
  if alpha is None:
    raise UserError(f"--checkpoint {ref.step_dir}: no config.yaml in the run directory to "
                     "read lora.alpha from; pass --lora-alpha (and --lora-rank) as trained")
  lora = LoraConfig(rank=int(rank), alpha=float(alpha), targets=targets)
  if ref.lora_rank is not None and lora.rank != ref.lora_rank:
    raise UserError(f"--checkpoint {ref.step_dir}: adapters of rank {ref.lora_rank}, "
                     f"but rank {lora.rank} was given")
  if set(lora.targets) != set(ref.lora_targets):
    raise UserError(f"--checkpoint {ref.step_dir}: adapters on {list(ref.lora_targets)}, "
                     f"but lora.targets is {list(lora.targets)}")
  return lora


def load_policy(model_dir: str | Path, *, dtype: str = "float32",
                checkpoint: CheckpointRef | None = None, lora=None, seed: int = 0):
  """The model of `model_dir`, with a training checkpoint's weights restored onto it
  (LoRA adapters folded into the kernels). Returns the NNX model."""
  from flax import nnx

  from epgrpo_jax.io.checkpointing import restore_trainable
  from epgrpo_jax.models import from_pretrained, merge_lora
  model = from_pretrained(model_dir, dtype=dtype, param_dtype=dtype, lora=lora, seed=seed)
  if checkpoint is None:
    return model
  what = nnx.LoRAParam if lora is not None else nnx.Param
  graphdef, trainable, rest = nnx.split(model, what, ...)
  expected = {".".join(map(str, k)): tuple(v.shape) for k, v in nnx.to_flat_state(trainable)}
  if expected != checkpoint.trainable:
    missing = sorted(set(checkpoint.trainable) ^ set(expected))
    diff = missing[0] if missing else next(
        k for k in expected if expected[k] != checkpoint.trainable[k])
    raise UserError(f"--checkpoint {checkpoint.step_dir}: does not fit the model in "
                     f"{model_dir} (first difference: {diff}); is --model the run's base model?")
  try:
    restored = restore_trainable(checkpoint.step_dir.parent, checkpoint.step, trainable)
  except Exception as e:  # Orbax raises several types
    raise UserError(f"--checkpoint {checkpoint.step_dir}: cannot restore "
                     f"({type(e).__name__}: {commandline.one_line(e)})") from None
  model = nnx.merge(graphdef, restored, rest)
  if lora is not None:
    merge_lora(model)
  return model


# ----------------------------------------------------------------------------
# The command


def _positive_int(text: str) -> int:
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
  return value


def _non_negative_int(text: str) -> int:
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
  if value < 0:
    raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
  return value


def _float_in(lo: float, hi: float, lo_open: bool = False) -> Callable[[str], float]:
  def parse(text: str) -> float:
    try:
      value = float(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (lo < value if lo_open else lo <= value) or not value <= hi:
      bracket = "(" if lo_open else "["
      raise argparse.ArgumentTypeError(f"must be in {bracket}{lo}, {hi}], got {text}")
    return value
  return parse


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  p = commandline.ArgumentParser(
      prog="python -m epgrpo_jax.evaluate",
      description="Acc, Fmt and pass@k of a model (or a training checkpoint) on math benchmarks.")
  p.add_argument("--model", help="HF model directory (the base model of --checkpoint); default: "
                 "model.path of the run's config.yaml")
  p.add_argument("--checkpoint", help="a training run: RUN_DIR (latest step), RUN_DIR/checkpoints "
                 "or RUN_DIR/checkpoints/<step>; its trained weights are restored onto --model")
  p.add_argument("--benchmarks", default=",".join(DEFAULT_BENCHMARKS),
                 help="comma-separated names (default: %(default)s)")
  p.add_argument("--benchmark-file", action="append", default=[], metavar="NAME=PATH",
                 help="a benchmark's JSONL/JSON/Parquet file, folder saved by `datasets`, or "
                 "Hugging Face dataset id (repeatable)")
  p.add_argument("--data-dir", help="directory holding the benchmark files by their usual names "
                 "(default: $EPGRPO_DATA_DIR, then the copies shipped in epgrpo_jax/datasets)")
  p.add_argument("--samples", type=_positive_int, default=16, help="samples per problem")
  p.add_argument("--temperature", type=_float_in(0.0, math.inf), default=1.0,
                 help="0 samples greedily")
  p.add_argument("--top-p", type=_float_in(0.0, 1.0, lo_open=True), default=1.0)
  p.add_argument("--max-new-tokens", type=_positive_int, default=2048)
  p.add_argument("--max-prompt-tokens", type=_non_negative_int, default=0,
                 help="skip (and count) longer prompts; 0: only the model's context limits")
  p.add_argument("--limit", type=_positive_int, help="first N problems of each benchmark")
  p.add_argument("--out", help="output directory (default: RUN_DIR/eval/step_<N> with "
                 "--checkpoint, else eval/<model dir name>)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--prompts-per-batch", type=_positive_int, default=16,
                 help="prompts sampled together (x --samples rows)")
  p.add_argument("--lora-rank", type=_positive_int, help="the run's lora.rank (default: "
                 "config.yaml of the run, else the checkpoint's shapes)")
  p.add_argument("--lora-alpha", type=_float_in(0.0, math.inf, lo_open=True),
                 help="the run's lora.alpha (default: config.yaml of the run)")
  p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                 help="compute and weight dtype")
  p.add_argument("--prompt-template", help="user message with {problem} (default: the run's "
                 "data.prompt_template, else the paper's step-by-step \\boxed{} prompt)")
  p.add_argument("--system-prompt", help="system message (default: the run's, else the chat "
                 "template's own)")
  p.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=None,
                 help="wrap the prompt in the tokenizer's chat template (default: on)")
  p.add_argument("--reward-timeout", type=_float_in(0.0, math.inf, lo_open=True), default=5.0,
                 help="CPU seconds per answer check (a timed-out check scores 0 and is counted)")
  p.add_argument("--no-progress", action="store_true", help="no progress bars")
  p.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
  args = p.parse_args(argv)
  from epgrpo_jax.data import evalsets
  try:
    args.benchmark_names = _benchmark_names(args.benchmarks)
    args.benchmark_files = evalsets.parse_benchmark_files(args.benchmark_file)
  except (KeyError, ValueError) as e:
    p.error(str(e.args[0]) if isinstance(e, KeyError) else str(e))
  unused = [n for n in args.benchmark_files if n not in args.benchmark_names]
  if unused:
    p.error(f"--benchmark-file {unused[0]}=...: {unused[0]} is not in --benchmarks "
            f"({','.join(args.benchmark_names)})")
  if args.model is None and args.checkpoint is None:
    p.error("--model is required (or --checkpoint of a run whose config.yaml names its model)")
  if args.prompt_template is not None and "{problem}" not in args.prompt_template:
    p.error("--prompt-template: must contain {problem}")
  return args


def _benchmark_names(text: str) -> list[str]:
  from epgrpo_jax.data import evalsets
  names = [n.strip() for n in text.split(",") if n.strip()]
  if not names:
    raise UserError("--benchmarks: empty list")
  out = []
  for n in names:
    name = evalsets.get_spec(n).name
    if name in out:
      raise UserError(f"--benchmarks: {name} listed twice")
    out.append(name)
  return out


def _bench_key(key: jax.Array, name: str) -> jax.Array:
  """A key per benchmark that does not depend on which others are evaluated."""
  return jax.random.fold_in(key, zlib.crc32(name.encode()) & 0x7FFFFFFF)


def run(args: argparse.Namespace) -> int:
  """The evaluation command; returns the exit code."""
  from epgrpo_jax.data import evalsets
  from epgrpo_jax.data import pipeline
  from epgrpo_jax.io.metrics import Progress
  from epgrpo_jax.models import check_vocab, load_hf_config, load_tokenizer, stop_token_ids
  from epgrpo_jax.rewards import RewardConfig
  from epgrpo_jax.rollout.sampling import Sampler, SamplingConfig

  start = time.perf_counter()
  ref = resolve_checkpoint(args.checkpoint) if args.checkpoint else None
  run_model = _section(ref.run_config if ref else None, "model")
  run_data = _section(ref.run_config if ref else None, "data")
  model_dir = args.model or run_model.get("path")
  if not model_dir or model_dir == "embedded":
    raise UserError(f"--model: required (the run's config.yaml names model.path={model_dir!r})")
  model_dir = Path(model_dir).expanduser()
  if not model_dir.is_dir():
    raise MissingFileError(f"--model {model_dir}: not a directory")
  if not (model_dir / "config.json").is_file():
    raise MissingFileError(f"--model {model_dir}: no config.json (not a Hugging Face model "
                            "directory)")
  lora = checkpoint_lora(ref, args.lora_rank, args.lora_alpha) if ref else None
  context = load_hf_config(model_dir).max_position_embeddings
  if args.max_new_tokens >= context:
    raise UserError(f"--max-new-tokens {args.max_new_tokens}: leaves no room for a prompt in "
                     f"the model's context of {context} tokens (max_position_embeddings)")

  # Problems first: a missing benchmark file fails before the model is loaded.
  loaded, load_skips, sources = {}, {}, {}
  for name in args.benchmark_names:
    problems, stats = evalsets.load_benchmark_with_stats(
        name, args.benchmark_files.get(name), args.data_dir, args.limit)
    loaded[name], sources[name] = problems, stats.source
    load_skips[name] = {k: int(v) for k, v in stats.skipped.items() if v}

  tokenizer = load_tokenizer(model_dir)
  check_vocab(tokenizer, load_hf_config(model_dir), model_dir)
  data_cfg = pipeline.DataConfig(
      prompt_template=(args.prompt_template if args.prompt_template is not None
                       else run_data.get("prompt_template") or EVAL_TEMPLATE),
      use_chat_template=(args.chat_template if args.chat_template is not None
                         else bool(run_data.get("use_chat_template", True))),
      system_prompt=(args.system_prompt if args.system_prompt is not None
                     else run_data.get("system_prompt") or ""))
  renderer = pipeline.PromptRenderer(tokenizer, data_cfg)
  examples, prompt_skips = {}, {}
  for name, problems in loaded.items():
    examples[name], prompt_skips[name] = render_examples(
        problems, renderer, max_new_tokens=args.max_new_tokens, context_tokens=context,
        max_prompt_tokens=args.max_prompt_tokens)
    if prompt_skips[name]:
      log.warning("%s: %d of %d prompts skipped (%s; context %d, max new tokens %d)", name,
                  sum(prompt_skips[name].values()), len(problems),
                  ", ".join(f"{k}={v}" for k, v in sorted(prompt_skips[name].items())), context,
                  args.max_new_tokens)
    if not examples[name]:
      skipped = {**load_skips[name], **prompt_skips[name]}
      raise UserError(f"--benchmarks {name}: no usable problem in {sources[name]} (skipped: "
                      f"{', '.join(f'{k}={v}' for k, v in sorted(skipped.items())) or 'none'})")

  out_dir = Path(args.out).expanduser() if args.out else (
      ref.run_dir / "eval" / f"step_{ref.step}" if ref else Path("eval") / model_dir.name)
  if out_dir.exists() and not out_dir.is_dir():
    raise UserError(f"--out {out_dir}: exists and is not a directory")
  try:
    out_dir.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise UserError(f"--out {out_dir}: cannot create ({e.strerror})") from None

  model = load_policy(model_dir, dtype=args.dtype, checkpoint=ref, lora=lora, seed=args.seed)
  if ref:
    log.info("restored the %s of step %d from %s", "LoRA adapters (merged)" if lora else
             "trained weights", ref.step, ref.step_dir)
  from flax import nnx
  params = nnx.split(model)
  sampler = Sampler(SamplingConfig(temperature=args.temperature, top_p=args.top_p,
                                   max_new_tokens=args.max_new_tokens),
                    eos_ids=stop_token_ids(tokenizer, model.cfg, model_dir=model_dir),
                    pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
  ks = table_ks(args.samples)
  key = jax.random.key(args.seed)
  per_benchmark: dict[str, dict[str, Any]] = {}
  reward_cfg = RewardConfig(timeout_s=args.reward_timeout)
  progress_on = not args.no_progress
  # Samples go to a temporary file that replaces samples.jsonl only with the new results, so an
  # interrupted evaluation leaves an earlier one in the directory whole and consistent.
  for stale in out_dir.glob(".samples.jsonl.tmp-*"):  # left by an interrupted evaluation
    stale.unlink()
  samples_tmp = out_dir / f".samples.jsonl.tmp-{os.getpid()}"
  with RewardScorer(reward_cfg) as scorer, open(samples_tmp, "w") as samples_file:
    for name, exs in examples.items():
      bench_start = time.perf_counter()
      result = None
      if exs:
        bar = Progress(len(exs), name, enabled=progress_on, every=1)
        result = evaluate_examples(sampler, params, exs, tokenizer, scorer,
                                   num_samples=args.samples, key=_bench_key(key, name),
                                   prompts_per_batch=min(args.prompts_per_batch, len(exs)),
                                   progress=bar)
        bar.close()
        for r in result.records:
          samples_file.write(json.dumps({"benchmark": name, **r}, ensure_ascii=False) + "\n")
        samples_file.flush()
      m = benchmark_metrics(result, prompt_skips[name], ks)
      m.update(source=sources[name], load_skipped=load_skips[name],
               seconds=round(time.perf_counter() - bench_start, 3))
      per_benchmark[name] = m
      log.info("%s: acc %s%% fmt %s%% over %d problems x %d samples (%.1fs)", name,
               _pct(m["accuracy"]), _pct(m["format"]), m["problems"], args.samples, m["seconds"])
    reward_stats = scorer.stats
  average = average_metrics(per_benchmark, ks)
  table = markdown_table(per_benchmark, average, ks)
  title = f"{model_dir}" + (f" + {ref.step_dir} (step {ref.step})" if ref else "")
  settings = (f"{args.samples} samples per problem, temperature {args.temperature}, top-p "
              f"{args.top_p}, max {args.max_new_tokens} new tokens, seed {args.seed}")
  note = skip_note(per_benchmark, context, args.max_prompt_tokens, args.max_new_tokens)
  results_md = (
      f"# Evaluation of {title}\n\n{settings}. Acc, Fmt and pass@k in %; Average is the "
      f"unweighted mean over benchmarks.\n\n{table}\n" + (f"\n{note}\n" if note else ""))
  config = {
      "model": str(model_dir), "checkpoint": str(ref.step_dir) if ref else None,
      "checkpoint_step": ref.step if ref else None,
      "lora": dataclasses.asdict(lora) if lora else None,
      "full_finetune": ref.full_finetune if ref else None,
      "benchmarks": args.benchmark_names, "benchmark_files": sources, "limit": args.limit,
      "samples": args.samples, "temperature": args.temperature, "top_p": args.top_p,
      "max_new_tokens": args.max_new_tokens, "max_prompt_tokens": args.max_prompt_tokens,
      "context_tokens": context, "seed": args.seed, "prompts_per_batch": args.prompts_per_batch,
      "dtype": args.dtype, "prompt_template": data_cfg.prompt_template,
      "use_chat_template": renderer.chat, "system_prompt": data_cfg.system_prompt,
      "rendered_prompt": renderer.text("{problem}"),
      "reward": dataclasses.asdict(reward_cfg), "pass_ks": list(ks)}
  results = {"benchmarks": per_benchmark, "average": average, "config": config,
             "reward_check_stats": reward_stats,
             "seconds": round(time.perf_counter() - start, 3)}
  os.replace(samples_tmp, out_dir / "samples.jsonl")
  write_text_atomic(out_dir / "results.json", json.dumps(results, indent=2, ensure_ascii=False) + "\n")
  write_text_atomic(out_dir / "results.md", results_md)
  print(table + (f"\n\n{note}" if note else ""), flush=True)
  print(f"results: {out_dir / 'results.md'}, {out_dir / 'results.json'}, "
        f"{out_dir / 'samples.jsonl'}", flush=True)
  return 0


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  commandline.setup_logging(args.debug)
  return commandline.run_main(lambda: run(args), debug=args.debug)


if __name__ == "__main__":
  sys.exit(main())
