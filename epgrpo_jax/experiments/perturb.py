"""The perturbation test of the paper's Fig 2(a): do high-entropy tokens decide the outcome?

    python -m epgrpo_jax.experiments.perturb --model DIR [--config FILE] [--problems 64]
        [--samples 8] [--frac 0.05] [--continuations 4] [--max-responses 256]
        [--temperature 1.0] [--seed 0] [--out DIR] [key=value ...]

Protocol (each step is exactly what the code does):

1. Problems: the first `--problems` of the held-out set `pipeline.heldout_file`,
   rendered as in training (`pipeline.PromptRenderer`). The config is `--config`,
   else the run's `config.yaml` next to `--model` (a run's `policy/` directory),
   else the default config (for the embedded task: its held-out split).
2. Responses: `--samples` completions per problem from the model at
   `--temperature` (no top-k / top-p), up to `sampling.max_new_tokens` tokens.
   Kept: those the training reward marks correct *and* that ended with a stop
   token, at most `--max-responses` (in problem order). Each token's entropy is
   that of the model's full temperature-scaled next-token distribution at that
   position, as the sampler returns it; this equals the trainer's scoring-pass
   entropy of the policy that sampled.
3. Selection: in a kept response of L tokens (the stop token excluded),
   n = max(1, ceil(frac * L)) positions are chosen: the n of highest entropy
   ("high"), the n of lowest entropy ("low"), and, as a control, n uniformly
   random distinct positions ("random"). Ties go to the earlier position.
4. Perturbation: every chosen token is replaced by a token drawn uniformly from
   the vocabulary of the tokenizer, never a special token nor the original
   token (numpy generator seeded by `--seed`).
5. Continuation: the prefix is the perturbed response up to and including its
   last perturbed position. The model samples `--continuations` completions of
   prompt + prefix at the same temperature; the prefix plus each continuation
   is cut to L_max = `sampling.max_new_tokens` tokens in all (the budget of the
   original response).
6. Scoring: decode(prefix + continuation) is scored by the training reward
   against the gold answer. A condition's accuracy is the mean correctness over
   kept responses x continuations; its drop is 1 - accuracy (every kept
   response was correct before). Reported per condition: the drop, its standard
   error over responses (each response's mean over its continuations), and the
   ratio drop(high) / drop(low) (the paper reports about 3.5x).

Writes OUT/perturb.json (settings, per-condition results, per-response rows)
and OUT/perturb.md (the table), and prints the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import jax
import numpy as np

from epgrpo_jax.data import pipeline
from epgrpo_jax.evaluation.checkpoints import load_policy
from epgrpo_jax.io import commandline, configlib
from epgrpo_jax.io.atomic import output_dir
from epgrpo_jax.io.errors import UserError
from epgrpo_jax.io.paths import path_flag
from epgrpo_jax.models import load_tokenizer, stop_token_ids
from epgrpo_jax.parallel.distributed import to_host
from epgrpo_jax.rewards import RewardScorer, parse_gold
from epgrpo_jax.rollout.sampling import Sampler, SamplingConfig
from epgrpo_jax.training.config import TrainConfig, load_config
from epgrpo_jax.training.embedded import resolve_embedded
from epgrpo_jax.training.build import answer_parses

CONDITIONS = ("high", "low", "random")
PAPER_RATIO = 3.5  # Fig 2(a): drop(high) / drop(low) on Qwen2.5 and MATH


@dataclasses.dataclass
class Response:
  """A correct sampled response: its problem, tokens and entropies (stop token excluded)."""

  problem: int  # index into the examples
  tokens: np.ndarray  # [L] int
  entropy: np.ndarray  # [L] float


def select_positions(entropy_L: np.ndarray, frac: float, how: str,
                     rng: np.random.Generator) -> np.ndarray:
  """Sorted positions to perturb: the n = max(1, ceil(frac * L)) highest/lowest/random ones."""
  length = len(entropy_L)
  if length == 0:
    raise ValueError("select_positions: empty response")
  n = min(max(1, math.ceil(frac * length)), length)
  if how == "high":
    chosen = np.argsort(-np.asarray(entropy_L, np.float64), kind="stable")[:n]
  elif how == "low":
    chosen = np.argsort(np.asarray(entropy_L, np.float64), kind="stable")[:n]
  elif how == "random":
    chosen = rng.choice(length, size=n, replace=False)
  else:
    raise ValueError(f"unknown condition {how!r}; use one of {CONDITIONS}")
  return np.sort(chosen)


def perturbed_prefix(tokens_L: np.ndarray, positions: np.ndarray, candidates: np.ndarray,
                     rng: np.random.Generator) -> np.ndarray:
  """tokens[: last position + 1] with each position's token replaced by a different candidate."""
  prefix = np.array(tokens_L[: int(positions.max()) + 1], copy=True)
  for p in positions:
    original = prefix[p]
    while True:
      new = candidates[rng.integers(len(candidates))]
      if new != original:
        break
    prefix[p] = new
  return prefix


