"""Held-out evaluation: Acc (mean over samples), Fmt (boxed rate), pass@k.

`evaluate_examples` samples and scores problems (the trainer calls it on its held-out set,
the `epgrpo_jax.evaluate` command on each benchmark); `score_completions` scores given texts.
Reward checks of one batch overlap the sampling of the next. The rest makes the benchmark
table (the paper's Tables II/III) and renders problems as prompts, counting those that do not fit.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from epgrpo_jax.data.pipeline import Example
from epgrpo_jax.io.errors import UserError
from epgrpo_jax.parallel.distributed import to_host
from epgrpo_jax.rewards import RewardResult, RewardScorer, pass_at_k

log = logging.getLogger("epgrpo_jax.evaluation.heldout")

PASS_KS = (1, 4, 8, 16)
TABLE_KS = (4, 8, 16)  # the pass@k columns of the paper's tables
SKIP_REASONS = ("exceeds_context", "prompt_too_long")  # of `render_examples`
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
           "accuracy_se": standard_error(self.correct.mean(axis=1)) if n and s else 0.0,
           "format": float(self.boxed.mean()) if n else 0.0}
    c = self.correct.sum(axis=1)
    for k in ks:
      if k <= s and n and k > 1:
        out[f"pass@{k}"] = float(np.mean(pass_at_k(np.full(n, s), c, k)))
    return out


def standard_error(per_problem_N: np.ndarray) -> float:
  """The standard error of the mean of per-problem scores: their sample standard deviation
  over sqrt(N) (0 for fewer than 2 problems).

  Given each problem's accuracy over its own samples, this is the SE of the held-out accuracy
  as an estimate over problems drawn from the task: the samples of one problem are not
  independent draws (they share its difficulty), so the problem, not the sample, is the unit;
  the sampling noise of the k samples is inside each problem's score and so counted too.
  """
  x = np.asarray(per_problem_N, np.float64)
  return float(x.std(ddof=1) / math.sqrt(x.size)) if x.size > 1 else 0.0


def paired_gain(before: EvalResult, after: EvalResult) -> tuple[float, float]:
  """The accuracy gain from `before` to `after` on the same problems, and its standard error:
  the mean and `standard_error` of the per-problem differences (paired, so the problems'
  shared difficulty cancels)."""
  if before.correct.shape[0] != after.correct.shape[0]:
    raise ValueError(f"paired_gain: {before.correct.shape[0]} problems before, "
                     f"{after.correct.shape[0]} after")
  diff_N = after.correct.mean(axis=1) - before.correct.mean(axis=1)
  return (float(diff_N.mean()) if diff_N.size else 0.0), standard_error(diff_N)


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


def percent(v: float | None) -> str:
  """A table cell: `v` in % with two decimals, "–" when missing."""
  return "–" if v is None or not math.isfinite(v) else f"{100 * v:.2f}"


def markdown_table(per_benchmark: Mapping[str, Mapping[str, Any]], average: Mapping[str, Any],
                   ks: Sequence[int]) -> str:
  """Rows = benchmarks + Average; Acc, Fmt, pass@k in %, then problems scored and skipped."""
  head = ["Benchmark", "Acc", "Fmt", *(f"pass@{k}" for k in ks), "Problems", "Skipped"]
  lines = ["| " + " | ".join(head) + " |",
           "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
  rows = list(per_benchmark.items()) + [("Average", average)]
  for name, m in rows:
    cells = [name, percent(m.get("accuracy")), percent(m.get("format")),
             *(percent(m.get(f"pass@{k}")) for k in ks), str(m["problems"]), str(m["skipped"])]
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
