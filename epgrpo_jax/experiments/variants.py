"""The rows of the comparison (`experiments.compare`): the variants, their configs, and the plan
of (variant, seed) runs, checked to share the step budget, model and data."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

from epgrpo_jax.core.advantages import VARIANTS as ADVANTAGE_VARIANTS
from epgrpo_jax.io import configlib
from epgrpo_jax.training.config import CONFIG_DIR, TrainConfig


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
  if cfg.advantage.estimator != "epgrpo":  # the switches below are the epgrpo estimator's
    raise configlib.ConfigError(f"{variant.config}: advantage.estimator is "
                                f"{cfg.advantage.estimator!r}; {variant.label} is 'epgrpo'")
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
# The plan


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