def candidate_tokens(tokenizer, vocab_rows: int) -> np.ndarray:
  """Token ids a perturbation may insert: the tokenizer's vocabulary minus special tokens."""
  size = min(len(tokenizer), vocab_rows)
  special = set(getattr(tokenizer, "all_special_ids", []) or [])
  ids = np.array([i for i in range(size) if i not in special], np.int64)
  if len(ids) < 2:
    raise UserError("the vocabulary has fewer than 2 ordinary tokens")
  return ids


def _padded_batches(items: Sequence[Any], size: int):
  """(start, items padded to `size` by repeating the last) for each batch of `size` items."""
  for lo in range(0, len(items), size):
    chunk = list(items[lo:lo + size])
    yield lo, len(chunk), chunk + [chunk[-1]] * (size - len(chunk))


def sample_correct(sampler, params, examples, golds, tokenizer, scorer, *, samples: int, key,
                   prompts_per_batch: int, max_responses: int) -> tuple[list[Response], dict]:
  """Step 2: correct, finished sampled responses with their token entropies."""
  eos = np.asarray(sampler.eos_ids or (-1,))
  kept: list[Response] = []
  counts = {"sampled": 0, "correct": 0, "correct_unfinished": 0}
  for lo, n, batch in _padded_batches(range(len(examples)), prompts_per_batch):
    key, sub = jax.random.split(key)
    out = sampler.sample(params, [examples[i].prompt_ids for i in batch], num_samples=samples,
                         key=sub)
    tokens, mask, entropy = (np.asarray(x)[:n] for x in to_host((out.tokens, out.mask, out.entropy)))
    seqs = [(i, g, tokens[i, g][mask[i, g]], entropy[i, g][mask[i, g]])
            for i in range(n) for g in range(samples)]
    texts = tokenizer.batch_decode([s[2].tolist() for s in seqs], skip_special_tokens=True)
    result = scorer.score(texts, [golds[lo + s[0]] for s in seqs])
    counts["sampled"] += len(seqs)
    for (i, _, tok, ent), ok in zip(seqs, result.accuracy):
      if not ok:
        continue
      counts["correct"] += 1
      if not (len(tok) > 1 and np.isin(tok[-1], eos)):
        counts["correct_unfinished"] += 1
        continue
      if len(kept) < max_responses:
        kept.append(Response(problem=lo + i, tokens=tok[:-1], entropy=ent[:-1]))
  return kept, counts


def continue_and_score(sampler, params, examples, golds, tokenizer, scorer,
                       items: Sequence[tuple[int, np.ndarray]], *, continuations: int, key,
                       prompts_per_batch: int, max_total: int) -> np.ndarray:
  """Steps 5-6: correctness [items, continuations] of prefix + sampled continuation."""
  correct = np.zeros((len(items), continuations), np.float32)
  for lo, n, batch in _padded_batches(items, prompts_per_batch):
    key, sub = jax.random.split(key)
    prompts = [list(examples[p].prompt_ids) + prefix.tolist() for p, prefix in batch]
    out = sampler.sample(params, prompts, num_samples=continuations, key=sub)
    tokens, mask = (np.asarray(x)[:n] for x in to_host((out.tokens, out.mask)))
    seqs, item_golds = [], []
    for i in range(n):
      p, prefix = batch[i]
      room = max(max_total - len(prefix), 0)
      for c in range(continuations):
        seqs.append(prefix.tolist() + tokens[i, c][mask[i, c]][:room].tolist())
        item_golds.append(golds[p])
    texts = tokenizer.batch_decode(seqs, skip_special_tokens=True)
    result = scorer.score(texts, item_golds)
    correct[lo:lo + n] = np.asarray(result.accuracy, np.float32).reshape(n, continuations)
  return correct


