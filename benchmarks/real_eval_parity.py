"""Evaluation parity on a real checkpoint: `python -m epgrpo_jax.evaluate` vs transformers.

Runs the evaluation command (greedy, one sample, `--max-new-tokens`) on the
first `--limit` problems of MATH500 and AMC23 (AMC23 has 40), then the same
chat-rendered prompts through transformers `generate` (greedy, float32,
left-padded batches, the same stop ids), scores those completions with our
reward code (`evaluation.heldout.score_completions`), and compares: accuracy per
benchmark (goal: within 2 points) and the share of completions whose text is
identical (goal: >= 90%).

  python benchmarks/real_eval_parity.py [--model DIR] [--data-dir DIR] [--limit 50]
      [--max-new-tokens 512] [--batch 16] [--out DIR]

`--model` defaults to $EPGRPO_REAL_MODEL; `--data-dir` to $EPGRPO_DATA_DIR (a
directory with math500.jsonl and amc23.jsonl, see epgrpo_jax.data.evalsets).
Writes OUT/ours/ (the evaluation command's output) and OUT/parity.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

BENCHMARKS = ("math500", "amc23")


def parse_args():
  from epgrpo_jax.io.paths import path_flag  # `~` in a path flag, as in the commands
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--model", type=path_flag, default=os.environ.get("EPGRPO_REAL_MODEL"))
  ap.add_argument("--data-dir", type=path_flag, default=os.environ.get("EPGRPO_DATA_DIR"))
  ap.add_argument("--limit", type=int, default=50, help="first N problems of each benchmark")
  ap.add_argument("--max-new-tokens", type=int, default=512)
  ap.add_argument("--batch", type=int, default=16, help="prompts per batch (both systems)")
  ap.add_argument("--torch-threads", type=int, default=2)
  ap.add_argument("--out", type=path_flag, default="eval/real-parity")
  args = ap.parse_args()
  if not args.model:
    ap.error("--model: required (or set EPGRPO_REAL_MODEL)")
  return args


def run_ours(args, out: Path) -> float:
  """The evaluation command, as a user runs it; returns its wall seconds."""
  cmd = [sys.executable, "-m", "epgrpo_jax.evaluate", "--model", args.model,
         "--benchmarks", ",".join(BENCHMARKS), "--limit", str(args.limit), "--samples", "1",
         "--temperature", "0", "--max-new-tokens", str(args.max_new_tokens),
         "--prompts-per-batch", str(args.batch), "--out", str(out), "--no-progress"]
  if args.data_dir:
    cmd += ["--data-dir", args.data_dir]
  print("$ " + " ".join(cmd), flush=True)
  start = time.perf_counter()
  subprocess.run(cmd, check=True)
  return time.perf_counter() - start


def transformers_completions(args, examples, tokenizer, eos_ids, pad_id) -> list[str]:
  """Greedy completions of `examples` by transformers `generate`, decoded as `evaluate` does."""
  import numpy as np
  import torch
  from transformers import AutoModelForCausalLM

  from epgrpo_jax.rollout.sampling import left_pad

  torch.set_num_threads(args.torch_threads)
  model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
  order = np.argsort([len(e.prompt_ids) for e in examples])  # similar lengths share a batch
  texts: list[str | None] = [None] * len(examples)
  for lo in range(0, len(order), args.batch):
    idx = order[lo:lo + args.batch]
    prompts = [examples[i].prompt_ids for i in idx]
    ids, mask = left_pad(prompts, max(map(len, prompts)), pad_id)
    with torch.inference_mode():
      out = model.generate(torch.as_tensor(ids, dtype=torch.long),
                           attention_mask=torch.as_tensor(mask, dtype=torch.long),
                           do_sample=False, max_new_tokens=args.max_new_tokens,
                           eos_token_id=list(eos_ids), pad_token_id=pad_id,
                           top_p=None, top_k=None, temperature=None)
    for i, row in zip(idx, out[:, ids.shape[1]:].tolist()):
      stop = next((j for j, t in enumerate(row) if t in eos_ids), None)
      texts[i] = tokenizer.decode(row if stop is None else row[:stop + 1], skip_special_tokens=True)
    print(f"  transformers: {min(lo + args.batch, len(order))}/{len(order)} prompts", flush=True)
  return texts


def main():
  args = parse_args()
  from epgrpo_jax.data import evalsets
  from epgrpo_jax.data import pipeline
  from epgrpo_jax.evaluation import heldout
  from epgrpo_jax.models import load_hf_config, load_tokenizer, stop_token_ids
  from epgrpo_jax.rewards import RewardConfig, RewardScorer

  out = Path(args.out)
  load = os.getloadavg()
  print(f"{os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
  ours_seconds = run_ours(args, out / "ours")
  results = json.loads((out / "ours" / "results.json").read_text())
  records = [json.loads(line) for line in (out / "ours" / "samples.jsonl").read_text().splitlines()]

  # The same prompts, rendered and skipped exactly as the evaluation command did.
  tokenizer = load_tokenizer(args.model)
  cfg = load_hf_config(args.model)
  renderer = pipeline.PromptRenderer(tokenizer, pipeline.DataConfig(prompt_template=heldout.EVAL_TEMPLATE))
  eos_ids = stop_token_ids(tokenizer, cfg, model_dir=args.model)
  pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
  report = {"model": args.model, "limit": args.limit, "max_new_tokens": args.max_new_tokens,
            "ours_seconds": round(ours_seconds, 1), "benchmarks": {}}
  start = time.perf_counter()
  with RewardScorer(RewardConfig(timeout_s=5.0)) as scorer:
    for name in BENCHMARKS:
      problems = evalsets.load_benchmark(name, data_dir=args.data_dir, limit=args.limit)
      examples, _ = heldout.render_examples(problems, renderer, max_new_tokens=args.max_new_tokens,
                                            context_tokens=cfg.max_position_embeddings)
      theirs = transformers_completions(args, examples, tokenizer, eos_ids, pad_id)
      scored = heldout.score_completions(examples, [[t] for t in theirs], scorer)
      mine = {r["problem_id"]: r["completion"] for r in records if r["benchmark"] == name}
      same = [mine[e.id] == t for e, t in zip(examples, theirs)]
      acc_ours = results["benchmarks"][name]["accuracy"]
      acc_theirs = float(scored.correct.mean())
      report["benchmarks"][name] = {
          "problems": len(examples), "accuracy_ours": acc_ours, "accuracy_transformers": acc_theirs,
          "accuracy_gap_points": round(100 * abs(acc_ours - acc_theirs), 2),
          "identical": sum(same), "identical_share": sum(same) / max(len(same), 1),
          "different_ids": [e.id for e, s in zip(examples, same) if not s]}
  report["transformers_seconds"] = round(time.perf_counter() - start, 1)
  same = sum(b["identical"] for b in report["benchmarks"].values())
  total = sum(b["problems"] for b in report["benchmarks"].values())
  report["identical_share"] = same / max(total, 1)
  report["pass"] = (report["identical_share"] >= 0.9 and
                    all(b["accuracy_gap_points"] <= 2 for b in report["benchmarks"].values()))
  load = os.getloadavg()
  report["load_average_end"] = [round(x, 2) for x in load]
  (out / "parity.json").write_text(json.dumps(report, indent=2) + "\n")
  for name, b in report["benchmarks"].items():
    print(f"{name:8s} {b['problems']:3d} problems: accuracy ours {100 * b['accuracy_ours']:.1f}% "
          f"transformers {100 * b['accuracy_transformers']:.1f}% (gap {b['accuracy_gap_points']:.1f} "
          f"points); identical completions {b['identical']}/{b['problems']}")
  print(f"identical completions in all: {same}/{total} ({100 * report['identical_share']:.1f}%); "
        f"ours {ours_seconds:.0f}s, transformers {report['transformers_seconds']:.0f}s; "
        f"{'PASS' if report['pass'] else 'FAIL'} (goals: gap <= 2 points, >= 90% identical); "
        f"load average at end {load[0]:.2f}")
  return 0 if report["pass"] else 1


if __name__ == "__main__":
  sys.exit(main())
