"""The comparison tooling: variant configs, statistics, and the `--quick` pipeline end to end."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from epgrpo_jax.core.advantages import VARIANTS as ADVANTAGE_VARIANTS
from epgrpo_jax.io import configlib
from epgrpo_jax.io.configlib import ConfigError
from epgrpo_jax.experiments import compare, reporting, variants


@pytest.mark.parametrize("variant", variants.VARIANTS, ids=lambda v: v.name)
def test_variant_configs_resolve_to_their_switches(variant):
  cfg = variants.variant_config(variant, ["train.steps=7"])
  want = ADVANTAGE_VARIANTS[variant.advantage]
  assert cfg.advantage.entropy_gate == want["entropy_gate"]
  assert cfg.advantage.progress_signal == want["progress_signal"]
  if want["progress_signal"]:
    assert cfg.advantage.zero_variance_anchor == want["zero_variance_anchor"]
  assert cfg.train.steps == 7
  default = variants.variant_config(variants.BY_NAME["epgrpo"])
  expected_t = 1.2 if variant.name == "higher_temp" else default.sampling.temperature
  expected_g = 10 if variant.name == "more_rollouts" else default.train.num_generations
  assert cfg.sampling.temperature == expected_t
  assert cfg.train.num_generations == expected_g
  # Everything but the advantage switches, T, G, the output directory and each rival row's
  # own options equals EP-GRPO's.
  own = RIVAL_OPTIONS.get(variant.name, {})
  def rest(c):
    d = configlib.to_dict(c)
    del d["advantage"], d["sampling"]["temperature"], d["train"]["num_generations"]
    del d["train"]["output_dir"]
    for key in own:
      section, name = key.split(".")
      del d[section][name]
    return d
  assert rest(cfg) == rest(default.override("train.steps=7"))
  for key, value in own.items():
    section, name = key.split(".")
    assert getattr(getattr(cfg, section), name) == value, key


RIVAL_OPTIONS = {
    "entropy_top20": {"loss.top_entropy_quantile": 0.2},
    "dapo_dynamic": {"dynamic_sampling.enabled": True, "dynamic_sampling.max_extra_rounds": 2},
    "dapo_dynamic_samples": {"dynamic_sampling.enabled": True,
                             "dynamic_sampling.max_extra_rounds": 2},
    "gspo": {"loss.importance_sampling_level": "sequence", "loss.eps_low": 3e-4,
             "loss.eps_high": 4e-4, "loss.aggregation": "seq_mean_token_mean"},
    "overlong_mask": {"loss.mask_truncated_completions": True},
    "overlong_penalty": {"reward.overlong_buffer": 16, "reward.overlong_penalty_factor": 1.0},
}


def test_variant_config_rejects_wrong_switches():
  with pytest.raises(ConfigError, match="advantage switches"):
    variants.variant_config(variants.BY_NAME["grpo"], ["advantage.entropy_gate=true"])


def test_check_plan_requires_the_same_budget(tmp_path):
  args = compare.parse_args(["--variants", "grpo,eg", "--seeds", "1", "--out", str(tmp_path)])
  plan = compare.make_plan(args)
  assert len(variants.check_plan(plan)) == 2
  (tmp_path / "cfg").mkdir()
  for name in ("grpo.yaml", "eg.yaml"):
    text = (compare.CONFIG_DIR / name).read_text()
    if name == "eg.yaml":  # a different step budget (a key given twice would be an error)
      text = text.replace("train: {", "train: {steps: 3, ")
      assert "steps: 3" in text
    (tmp_path / "cfg" / name).write_text(text)
  plan = compare.make_plan(compare.parse_args(["--variants", "grpo,eg", "--seeds", "1",
                                               "--out", str(tmp_path), "--config-dir",
                                               str(tmp_path / "cfg")]))
  with pytest.raises(ConfigError, match="train.steps: differs"):
    variants.check_plan(plan)


def test_same_sample_budget_row_and_quick_rows(tmp_path):
  plan = compare.make_plan(compare.parse_args(["--variants", "grpo,dapo_dynamic_samples",
                                               "--steps", "5", "--out", str(tmp_path)]))
  cfgs = variants.check_plan(plan)
  assert cfgs[("grpo", 1)].train.max_samples == 0
  assert cfgs[("dapo_dynamic_samples", 1)].train.max_samples == 5 * 8 * 8  # steps x P x G
  quick = compare.make_plan(compare.parse_args(["--quick", "--out", str(tmp_path)]))
  cfgs = variants.check_plan(quick)  # the rival rows' single step is not a budget mismatch
  assert {n: c.train.steps for (n, _), c in cfgs.items()} == {
      n: 3 if n in ("grpo", "epgrpo") else 1 for n in compare.QUICK_VARIANTS}
  assert cfgs[("dapo_dynamic_samples", 1)].train.max_samples == 8 * 8


def test_zero_variance_stats_and_difference():
  records = [{"step": 1, "frac_reward_zero_std": 0.0, "ep/zero_variance_token_frac": 0.0},
             {"step": 2, "frac_reward_zero_std": 0.5, "ep/zero_variance_token_frac": 0.4},
             {"step": 2, "heldout/accuracy": 0.3},
             {"step": 3, "frac_reward_zero_std": 0.25, "ep/zero_variance_token_frac": 0.2},
             {"step": 3, "frac_reward_zero_std": 0.25, "ep/zero_variance_token_frac": 0.2}]
  z = reporting.zero_variance_stats(reporting.step_records(records))
  assert z["steps_with_zero_variance"] == pytest.approx(2 / 3)
  assert z["zero_variance_group_frac"] == pytest.approx(0.25)
  assert z["zero_variance_token_frac"] == pytest.approx(0.2)
  a = reporting.mean_std([0.5, 0.6, 0.7])
  b = reporting.mean_std([0.1, 0.2, 0.3])
  d, significant = reporting.difference(a, b)
  assert d == pytest.approx(0.4) and significant
  d, significant = reporting.difference(reporting.mean_std([0.5]), b)
  assert significant is None
  assert reporting.mean_std([None, 0.2])["n"] == 1


QUICK_ARGS = ("embedded.sft_steps=10", "embedded.sft_batch_size=8", "train.prompts_per_step=4",
              "train.num_generations=4", "sampling.max_new_tokens=32", "data.heldout_limit=8",
              "eval.prompts_per_batch=8", "checkpoint.keep=1")


@pytest.mark.slow
def test_quick_comparison_writes_report_and_resumes(tmp_path, capsys):
  out = tmp_path / "out"
  argv = ["--quick", "--out", str(out), f"embedded.data_dir={tmp_path / 'data'}", *QUICK_ARGS]
  assert compare.main(argv) == 0
  results = {}
  assert set(RIVAL_OPTIONS) < set(compare.QUICK_VARIANTS)  # the rival rows run in CI
  for name in compare.QUICK_VARIANTS:
    path = out / "runs" / name / "seed1" / "result.json"
    results[name] = json.loads(path.read_text())
    r = results[name]
    steps = 3 if name in ("grpo", "epgrpo") else 1  # the rival rows: one step in --quick
    assert r["steps"] == steps and r["seed"] == 1
    for key in reporting.EVAL_KEYS:
      assert 0.0 <= r["heldout_after"][key] <= 1.0, key
    assert 0.0 <= r["zero_variance"]["steps_with_zero_variance"] <= 1.0
    assert r["logged_steps"] == steps
  dynamic = results["dapo_dynamic"]["rival"]
  assert dynamic["dynamic/extra_prompts"] in (0, 4, 8)  # P = 4 prompts per extra round
  assert dynamic["num_samples"] == 16 * (1 + dynamic["dynamic/extra_prompts"] / 4)
  assert 0 < results["entropy_top20"]["rival"]["entropy_mask/kept_frac"] <= 1
  assert results["grpo"]["heldout_before"] is not None
  assert results["epgrpo"]["heldout_before"] is None
  assert results["grpo"]["model_path"] == results["epgrpo"]["model_path"]  # one warm start

  summary = json.loads((out / "summary.json").read_text())
  assert set(summary["variants"]) == set(compare.QUICK_VARIANTS)
  acc = summary["variants"]["epgrpo"]["eval"]["accuracy"]
  assert acc["n"] == 1 and acc["mean"] == pytest.approx(results["epgrpo"]["heldout_after"]["accuracy"])

  report = (out / "results.md").read_text()
  assert "| Method | Acc | Fmt | pass@4 | pass@8 | pass@16 | ΔAcc vs GRPO | seeds |" in report
  rows = [l for l in report.splitlines() if l.startswith(("| GRPO |", "| EP-GRPO |"))]
  assert len(rows) >= 4  # in the Table II and Table IV shapes (and the other tables)
  number = re.compile(r"^-?\d+\.\d( ± \d+\.\d)?$")
  for row in rows[:2]:
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert all(number.match(c) for c in cells[1:6]), row
  assert "Zero-variance statistics" in report and "58.77%" in report
  assert "## Rival methods (issue 25)" in report and "| GSPO |" in report
  png = out / "curves" / "curves.png"
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert (out / "curves" / "frac_reward_zero_std.png").is_file()

  # A rerun trains nothing and rebuilds the same report.
  mtimes = {n: (out / "runs" / n / "seed1" / "result.json").stat().st_mtime_ns for n in results}
  capsys.readouterr()
  assert compare.main(argv) == 0
  printed = capsys.readouterr().out
  assert printed.count("done already") == len(results) and "training" not in printed
  assert {n: (out / "runs" / n / "seed1" / "result.json").stat().st_mtime_ns
          for n in results} == mtimes
  assert np.isclose(json.loads((out / "summary.json").read_text())["variants"]["epgrpo"]["eval"]
                    ["accuracy"]["mean"], acc["mean"])