def perturbation_test(sampler, params, examples, golds, tokenizer, scorer,
                      responses: Sequence[Response], *, candidates: np.ndarray, frac: float,
                      continuations: int, key, rng: np.random.Generator, max_total: int,
                      prompts_per_batch: int = 32,
                      conditions: Sequence[str] = CONDITIONS) -> dict[str, Any]:
  """Steps 3-6 on given correct responses; per-condition drop, its error, and per-response rows."""
  out: dict[str, Any] = {"conditions": {}, "responses": []}
  rows = [{"problem": r.problem, "length": int(len(r.tokens))} for r in responses]
  for name in conditions:
    items, positions = [], []
    for r in responses:
      pos = select_positions(r.entropy, frac, name, rng)
      positions.append(pos)
      items.append((r.problem, perturbed_prefix(r.tokens, pos, candidates, rng)))
    key, sub = jax.random.split(key)
    correct = continue_and_score(sampler, params, examples, golds, tokenizer, scorer, items,
                                 continuations=continuations, key=sub,
                                 prompts_per_batch=prompts_per_batch, max_total=max_total)
    per_response = 1.0 - correct.mean(axis=1) if len(correct) else np.zeros(0)
    n = len(per_response)
    out["conditions"][name] = {
        "drop": float(per_response.mean()) if n else None,
        "stderr": float(per_response.std(ddof=1) / math.sqrt(n)) if n > 1 else None,
        "mean_entropy": float(np.mean([r.entropy[p].mean() for r, p in zip(responses, positions)]))
                        if n else None,
        "mean_prefix_len": float(np.mean([len(it[1]) for it in items])) if n else None,
    }
    for row, pos, drop in zip(rows, positions, per_response):
      row[name] = {"positions": pos.tolist(), "drop": float(drop)}
  out["responses"] = rows
  high, low = (out["conditions"].get(k, {}).get("drop") for k in ("high", "low"))
  out["ratio_high_low"] = (high / low if high is not None and low else None)
  return out


def markdown(result: dict[str, Any], settings: dict[str, Any]) -> str:
  lines = [f"Perturbation test (Fig 2a): {settings['responses']} correct responses, "
           f"{settings['frac']:.0%} of tokens replaced, {settings['continuations']} continuations "
           f"each, temperature {settings['temperature']}.", "",
           "| tokens replaced | accuracy drop (%) | ± s.e. | mean entropy of replaced | mean prefix length |",
           "|---|---|---|---|---|"]
  for name, c in result["conditions"].items():
    if c["drop"] is None:
      lines.append(f"| {name} | – | – | – | – |")
      continue
    se = f"{100 * c['stderr']:.1f}" if c["stderr"] is not None else "–"
    lines.append(f"| {name} entropy | {100 * c['drop']:.1f} | {se} | {c['mean_entropy']:.3f} | "
                 f"{c['mean_prefix_len']:.1f} |")
  ratio = result.get("ratio_high_low")
  lines += ["", f"drop(high) / drop(low) = {ratio:.2f} (paper: about {PAPER_RATIO}x)"
            if ratio is not None else f"drop(high) / drop(low): undefined (paper: about {PAPER_RATIO}x)"]
  return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------
