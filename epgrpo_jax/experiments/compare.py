"""The small-scale reproduction of the paper's Tables II and IV on the embedded task.

    python -m epgrpo_jax.experiments.compare [--out DIR] [--seeds 3] [--steps N]
        [--variants grpo,epgrpo,...] [--eval-samples 16] [--quick] [--report-only]
        [key=value ...]

Trains every variant (GRPO, Higher Temp, More Rollouts, +EG, +IPS, +EG+IPS,
+IPS+ZVD, EP-GRPO, and the rival rows below) for each of N seeds
(`train.seed` = first seed + i) from the same warm-started model and data with
the same step budget, each by calling `epgrpo_jax.training.trainer.train` on
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
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from epgrpo_jax.io import commandline
from epgrpo_jax.io import configlib
from epgrpo_jax.io.atomic import write_text_atomic
from epgrpo_jax.core.advantages import VARIANTS as ADVANTAGE_VARIANTS
from epgrpo_jax.training.config import CONFIG_DIR, TrainConfig

log = logging.getLogger("epgrpo_jax.experiments.compare")


@dataclasses.dataclass(frozen=True)
class Variant:
  """One row of the comparison: a config file and the advantage switches it must resolve to."""

  name: str  # key and directory name
  label: str  # table label (the paper's name)
  config: str  # file in the config directory
  advantage: str  # key of `advantages.VARIANTS` that the config's switches must equal
  # Stop at the completions a plain step budget samples (train.max_samples = steps x P x G):
  # a method that samples more per step (dynamic sampling) then gets the same sample budget.
  same_samples: bool = False


VARIANTS: tuple[Variant, ...] = (
    Variant("grpo", "GRPO", "grpo.yaml", "grpo"),
    Variant("higher_temp", "Higher Temp (T=1.2)", "higher_temp.yaml", "grpo"),
    Variant("more_rollouts", "More Rollouts (G=10)", "more_rollouts.yaml", "grpo"),
    Variant("eg", "+EG", "eg.yaml", "eg"),
    Variant("ips", "+IPS", "ips.yaml", "ips"),
    Variant("eg_ips", "+EG+IPS", "eg_ips.yaml", "eg_ips"),
    Variant("ips_zvd", "+IPS+ZVD", "ips_zvd.yaml", "ips_zvd"),
    Variant("epgrpo", "EP-GRPO", "default.yaml", "epgrpo"),
    # The other fixes of entropy and zero-variance groups (issue 25), each on GRPO's advantage.
    Variant("entropy_top20", "80/20 (top-20% entropy tokens)", "entropy_top20.yaml", "grpo"),
    Variant("dapo_dynamic", "DAPO dynamic sampling (same steps)", "dapo_dynamic.yaml", "grpo"),
    Variant("dapo_dynamic_samples", "DAPO dynamic sampling (same samples)", "dapo_dynamic.yaml",
            "grpo", same_samples=True),
    Variant("gspo", "GSPO", "gspo.yaml", "grpo"),
    Variant("overlong_mask", "DAPO overlong filtering", "overlong_mask.yaml", "grpo"),
    Variant("overlong_penalty", "DAPO soft overlong punishment", "overlong_penalty.yaml", "grpo"),
)
BY_NAME = {v.name: v for v in VARIANTS}
TABLE_II = ("grpo", "higher_temp", "more_rollouts", "epgrpo")
TABLE_IV = ("grpo", "eg", "ips", "eg_ips", "ips_zvd", "epgrpo")
RIVALS = ("grpo", "entropy_top20", "dapo_dynamic", "dapo_dynamic_samples", "gspo",
          "overlong_mask", "overlong_penalty", "epgrpo")
BASELINE = "grpo"
QUICK_VARIANTS = ("grpo", "epgrpo", "entropy_top20", "dapo_dynamic", "dapo_dynamic_samples",
                  "gspo", "overlong_mask", "overlong_penalty")
# `--quick`: checks the pipeline, not the result. Applied before the user's overrides.
QUICK_ROW_OVERRIDES = ("train.steps=1",)  # `--quick`: the rival rows, after the shared ones
QUICK_OVERRIDES = ("train.steps=3", "data.heldout_limit=16", "logging.progress=false",
                   "logging.tensorboard=false", "logging.samples_every=0")
EVAL_KEYS = ("accuracy", "format", "pass@4", "pass@8", "pass@16")
EVAL_LABELS = {"accuracy": "Acc", "format": "Fmt", "pass@4": "pass@4", "pass@8": "pass@8",
               "pass@16": "pass@16"}
ZV_KEYS = (("steps_with_zero_variance", "steps with a zero-variance group"),
           ("zero_variance_group_frac", "zero-variance groups"),
           ("zero_variance_token_frac", "tokens in zero-variance groups"),
           ("anchor_group_frac", "groups with an anchor (ZVD)"))
DIAG_KEYS = (("ep/gate_mean", "gate W mean"), ("ep/gate_std", "gate W std"),
             ("ep/polarity_flip_frac", "polarity flips"),
             ("ep/outcome_adv_abs_mean", "mean abs A outcome"),
             ("ep/progress_adv_abs_mean", "mean abs A progress"),
             ("kl", "KL"), ("entropy", "entropy"), ("completions/mean_length", "length"))
# Per-step statistics of the rival methods (issue 25), means over the training steps.
RIVAL_KEYS = (("num_samples", "completions sampled (run)"),
              ("dynamic/extra_prompts", "extra prompts / step"),
              ("dynamic/dropped_groups", "dropped groups / step"),
              ("dynamic/filled_zero_variance_groups", "zero-variance fill / step"),
              ("entropy_mask/kept_frac", "tokens with a PG term"),
              ("completions/clipped_ratio", "truncated"),
              ("overlong/penalty_mean", "overlong penalty"))
PAPER_NOTE = ("Paper (Qwen2.5-3B, MATH, G=8): 58.77% of GRPO training steps contained a "
              "zero-variance group; EP-GRPO beat GRPO by +4.79 points of average Acc (Table II).")


# ----------------------------------------------------------------------------
# Configs


def variant_config(variant: Variant, overrides: Sequence[str] = (),
                   config_dir: str | Path = CONFIG_DIR) -> TrainConfig:
  """The variant's TrainConfig (its file, then `overrides`), checked against its switches."""
  # TrainConfig's defaults equal configs/default.yaml: a config dir may leave it out.
  data = configlib.load_yaml(Path(config_dir) / variant.config, flag="--config-dir",
                             default_base="default.yaml")
  cfg = configlib.build(TrainConfig, configlib.deep_merge(data, configlib.parse_overrides(
      list(overrides))))
  want = ADVANTAGE_VARIANTS[variant.advantage]
  got = {k: getattr(cfg.advantage, k) for k in want}
  if want["progress_signal"] is False:  # the anchor is unused without the progress signal
    want, got = ({k: v for k, v in d.items() if k != "zero_variance_anchor"} for d in (want, got))
  if got != want:
    raise configlib.ConfigError(f"{variant.config}: advantage switches {got} are not those of "
                                f"{variant.label} {want}")
  return cfg


