"""The embedded default run (model.path=embedded): the arithmetic task and its tiny model,
warm-started once (then cached), as the run's model and data."""

from __future__ import annotations

import dataclasses

from epgrpo_jax.data import pipeline
from epgrpo_jax.tasks import arithmetic
from epgrpo_jax.training.config import EMBEDDED, TrainConfig


def resolve_embedded(cfg: TrainConfig, progress: bool = True) -> TrainConfig:
  """For model.path=embedded: builds the task and tiny model, warm-starts it, points cfg at them."""
  if cfg.model.path != EMBEDDED:
    return cfg
  e = cfg.embedded
  assets = arithmetic.build_assets(e.resolved_data_dir(), seed=e.seed)
  model_dir = arithmetic.warm_start(assets, steps=e.sft_steps, learning_rate=e.sft_learning_rate,
                                    batch_size=e.sft_batch_size, seed=e.seed, slip=e.sft_slip,
                                    progress=progress)
  data_cfg = cfg.data
  if not data_cfg.train_files:
    # The task's prompts are bare problems ("Compute 7*5-3*2."), as in the warm start.
    template = (arithmetic.PROMPT_TEMPLATE if data_cfg.prompt_template == pipeline.MATH_TEMPLATE
                else data_cfg.prompt_template)
    data_cfg = dataclasses.replace(data_cfg, train_files=(str(assets.train_file),),
                                   heldout_file=data_cfg.heldout_file or str(assets.heldout_file),
                                   heldout_limit=data_cfg.heldout_limit or e.heldout_problems,
                                   prompt_template=template)
  return cfg.replace(model=dataclasses.replace(cfg.model, path=str(model_dir)), data=data_cfg)