# The command


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  p = commandline.ArgumentParser(prog="python -m epgrpo_jax.experiments.perturb",
                         description=__doc__.splitlines()[0])
  p.add_argument("--model", required=True, type=path_flag, help="HF model directory (e.g. RUN/policy)")
  p.add_argument("--config", type=path_flag, help="config for the data and prompt (default: RUN/config.yaml "
                 "next to --model, else the default config)")
  p.add_argument("--problems", type=int, default=64, help="held-out problems to sample")
  p.add_argument("--samples", type=int, default=8, help="samples per problem")
  p.add_argument("--max-responses", type=int, default=256, help="correct responses to perturb")
  p.add_argument("--frac", type=float, default=0.05, help="share of tokens replaced")
  p.add_argument("--continuations", type=int, default=4, help="continuations per perturbed prefix")
  p.add_argument("--temperature", type=float, default=1.0)
  p.add_argument("--prompts-per-batch", type=int, default=32)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", type=path_flag,
                 help="output directory (default: the --model directory's parent / perturb)")
  p.add_argument("--debug", action="store_true")
  p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
  args = p.parse_args(argv)
  for name in ("problems", "samples", "max_responses", "continuations", "prompts_per_batch"):
    if getattr(args, name) < 1:
      p.error(f"--{name.replace('_', '-')}: must be >= 1")
  if not 0 < args.frac <= 1:
    p.error(f"--frac: must be in (0, 1], got {args.frac}")
  if not args.temperature > 0:
    p.error(f"--temperature: must be > 0, got {args.temperature}")
  return args


def _config(args: argparse.Namespace, model_dir: Path):
  run_config = model_dir.parent / "config.yaml"
  if args.config is None and run_config.is_file():
    cfg = configlib.load(TrainConfig, run_config, args.overrides)
  else:
    cfg = load_config(args.config, args.overrides)
  if not cfg.data.heldout_file:
    cfg = resolve_embedded(cfg, progress=False)
  if not cfg.data.heldout_file:
    raise UserError("data.heldout_file: the config names no held-out set")
  return cfg


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  commandline.setup_logging(args.debug)
  commandline.enable_compilation_cache()

  def run() -> int:
    model_dir = Path(args.model)
    if not (model_dir / "config.json").is_file():
      raise UserError(f"--model: no config.json in {model_dir}")
    cfg = _config(args, model_dir)
    tokenizer = load_tokenizer(model_dir)
    out_dir = output_dir(args.out or model_dir.parent / "perturb", "--out")  # before the model loads
    model = load_policy(model_dir)
    renderer = pipeline.PromptRenderer(tokenizer, cfg.data)
    examples, _ = pipeline.load_examples([cfg.data.heldout_file], renderer, cfg.data,
                                     answer_ok=answer_parses, field="data.heldout_file")
    examples = examples[:args.problems]
    golds = [parse_gold(e.answer) for e in examples]
    eos = stop_token_ids(tokenizer, model.cfg)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    max_total = cfg.sampling.max_new_tokens
    sampler = Sampler(SamplingConfig(temperature=args.temperature, max_new_tokens=max_total,
                                     length_buckets=cfg.sampling.length_buckets),
                      eos_ids=eos, pad_id=pad)
    rng = np.random.default_rng(args.seed)
    key = jax.random.key(args.seed)
    start = time.perf_counter()
    with RewardScorer(cfg.reward) as scorer:
      key, sub = jax.random.split(key)
      responses, counts = sample_correct(
          sampler, model, examples, golds, tokenizer, scorer, samples=args.samples, key=sub,
          prompts_per_batch=args.prompts_per_batch, max_responses=args.max_responses)
      if not responses:
        raise UserError(f"no correct finished response among {counts['sampled']} samples; "
                         f"the test needs correct responses to perturb")
      result = perturbation_test(
          sampler, model, examples, golds, tokenizer, scorer, responses,
          candidates=candidate_tokens(tokenizer, model.cfg.vocab_size), frac=args.frac,
          continuations=args.continuations, key=key, rng=rng, max_total=max_total,
          prompts_per_batch=args.prompts_per_batch)
    settings = {"model": str(model_dir), "problems": len(examples), "samples": args.samples,
                "frac": args.frac, "continuations": args.continuations,
                "temperature": args.temperature, "seed": args.seed, "max_total": max_total,
                "responses": len(responses), **counts,
                "seconds": round(time.perf_counter() - start, 1)}
    (out_dir / "perturb.json").write_text(json.dumps({"settings": settings, **result}, indent=1))
    table = markdown(result, settings)
    (out_dir / "perturb.md").write_text(table)
    print(table, end="")
    print(f"written: {out_dir / 'perturb.json'}, {out_dir / 'perturb.md'}")
    return 0

  return commandline.run_main(run, debug=args.debug)


if __name__ == "__main__":
  sys.exit(main())
