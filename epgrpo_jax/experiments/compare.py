"""The small-scale reproduction of the paper's Tables II and IV on the embedded task.

    python -m epgrpo_jax.experiments.compare [--out DIR] [--seeds 3] [--steps N]
        [--variants grpo,epgrpo,...] [--eval-samples 16] [--quick] [--report-only]
        [key=value ...]

Trains every variant (GRPO, Higher Temp, More Rollouts, +EG, +IPS, +EG+IPS,
+IPS+ZVD, EP-GRPO, and the rival rows below) for each of N seeds
(`train.seed` = first seed + i) from the same warm-started model and data with
the same step budget, each by calling `epgrpo_jax.training.loop.train` on
`configs/<variant>.yaml` (EP-GRPO: `configs/default.yaml`) plus the shared
`key=value` overrides. Each final policy is evaluated on the held-out set by
the trainer (16 samples per problem, temperature `eval.temperature`): Acc,
Fmt, pass@4/8/16.

Writes under OUT (default runs/compare):
  runs/<variant>/seed<s>/     the run directory; `result.json` there marks it finished
  results.md                  tables shaped like Tables II and IV (mean ± std over seeds),
                              zero-variance statistics, advantage diagnostics, timing
  summary.json                the same numbers, machine-readable
  curves/                     seed-averaged training curves overlaid per variant (epgrpo_jax.tools.plot)

Resumable: a (variant, seed) whose result.json exists is not run again; one
killed part-way resumes from its last checkpoint (or restarts if it has none).

The rival methods of issue 25 are rows too, each on GRPO's advantage: 80/20
token selection, DAPO dynamic sampling at the same step budget and at the
same sample budget (`Variant.same_samples`), GSPO, DAPO overlong filtering and
soft overlong punishment ("Rival methods" table of the report).

`--quick` (CI) runs GRPO and EP-GRPO for three steps and the rival rows for one
step each (without the Table II baselines and the Table IV ablations), one
seed, a 16-problem eval: a check of the pipeline, not of the result.

The rows and the plan are in `experiments.variants`, the statistics and the report in
`experiments.reporting`.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from epgrpo_jax.experiments.reporting import run_statistics, write_curves, write_json, write_report
from epgrpo_jax.experiments.variants import BY_NAME, Plan, Variant, check_plan
from epgrpo_jax.io import commandline
from epgrpo_jax.io import configlib
from epgrpo_jax.io.atomic import output_dir
from epgrpo_jax.io.metrics import read_metrics
from epgrpo_jax.io.paths import path_flag
from epgrpo_jax.rollout.sampling import shared_programs
from epgrpo_jax.training.config import CONFIG_DIR, TrainConfig
from epgrpo_jax.training.embedded import resolve_embedded
from epgrpo_jax.training.loop import train

log = logging.getLogger("epgrpo_jax.experiments.compare")

QUICK_VARIANTS = ("grpo", "epgrpo", "entropy_top20", "dapo_dynamic", "dapo_dynamic_samples",
                  "gspo", "overlong_mask", "overlong_penalty")
# `--quick`: checks the pipeline, not the result. Applied before the user's overrides.
QUICK_ROW_OVERRIDES = ("train.steps=1",)  # `--quick`: the rival rows, after the shared ones
QUICK_OVERRIDES = ("train.steps=3", "data.heldout_limit=16", "logging.progress=false",
                   "logging.tensorboard=false", "logging.samples_every=0")


# ----------------------------------------------------------------------------
# Running


def run_one(plan: Plan, variant: Variant, seed: int, cfg: TrainConfig) -> dict[str, Any] | None:
  """Trains and evaluates one (variant, seed) unless its result.json exists; None if stopped."""
  run_dir = plan.run_dir(variant, seed)
  result_path = run_dir / "result.json"
  if result_path.is_file():
    print(f"[compare] {variant.name} seed {seed}: done already ({result_path})", flush=True)
    return json.loads(result_path.read_text())
  if run_dir.exists() and not any((run_dir / "checkpoints").glob("[0-9]*")):
    shutil.rmtree(run_dir)  # killed before its first checkpoint: its log would mix two runs
  t0 = time.perf_counter()
  resolved = resolve_embedded(cfg, progress=cfg.logging.progress)
  warm_seconds = time.perf_counter() - t0
  print(f"[compare] {variant.name} seed {seed}: training {cfg.train.steps} steps -> {run_dir}",
        flush=True)
  t0, cpu0 = time.perf_counter(), time.process_time()
  summary = train(resolved)
  seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - cpu0
  if "stopped_at" in summary or "heldout_after" not in summary:
    return None
  result = {
      "variant": variant.name, "label": variant.label, "seed": seed,
      "steps": summary.get("steps"), "seconds": round(seconds, 2),
      "cpu_seconds": round(cpu_seconds, 2),  # all threads of this process (not reward workers)
      "warm_start_seconds": round(warm_seconds, 2),
      "heldout_after": summary["heldout_after"],
      "heldout_before": summary.get("heldout_before"),
      **run_statistics(read_metrics(run_dir)),
      "model_path": resolved.model.path,
      "advantage": configlib.to_dict(cfg.advantage),
      "sampling_temperature": cfg.sampling.temperature,
      "num_generations": cfg.train.num_generations,
  }
  write_json(result_path, result)
  print(f"[compare] {variant.name} seed {seed}: acc {100 * result['heldout_after']['accuracy']:.1f}% "
        f"in {seconds:.0f}s", flush=True)
  return result


def load_results(plan: Plan) -> dict[str, list[dict]]:
  """variant name -> the results of its finished seeds."""
  out: dict[str, list[dict]] = {}
  for v in plan.variants:
    for s in plan.seeds:
      path = plan.run_dir(v, s) / "result.json"
      if path.is_file():
        out.setdefault(v.name, []).append(json.loads(path.read_text()))
  return out


# ----------------------------------------------------------------------------
# The command


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  p = commandline.ArgumentParser(prog="python -m epgrpo_jax.experiments.compare",
                         description=__doc__.splitlines()[0])
  p.add_argument("--out", type=path_flag,
                 help="output directory (default runs/compare, --quick: runs/compare-quick)")
  p.add_argument("--variants", help=f"comma-separated subset of {','.join(BY_NAME)} (default all; "
                 f"--quick: {','.join(QUICK_VARIANTS)})")
  p.add_argument("--seeds", type=int, help="seeds per variant (default 3; --quick: 1)")
  p.add_argument("--first-seed", type=int, default=1, help="train.seed of the first seed (default 1)")
  p.add_argument("--steps", type=int, help="RL steps of every run (default: the configs' train.steps)")
  p.add_argument("--eval-samples", type=int, default=16, help="samples per held-out problem")
  p.add_argument("--config-dir", type=path_flag, default=str(CONFIG_DIR),
                 help="where the variant YAML files are")
  p.add_argument("--quick", action="store_true",
                 help="CI setting: GRPO, EP-GRPO (3 steps) and the rival rows (1 step), 1 seed")
  p.add_argument("--report-only", action="store_true", help="only rebuild the report from results")
  p.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
  p.add_argument("overrides", nargs="*", metavar="key=value",
                 help="overrides shared by every run, e.g. embedded.sft_steps=200")
  args = p.parse_args(argv)
  names = ([n.strip() for n in args.variants.split(",") if n.strip()] if args.variants
           else list(QUICK_VARIANTS if args.quick else BY_NAME))
  unknown = [n for n in names if n not in BY_NAME]
  if unknown or not names:
    p.error(f"--variants: unknown {unknown}; use some of {','.join(BY_NAME)}")
  args.variants = names
  args.seeds = args.seeds if args.seeds is not None else (1 if args.quick else 3)
  for name in ("seeds", "eval_samples"):
    if getattr(args, name) < 1:
      p.error(f"--{name.replace('_', '-')}: must be >= 1")
  if args.steps is not None and args.steps < 1:
    p.error("--steps: must be >= 1")
  args.out = args.out or ("runs/compare-quick" if args.quick else "runs/compare")
  return args


def make_plan(args: argparse.Namespace) -> Plan:
  shared = (*QUICK_OVERRIDES, *args.overrides) if args.quick else tuple(args.overrides)
  rows = (tuple((n, QUICK_ROW_OVERRIDES) for n in args.variants if n not in ("grpo", "epgrpo"))
          if args.quick and args.steps is None else ())
  return Plan(out=Path(args.out), variants=tuple(BY_NAME[n] for n in args.variants),
              seeds=tuple(args.first_seed + i for i in range(args.seeds)), steps=args.steps,
              eval_samples=args.eval_samples, shared=tuple(shared),
              config_dir=Path(args.config_dir), rows=rows)


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  commandline.setup_logging(args.debug)
  commandline.enable_compilation_cache()
  command = "python -m epgrpo_jax.experiments.compare " + " ".join(
      sys.argv[1:] if argv is None else list(argv))

  def run() -> int:
    plan = make_plan(args)
    cfgs = check_plan(plan)
    output_dir(plan.out, "--out")
    if not args.report_only:
      start = time.perf_counter()
      with shared_programs():  # the runs' samplers trace each program shape once
        for v in plan.variants:
          for s in plan.seeds:
            if run_one(plan, v, s, cfgs[(v.name, s)]) is None:
              print(f"[compare] stopped during {v.name} seed {s}; rerun the same command to "
                    f"resume", file=sys.stderr)
              return 130
      print(f"[compare] all runs done in {time.perf_counter() - start:.0f}s", flush=True)
    results = load_results(plan)
    curves = write_curves(plan, results)
    path = write_report(plan, results, curves, command)
    print(f"[compare] report: {path}", flush=True)
    return 0

  return commandline.run_main(run, debug=args.debug)


if __name__ == "__main__":
  sys.exit(main())