def run_overrides(variant: Variant, seed: int, run_dir: Path, *, eval_samples: int,
                  steps: int | None, shared: Sequence[str],
                  row: Sequence[str] = ()) -> list[str]:
  """The overrides of one (variant, seed) run: the shared ones, the row's, then the run's own."""
  own = [*row, f"train.seed={seed}", f"train.output_dir={run_dir}", f"eval.samples={eval_samples}",
         "eval.after=true", f"eval.before={str(variant.name == BASELINE).lower()}"]
  if steps is not None:
    own.append(f"train.steps={steps}")
  return [*shared, *own]


# ----------------------------------------------------------------------------
# Statistics of one run


def step_records(records: Sequence[dict]) -> list[dict]:
  """The training-step records (last logged per step: a resumed run logs some twice), by step."""
  by_step: dict[int, dict] = {}
  for r in records:
    if "frac_reward_zero_std" in r:
      by_step[int(r["step"])] = r
  return [by_step[s] for s in sorted(by_step)]


def _mean(records: Sequence[dict], key: str) -> float | None:
  values = [float(r[key]) for r in records if isinstance(r.get(key), (int, float))]
  values = [v for v in values if math.isfinite(v)]
  return float(np.mean(values)) if values else None


def zero_variance_stats(steps: Sequence[dict]) -> dict[str, float | None]:
  """Fig 2(c/d): share of steps with a zero-variance group, of such groups and of their tokens."""
  frac = np.array([float(r["frac_reward_zero_std"]) for r in steps])
  return {
      "steps_with_zero_variance": float(np.mean(frac > 0)) if len(frac) else None,
      "zero_variance_group_frac": float(frac.mean()) if len(frac) else None,
      "zero_variance_token_frac": _mean(steps, "ep/zero_variance_token_frac"),
      "anchor_group_frac": _mean(steps, "ep/anchor_groups_frac"),
  }


