"""A run's pieces built from its config, before and around `Trainer`: the checks that run before
any weights load, the training and held-out data, the row length of packing, the model's runtime
options, and the step's optimizer, update plan, shardings and jitted programs (the trainer and
`tools/step_abstract.py` build them alike)."""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any, Callable

import jax
import optax

from epgrpo_jax.data import pipeline
from epgrpo_jax.io.atomic import check_output_paths
from epgrpo_jax.io.errors import UserError
from epgrpo_jax.models import ModelConfig
from epgrpo_jax.parallel import sharding
from epgrpo_jax.rewards import parse_gold
from epgrpo_jax.training.config import TrainConfig
from epgrpo_jax.training.objective import make_optimizer
from epgrpo_jax.training.programs import Policy, StepFunctions, StepShardings

log = logging.getLogger("epgrpo_jax.training.build")

# What a run writes in train.output_dir.
RUN_DIRS = ("checkpoints", "policy", "tensorboard")
RUN_FILES = ("config.yaml", "metrics.jsonl", "samples.jsonl", "summary.json")
JSONL_OUTPUTS = tuple(name for name in RUN_FILES if name.endswith(".jsonl"))  # appended per step


def check_run(cfg: TrainConfig, mesh: jax.sharding.Mesh, out_dir: Path) -> None:
  """Raises a one-line error if the mesh does not divide the step's rows, the output directory
  cannot be written or holds a path of the wrong kind, or the processes do not divide the
  prompts: everything about the run's shape that can be wrong before the model loads."""
  t = cfg.train
  check_rows(t, mesh)
  check_writable(out_dir)
  check_output_paths(out_dir, "train.output_dir", dirs=RUN_DIRS, files=RUN_FILES)
  if t.prompts_per_step % jax.process_count():
    raise UserError(f"train.prompts_per_step: {t.prompts_per_step} is not divisible by the "
                     f"{jax.process_count()} processes")


@dataclasses.dataclass
class RunData:
  """The training and held-out problems of a run, rendered to prompt ids."""

  renderer: pipeline.PromptRenderer
  train_examples: list[pipeline.Example]
  heldout: list[pipeline.Example]
  skips: Any  # the skipped rows' counts by reason


def load_data(cfg: TrainConfig, tokenizer) -> RunData:
  """`data.train_files` and `data.heldout_file` (at most `data.heldout_limit` problems), rows
  whose gold answer does not parse skipped and counted."""
  renderer = pipeline.PromptRenderer(tokenizer, cfg.data)
  train_examples, skips = pipeline.load_examples(cfg.data.train_files, renderer, cfg.data,
                                                 answer_ok=answer_parses)
  heldout: list[pipeline.Example] = []
  if cfg.data.heldout_file:
    heldout, heldout_skips = pipeline.load_examples([cfg.data.heldout_file], renderer, cfg.data,
                                                    answer_ok=answer_parses,
                                                    field="data.heldout_file")
    if cfg.data.heldout_limit:
      heldout = heldout[:cfg.data.heldout_limit]
    skips.update({f"heldout_{k}": v for k, v in heldout_skips.items()})
  return RunData(renderer, train_examples, heldout, skips)


def packing_length(cfg: TrainConfig, longest: int, context: int) -> int:
  """Tokens per packed row (`train.packing_length`, else the longest prompt plus
  `sampling.max_new_tokens`); raises if the longest prompt and its completion exceed the
  model's `context` or, under train.packing, a packed row."""
  t, new_tokens = cfg.train, cfg.sampling.max_new_tokens
  if longest + new_tokens > context:
    raise UserError(f"sampling.max_new_tokens: the longest prompt ({longest} tokens) plus "
                     f"{new_tokens} new tokens exceeds the model's context of "
                     f"{context} tokens")
  # A packed row holds any one sequence: a prompt and its completion, less its last token.
  length = t.packing_length or longest + new_tokens
  if t.packing and length < longest + new_tokens - 1:
    raise UserError(f"train.packing_length: {t.packing_length} tokens cannot hold the longest "
                     f"prompt plus sampling.max_new_tokens - 1 "
                     f"({longest + new_tokens - 1} tokens)")
  return length


