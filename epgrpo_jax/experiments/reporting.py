"""Statistics of the comparison's runs and its report: results.md (tables shaped like the paper's
Tables II and IV, mean ± std over seeds, Welch differences to GRPO), summary.json, and the
seed-averaged curves."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from epgrpo_jax.core.advantages import VARIANTS as ADVANTAGE_VARIANTS
from epgrpo_jax.experiments.variants import BASELINE, BY_NAME, RIVALS, TABLE_II, TABLE_IV, Plan
from epgrpo_jax.io.atomic import write_text_atomic
from epgrpo_jax.io.metrics import read_metrics
from epgrpo_jax.tools import plot

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


def write_json(path: Path, obj: Any) -> None:
  write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


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
  write_json(plan.out / "summary.json", {"plan": {
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