def run_statistics(records: Sequence[dict]) -> dict[str, Any]:
  """Zero-variance statistics, mean diagnostics and first/last-quarter reward of a run."""
  steps = step_records(records)
  q = max(len(steps) // 4, 1)
  rival = {key: _mean(steps, key) for key, _ in RIVAL_KEYS}
  rival["num_samples"] = float(steps[-1]["num_samples"]) if steps and "num_samples" in steps[-1] \
      else None
  return {
      "zero_variance": zero_variance_stats(steps),
      "diagnostics": {key: _mean(steps, key) for key, _ in DIAG_KEYS},
      "rival": rival,
      "train_reward_first_quarter": _mean(steps[:q], "reward"),
      "train_reward_last_quarter": _mean(steps[-q:], "reward"),
      "logged_steps": len(steps),
  }


def _write_json(path: Path, obj: Any) -> None:
  write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


# ----------------------------------------------------------------------------
# Running


@dataclasses.dataclass(frozen=True)
class Plan:
  out: Path
  variants: tuple[Variant, ...]
  seeds: tuple[int, ...]
  steps: int | None
  eval_samples: int
  shared: tuple[str, ...]
  config_dir: Path
  rows: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (variant name, its own overrides)

  def run_dir(self, variant: Variant, seed: int) -> Path:
    return self.out / "runs" / variant.name / f"seed{seed}"

  def config(self, variant: Variant, seed: int) -> TrainConfig:
    cfg = variant_config(variant, run_overrides(
        variant, seed, self.run_dir(variant, seed), eval_samples=self.eval_samples,
        steps=self.steps, shared=self.shared, row=dict(self.rows).get(variant.name, ())),
        self.config_dir)
    if variant.same_samples:
      t = cfg.train
      cfg = cfg.override(f"train.max_samples={t.steps * t.prompts_per_step * t.num_generations}")
    return cfg


def check_plan(plan: Plan) -> dict[tuple[str, int], TrainConfig]:
  """Every run's config, checked to share the step budget, model and data (before any work).

  Rows with their own overrides (`--quick`'s rival rows) are exempt from the step budget.
  """
  cfgs = {(v.name, s): plan.config(v, s) for v in plan.variants for s in plan.seeds}
  own = dict(plan.rows)
  for field, get in (("train.steps", lambda c: c.train.steps),
                     ("model.path", lambda c: c.model.path),
                     ("embedded", lambda c: c.embedded),
                     ("data.train_files", lambda c: c.data.train_files),
                     ("data.heldout_file", lambda c: c.data.heldout_file),
                     ("data.heldout_limit", lambda c: c.data.heldout_limit),
                     ("train.prompts_per_step", lambda c: c.train.prompts_per_step),
                     ("eval", lambda c: dataclasses.replace(c.eval, before=False))):
    values = {k: get(c) for k, c in cfgs.items() if field != "train.steps" or k[0] not in own}
    if len(set(map(repr, values.values()))) > 1:
      detail = ", ".join(f"{n}/seed{s}: {v}" for (n, s), v in list(values.items())[:4])
      raise configlib.ConfigError(f"{field}: differs between the variants ({detail}); the "
                                  f"comparison needs the same budget, model and data")
  return cfgs


def run_one(plan: Plan, variant: Variant, seed: int, cfg: TrainConfig) -> dict[str, Any] | None:
  """Trains and evaluates one (variant, seed) unless its result.json exists; None if stopped."""
  from epgrpo_jax.io.metrics import read_metrics
  from epgrpo_jax.training.trainer import resolve_embedded, train

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
  _write_json(result_path, result)
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
# Aggregation and the report


def mean_std(values: Sequence[float | None]) -> dict[str, float | int | None]:
  """Mean, sample std (ddof=1; 0 for one value) and count of the values that are not None."""
  v = np.array([x for x in values if x is not None], np.float64)
  if not len(v):
    return {"mean": None, "std": None, "n": 0}
  return {"mean": float(v.mean()), "std": float(v.std(ddof=1)) if len(v) > 1 else 0.0,
          "n": int(len(v))}


def aggregate(results: dict[str, list[dict]]) -> dict[str, dict[str, Any]]:
  """Per variant: mean ± std over seeds of every eval metric, statistic and the run time."""
  out = {}
  for name, runs in results.items():
    agg: dict[str, Any] = {"label": BY_NAME[name].label if name in BY_NAME else name,
                           "seeds": [r["seed"] for r in runs]}
    agg["eval"] = {k: mean_std([r["heldout_after"].get(k) for r in runs]) for k in EVAL_KEYS}
    agg["zero_variance"] = {k: mean_std([r["zero_variance"].get(k) for r in runs])
                            for k, _ in ZV_KEYS}
    agg["diagnostics"] = {k: mean_std([r["diagnostics"].get(k) for r in runs]) for k, _ in DIAG_KEYS}
    agg["rival"] = {k: mean_std([r.get("rival", {}).get(k) for r in runs]) for k, _ in RIVAL_KEYS}
    agg["steps"] = mean_std([r.get("steps") for r in runs])
    agg["seconds"] = mean_std([r["seconds"] for r in runs])
    agg["cpu_seconds"] = mean_std([r.get("cpu_seconds") for r in runs])
    agg["train_reward_first_quarter"] = mean_std([r["train_reward_first_quarter"] for r in runs])
    agg["train_reward_last_quarter"] = mean_std([r["train_reward_last_quarter"] for r in runs])
    before = [r["heldout_before"] for r in runs if r.get("heldout_before")]
    if before:
      agg["eval_before"] = {k: mean_std([b.get(k) for b in before]) for k in EVAL_KEYS}
    out[name] = agg
  return out


def _pct(s: dict | None, digits: int = 1) -> str:
  if not s or s["mean"] is None:
    return "–"
  if s["n"] > 1:
    return f"{100 * s['mean']:.{digits}f} ± {100 * s['std']:.{digits}f}"
  return f"{100 * s['mean']:.{digits}f}"


def _num(s: dict | None, digits: int = 3) -> str:
  if not s or s["mean"] is None:
    return "–"
  if s["n"] > 1:
    return f"{s['mean']:.{digits}f} ± {s['std']:.{digits}f}"
  return f"{s['mean']:.{digits}f}"


def difference(a: dict, b: dict) -> tuple[float | None, bool | None]:
  """(mean a - mean b, whether it exceeds twice its standard error); None where undefined.

  The standard error is Welch's sqrt(s_a^2 / n_a + s_b^2 / n_b); it needs two
  seeds on each side.
  """
  if a["mean"] is None or b["mean"] is None:
    return None, None
  d = a["mean"] - b["mean"]
  if a["n"] < 2 or b["n"] < 2:
    return d, None
  se = math.sqrt(a["std"] ** 2 / a["n"] + b["std"] ** 2 / b["n"])
  return d, abs(d) > 2 * se if se > 0 else d != 0


def _delta(agg: dict, name: str, key: str = "accuracy") -> str:
  if name == BASELINE or BASELINE not in agg:
    return ""
  d, significant = difference(agg[name]["eval"][key], agg[BASELINE]["eval"][key])
  if d is None:
    return "–"
  mark = {True: " *", False: "", None: " (n/a)"}[significant]
  return f"{100 * d:+.1f}{mark}"


def eval_table(agg: dict, names: Sequence[str], *, switches: bool = False,
               before: dict | None = None) -> list[str]:
  head = ["Method"] + (["EG", "IPS", "ZVD"] if switches else [])
  head += [EVAL_LABELS[k] for k in EVAL_KEYS] + ["ΔAcc vs GRPO", "seeds"]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  if before is not None:
    row = ["Warm start (before RL)"] + ([""] * 3 if switches else [])
    row += [_pct(before.get(k)) for k in EVAL_KEYS] + ["", str(before["accuracy"]["n"])]
    lines.append("| " + " | ".join(row) + " |")
  for name in names:
    if name not in agg:
      continue
    a = agg[name]
    row = [a["label"]]
    if switches:
      sw = ADVANTAGE_VARIANTS[BY_NAME[name].advantage]
      row += ["✓" if sw[k] else "" for k in ("entropy_gate", "progress_signal",
                                             "zero_variance_anchor")]
    row += [_pct(a["eval"][k]) for k in EVAL_KEYS] + [_delta(agg, name), str(len(a["seeds"]))]
    lines.append("| " + " | ".join(row) + " |")
  return lines


def write_report(plan: Plan, results: dict[str, list[dict]], curves: dict[str, Path] | None,
                 command: str) -> Path:
  """results.md and summary.json from the finished runs."""
  agg = aggregate(results)
  _write_json(plan.out / "summary.json", {"plan": {
      "variants": [v.name for v in plan.variants], "seeds": list(plan.seeds),
      "steps": plan.steps, "eval_samples": plan.eval_samples, "overrides": list(plan.shared),
      "command": command}, "variants": agg, "runs": results})
  missing = [f"{v.name}/seed{s}" for v in plan.variants for s in plan.seeds
             if not (plan.run_dir(v, s) / "result.json").is_file()]
  names = [v.name for v in plan.variants]
  any_run = next((r for runs in results.values() for r in runs), None)
  steps = any_run["steps"] if any_run else plan.steps
  before = agg.get(BASELINE, {}).get("eval_before")
  L = ["# EP-GRPO vs GRPO on the embedded task", "",
       f"Command: `{command}`", "",
       f"{len(plan.seeds)} seed(s) per variant ({', '.join(map(str, plan.seeds))}), {steps} RL "
       f"steps each from the same warm start; held-out evaluation of the final policy with "
       f"{plan.eval_samples} samples per problem. Values are % (mean ± std over seeds, "
       f"std with ddof=1). ΔAcc: difference to GRPO in points; * marks a difference larger than "
       f"twice its standard error (Welch, sqrt(s1²/n1 + s2²/n2)); n/a: fewer than 2 seeds.", ""]
  if missing:
    L += [f"**Incomplete:** {len(missing)} run(s) not finished: {', '.join(missing)}.", ""]
  table_ii = [n for n in TABLE_II if n in names]
  table_iv = [n for n in TABLE_IV if n in names]
  L += ["## Main comparison (shape of Table II)", "", *eval_table(agg, table_ii, before=before), ""]
  L += ["## Ablation (shape of Table IV)", "", *eval_table(agg, table_iv, switches=True), ""]
  rivals = [n for n in RIVALS if n in names]
  if any(n not in TABLE_II and n not in TABLE_IV for n in rivals):
    L += ["## Rival methods (issue 25)", "",
          "Other fixes of the same two problems, each on GRPO's advantage with every EP-GRPO "
          "switch off: high-entropy token selection (80/20), DAPO dynamic sampling at the same "
          "step budget and at the same sample budget (the run stops once it has sampled as many "
          "completions as the step budget gives GRPO), GSPO, DAPO overlong filtering and soft "
          "overlong punishment.", "", *eval_table(agg, rivals), ""]
    head = ["Method", "steps run"] + [label for _, label in RIVAL_KEYS]
    L += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in rivals:
      if name in agg:
        a = agg[name]
        digits = lambda k: 0 if k == "num_samples" else 3
        row = [a["label"], _num(a["steps"], 1)] + [_num(a["rival"][k], digits(k))
                                                   for k, _ in RIVAL_KEYS]
        L.append("| " + " | ".join(row) + " |")
    L.append("")
  others = [n for n in names if n not in TABLE_II and n not in TABLE_IV and n not in RIVALS]
  if others:
    L += ["## Other variants", "", *eval_table(agg, others), ""]
  L += ["## Zero-variance statistics (Fig 2c/d)", "",
        "Over the training steps of each run: the share of steps with at least one group whose "
        "rewards are all equal (`frac_reward_zero_std` > 0), the mean share of such groups, the "
        "mean share of response tokens in them (`ep/zero_variance_token_frac`), and the share of "
        "groups given a nonzero anchor (`ep/anchor_groups_frac`; ZVD variants only).", ""]
  head = ["Method"] + [label for _, label in ZV_KEYS]
  L += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for name in names:
    if name in agg:
      L.append("| " + " | ".join([agg[name]["label"]] + [_pct(agg[name]["zero_variance"][k])
                                                         for k, _ in ZV_KEYS]) + " |")
  L += ["", PAPER_NOTE, ""]
  L += ["## Advantage diagnostics (means over training steps)", ""]
  head = ["Method"] + [label for _, label in DIAG_KEYS] + ["train reward, first → last quarter"]
  L += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for name in names:
    if name in agg:
      a = agg[name]
      row = [a["label"]] + [_num(a["diagnostics"][k]) for k, _ in DIAG_KEYS]
      row.append(f"{_num(a['train_reward_first_quarter'])} → {_num(a['train_reward_last_quarter'])}")
      L.append("| " + " | ".join(row) + " |")
  L += ["", "## Run time", "",
        "Per run, training and final evaluation (the warm start is built once, before): wall "
        "clock, and CPU time of the training process (all its threads; a fairer measure on a "
        "shared machine).", "",
        "| Method | wall seconds per run | CPU seconds per run | seeds |", "|---|---|---|---|"]
  for name in names:
    if name in agg:
      L.append(f"| {agg[name]['label']} | {_num(agg[name]['seconds'], 1)} | "
               f"{_num(agg[name]['cpu_seconds'], 1)} | {len(agg[name]['seeds'])} |")
  if curves:
    L += ["", "## Curves (mean over seeds)", ""]
    for key, path in curves.items():
      L.append(f"![{key}]({path.relative_to(plan.out).as_posix()})")
  path = plan.out / "results.md"
  path.write_text("\n".join(L) + "\n")
  return path


def seed_mean_records(run_dirs: Sequence[Path]) -> list[dict]:
  """One record per step with the mean over runs of every numeric metric logged at that step."""
  from epgrpo_jax.io.metrics import read_metrics
  by_step: dict[int, dict[str, list[float]]] = {}
  for d in run_dirs:
    latest: dict[int, dict] = {}  # per step and kind (train / held-out), the last record
    for r in read_metrics(d):
      latest[(int(r["step"]), "heldout" if any(k.startswith("heldout/") for k in r) else "")] = r
    for (step, _), r in latest.items():
      slot = by_step.setdefault(step, {})
      for k, v in r.items():
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
          slot.setdefault(k, []).append(float(v))
  return [{"step": s, **{k: float(np.mean(v)) for k, v in by_step[s].items()}}
          for s in sorted(by_step)]


def write_curves(plan: Plan, results: dict[str, list[dict]]) -> dict[str, Path]:
  """Seed-averaged metrics per variant (curves/data/<variant>/metrics.jsonl), overlaid by plot."""
  from epgrpo_jax.tools import plot
  dirs, names = [], []
  for v in plan.variants:
    runs = results.get(v.name)
    if not runs:
      continue
    d = plan.out / "curves" / "data" / v.name
    d.mkdir(parents=True, exist_ok=True)
    records = seed_mean_records([plan.run_dir(v, r["seed"]) for r in runs])
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    dirs.append(d)
    names.append(v.label)
  if not dirs:
    return {}
  panels = (*plot.PANELS, plot.Panel("ep/zero_variance_token_frac", "Tokens in zero-variance groups",
                                     "response tokens (%)", percent=True))
  return plot.plot_runs(dirs, plan.out / "curves", names=names, panels=panels)


# ----------------------------------------------------------------------------
# The command


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  p = commandline.ArgumentParser(prog="python -m epgrpo_jax.experiments.compare",
                         description=__doc__.splitlines()[0])
  p.add_argument("--out", help="output directory (default runs/compare, --quick: runs/compare-quick)")
  p.add_argument("--variants", help=f"comma-separated subset of {','.join(BY_NAME)} (default all; "
                 f"--quick: {','.join(QUICK_VARIANTS)})")
  p.add_argument("--seeds", type=int, help="seeds per variant (default 3; --quick: 1)")
  p.add_argument("--first-seed", type=int, default=1, help="train.seed of the first seed (default 1)")
  p.add_argument("--steps", type=int, help="RL steps of every run (default: the configs' train.steps)")
  p.add_argument("--eval-samples", type=int, default=16, help="samples per held-out problem")
  p.add_argument("--config-dir", default=str(CONFIG_DIR), help="where the variant YAML files are")
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
    plan.out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
      from epgrpo_jax.rollout.sampling import shared_programs
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
