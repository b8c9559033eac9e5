"""A fresh group for the heat map (`heatmap --checkpoint`): G responses to one problem sampled
from a run's latest checkpoint and scored as a training step would."""

from __future__ import annotations

import dataclasses
import math
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from epgrpo_jax.io.errors import MissingFileError, UserError
from epgrpo_jax.rewards import parse_gold

# The modules that import JAX are imported inside the functions, as in `heatmap`.

def sample_group(run_dir: str | Path, problem: str | None = None, answer: str | None = None, *,
                 num_samples: int | None = None, seed: int = 0) -> dict[str, Any]:
  """G fresh responses to `problem` from the run's latest checkpoint, scored, with the
  advantage and its components computed by `Trainer.step` itself (its update is discarded).

  The problem defaults to the run's first held-out problem; the answer to the one the run's
  data gives it. The run directory is only read: the trainer writes to a scratch directory.
  """
  # JAX-heavy imports, kept out of the command's fast paths (see the module's imports).
  from epgrpo_jax.data import pipeline
  from epgrpo_jax.evaluation.checkpoints import resolve_checkpoint
  from epgrpo_jax.io.checkpointing import restore_trainable
  from epgrpo_jax.training.config import load_config
  from epgrpo_jax.training.rollouts import sample_records
  from epgrpo_jax.training.trainer import Trainer

  run_dir = Path(run_dir)
  if not (run_dir / "config.yaml").is_file():
    raise MissingFileError(f"--checkpoint {run_dir}: no config.yaml (not a run directory)")
  cfg = load_config(run_dir / "config.yaml")
  G = num_samples or cfg.train.num_generations
  scratch = Path(tempfile.mkdtemp(prefix="epgrpo-heatmap-"))
  cfg = cfg.override(f"train.output_dir={scratch}", "logging.tensorboard=false",
                     "logging.progress=false", "logging.wandb_project=''",
                     "checkpoint.resume=false", "train.steps=1", "train.prompts_per_step=1",
                     f"train.num_generations={G}", "train.num_iterations=1",
                     "train.mini_batches=1", f"train.seed={seed}")
  trainer = Trainer(cfg, mesh=_mesh_for_rows(cfg, G))
  try:
    state = trainer.initial_state()
    step = 0
    try:
      ref = resolve_checkpoint(run_dir)
    except FileNotFoundError:
      print(f"note: {run_dir} has no checkpoint; sampling the initial policy", file=sys.stderr)
    else:
      step = ref.step
      state = dataclasses.replace(
          state, trainable=restore_trainable(ref.step_dir.parent, ref.step, state.trainable))
    known = {e.problem: e for e in trainer.heldout + trainer.train_examples}
    if problem is None:
      first = (trainer.heldout or trainer.train_examples)[0]
      problem, answer = first.problem, answer or first.answer
    if answer is None:
      if problem not in known:
        raise UserError("--answer: required for a problem that is not in the run's data")
      answer = known[problem].answer
    parse_gold(str(answer))  # fails early on an unusable answer
    example = pipeline.Example(id=known[problem].id if problem in known else "cli", problem=problem,
                           answer=str(answer), prompt_ids=tuple(trainer.renderer.ids(problem)))
    # The collect half of a step on this problem only: sample, reward, score and advantage
    # as in training (no update).
    record = trainer.collect(state, examples=[example]).record()
    return sample_records(step, record, 1, tokenizer=trainer.tokenizer)[0]
  finally:
    trainer.close()
    shutil.rmtree(scratch, ignore_errors=True)


def _mesh_for_rows(cfg, rows: int):
  """The run's mesh, or, when its data x fsdp shards do not divide the `rows` of one group,
  the same fsdp x tensor layout with fewer data shards (on a subset of the devices)."""
  import jax  # JAX-heavy, kept out of the command's fast paths (see the module's imports)

  from epgrpo_jax.parallel.sharding import MeshConfig, make_mesh
  data, fsdp, tensor = cfg.mesh.shape(jax.device_count())
  if rows % (data * fsdp) == 0:
    return make_mesh(cfg.mesh)
  if rows % fsdp or jax.process_count() > 1:
    raise UserError(f"--samples: {rows} responses are not divisible by the run's mesh.data x "
                     f"mesh.fsdp = {data} x {fsdp} batch shards; choose a multiple of "
                     f"{data * fsdp}")
  data = math.gcd(rows // fsdp, data)
  return make_mesh(MeshConfig(data=data, fsdp=fsdp, tensor=tensor),
                   devices=jax.devices()[:data * fsdp * tensor])