@dataclasses.dataclass
class StepPrograms:
  """The optimizer and jitted programs of a run's step, and how they are laid out."""

  tx: optax.GradientTransformation
  schedule: Callable[[int], Any]  # the learning rate of an optimizer update
  fused: bool  # scoring, advantage and update as one program (`update_plan`)
  shardings: StepShardings
  fns: StepFunctions


def step_programs(cfg: TrainConfig, policy: Policy, mesh: jax.sharding.Mesh, *,
                  model_cfg: ModelConfig, warn: bool = False) -> StepPrograms:
  """AdamW over the run's optimizer updates, the update plan, the shardings of `policy` (its
  states, possibly abstract) on `mesh`, and the step functions over its graph."""
  t, o = cfg.train, cfg.optim
  tx, schedule = make_optimizer(
      o.learning_rate, t.steps * t.num_iterations * t.mini_batches, warmup_ratio=o.warmup_ratio,
      weight_decay=o.weight_decay, max_grad_norm=o.max_grad_norm, b1=o.b1, b2=o.b2, eps=o.eps)
  on_policy, fused = update_plan(t, mesh, warn=warn)
  if cfg.rollout.max_staleness and t.reuse_sampler_logprobs:
    on_policy = False  # batches sampled ahead: the ratio's pi_old is the sampler's mu (docs/async.md)
  shardings = StepShardings.create(policy, tx, mesh)
  fns = StepFunctions(policy.graphdef, tx, loss_cfg=cfg.loss,
                      temperature=cfg.sampling.temperature or 1.0, on_policy=on_policy,
                      model_cfg=model_cfg, shardings=shardings, remat=cfg.model.remat,
                      adv_cfg=cfg.advantage if fused else None)
  return StepPrograms(tx, schedule, fused, shardings, fns)


def check_writable(directory: Path) -> None:
  """Raises a one-line error unless `directory` can be created and written."""
  try:
    directory.mkdir(parents=True, exist_ok=True)
    probe = directory / f".write-test-{os.getpid()}"
    probe.write_text("")
    probe.unlink()
  except OSError as e:
    raise UserError(f"train.output_dir: not writable: {directory} ({e.strerror})") from None


def answer_parses(answer: str) -> bool:
  """Whether a row's gold answer parses (rows whose answer does not are skipped, counted)."""
  try:
    parse_gold(answer)
    return True
  except ValueError:
    return False


def check_rows(t, mesh: jax.sharding.Mesh) -> None:
  """Raises a config error unless the mesh's batch shards divide a step's sequences and each
  update's micro-batches (`train` section `t`)."""
  rows = t.prompts_per_step * t.num_generations
  sharding.check_batch(mesh, rows, "train.prompts_per_step x train.num_generations")
  if t.mini_batches * t.grad_accumulation > 1:
    sharding.check_batch(mesh, rows // (t.mini_batches * t.grad_accumulation),
                         "train.prompts_per_step x train.num_generations / "
                         "(train.mini_batches x train.grad_accumulation)")


def update_plan(t, mesh: jax.sharding.Mesh, *, warn: bool = False) -> tuple[bool, bool]:
  """(on_policy, fused) for the `train` section `t` on `mesh`: whether every update is the
  first and only one on its rollout, and whether scoring, advantage and update run as the one
  fused program (`objective.fused_update`) or as separate programs."""
  on_policy = t.num_iterations == 1 and t.mini_batches == 1
  # One program per on-policy update: the scoring pass is the update's own forward.
  fused = (t.fused_update and on_policy and t.grad_accumulation == 1
           and not t.reuse_sampler_logprobs)
  if fused and t.packing and mesh.shape["fsdp"] > 1 and mesh.shape["tensor"] > 1:
    # The packed fused program deadlocked in its collectives on XLA:CPU on such meshes
    # (docs/distributed.md, "Packing on a mesh"); the separate programs give the same update.
    if warn:
      log.warning("train.fused_update: separate programs, not one, with train.packing on a mesh "
                  "with fsdp %d and tensor %d > 1", mesh.shape["fsdp"], mesh.shape["tensor"])
    fused = False
  return on_policy, fused


def with_runtime_options(model, section):
  """The model with `model.remat`, `model.attention`, `model.attention_block` and
  `model.attention_segments` applied."""
  model.cfg = model.cfg.replace(remat=model.cfg.remat or section.remat, attention=section.attention,
                                attention_block=section.attention_block,
                                attention_segments=section.attention_segments)
  return model
