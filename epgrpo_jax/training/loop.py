"""The training run: `train(cfg)` checks the machine, builds the `Trainer`, restores or starts
the run state, and loops over `Trainer.step` with metrics, sample records, held-out
evaluations, checkpoints and a clean stop on SIGTERM/SIGINT; then it exports the policy."""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from typing import Any

import jax
import yaml

from epgrpo_jax.evaluation.heldout import paired_gain
from epgrpo_jax.io import configlib
from epgrpo_jax.io.atomic import write_text_atomic
from epgrpo_jax.io.checkpointing import committed_steps
from epgrpo_jax.io.errors import RunError, UserError
from epgrpo_jax.io.metrics import Progress
from epgrpo_jax.parallel import distributed
from epgrpo_jax.training.config import EMBEDDED, TrainConfig
from epgrpo_jax.training.embedded import resolve_embedded
from epgrpo_jax.training.rollouts import sample_records
from epgrpo_jax.training.build import JSONL_OUTPUTS, check_writable
from epgrpo_jax.training.staleness import split_devices
from epgrpo_jax.training.trainer import Trainer

log = logging.getLogger("epgrpo_jax.training.loop")


class TrainingError(RunError):
  """The run cannot continue (e.g. too many non-finite updates in a row)."""


def train(cfg: TrainConfig) -> dict[str, Any]:
  """Runs a whole training job; returns a summary (held-out accuracy before and after, paths)."""
  distributed.initialize(cfg.distributed)  # before any JAX computation
  preflight(cfg)
  cfg = resolve_embedded(cfg, progress=cfg.logging.progress)
  trainer = Trainer(cfg)
  t = cfg.train
  summary: dict[str, Any] = {"output_dir": str(trainer.out_dir)}
  try:
    state = trainer.restore_or_init()
    if trainer.is_main:  # only once the resume worked: the file must describe the checkpoints
      write_text_atomic(trainer.out_dir / "config.yaml",
                        yaml.safe_dump(configlib.to_dict(cfg), sort_keys=False))
    # Checkpoints exist from step 1 on: step 0 is a fresh start, whose records are all redone.
    resumed = state.step > 0
    trainer.writer.resume_from(state.step if resumed else -1, JSONL_OUTPUTS)
    if not resumed:
      trainer.writer.write(0, {f"data/skipped_{k}": v for k, v in trainer.skips.items()}
                           | {"data/train_problems": len(trainer.train_examples),
                              "data/heldout_problems": len(trainer.heldout)})
    eval_key = jax.random.key(t.seed + 1)
    before = None  # the starting policy's per-problem scores, for the paired gain at the end
    if cfg.eval.before and trainer.heldout and state.step == 0:
      before = trainer.heldout_result(state.trainable, eval_key)
      summary["heldout_before"] = before.summary()
      trainer.writer.write(0, summary["heldout_before"], prefix="heldout/")
      _say(trainer, f"held-out before RL: {_fmt_eval(summary['heldout_before'])}")
    progress = Progress(t.steps, "train", initial=state.step, enabled=cfg.logging.progress and
                        trainer.is_main)
    with _StopSignal() as stop:
      while state.step < t.steps and not (t.max_samples and state.num_samples >= t.max_samples):
        state, metrics, record = trainer.step(state)
        if state.consecutive_skips:
          log.warning("step %d: non-finite loss or gradient, update skipped (%d in a row, %d in all)",
                      state.step, state.consecutive_skips, state.skipped_updates)
        trainer.writer.write(state.step, metrics)
        progress.update({"reward": metrics["reward"], "kl": metrics["kl"],
                         "tok/s": metrics["tokens_per_second"]})
        if state.consecutive_skips >= t.max_consecutive_skips:
          trainer.save(state)
          raise TrainingError(
              f"{state.consecutive_skips} consecutive non-finite updates at step {state.step}; "
              f"saved the last good state to {trainer.checkpointer.directory}")
        if cfg.logging.samples_every and state.step % cfg.logging.samples_every == 0:
          trainer.writer.append_jsonl("samples.jsonl", sample_records(
              state.step, distributed.to_host(record), cfg.logging.samples_count))
        if cfg.eval.every and state.step % cfg.eval.every == 0 and trainer.heldout:
          trainer.writer.write(state.step, trainer.evaluate(state.trainable, eval_key),
                               prefix="heldout/")
        if cfg.checkpoint.every and state.step % cfg.checkpoint.every == 0:
          trainer.save(state)
        if distributed.any_process(stop.received is not None):
          trainer.save(state)
          trainer.checkpointer.wait()
          progress.close()
          _say(trainer, f"stopped by signal at step {state.step}; checkpoint saved in "
                        f"{trainer.checkpointer.directory}")
          summary["stopped_at"] = state.step
          return summary
    progress.close()
    if trainer.checkpointer.latest_step() != state.step:
      trainer.save(state)
    if cfg.eval.after and trainer.heldout:
      after = trainer.heldout_result(state.trainable, eval_key)
      summary["heldout_after"] = after.summary()
      if before is not None:
        gain, se = paired_gain(before, after)
        summary["heldout_gain"] = {"accuracy": gain, "accuracy_se": se}
      trainer.writer.write(state.step, summary["heldout_after"], prefix="heldout/")
      _say(trainer, f"held-out after RL:  {_fmt_eval(summary['heldout_after'])}")
    # Every process takes part (the weights may be sharded); only process 0 writes.
    summary["policy_dir"] = str(trainer.export(state.trainable, trainer.out_dir / "policy"))
    summary["steps"] = state.step
    trainer.writer.write_json("summary.json", summary)
    return summary
  finally:
    trainer.close()


def preflight(cfg: TrainConfig) -> None:
  """Checks against this machine what the config cannot check alone, before heavy work."""
  r = cfg.rollout
  if r.max_staleness and jax.process_count() > 1:
    raise UserError(f"rollout.max_staleness: {r.max_staleness} runs in one process; this run has "
                     f"{jax.process_count()} (set it to 0)")
  cfg.mesh.shape(len(split_devices(jax.devices(), r.devices)[0]))
  out = Path(cfg.train.output_dir).resolve()
  if cfg.model.path != EMBEDDED:
    model = Path(cfg.model.path).resolve()
    if model == out or out in model.parents:
      raise UserError(f"model.path: {cfg.model.path} lies inside train.output_dir "
                      f"({cfg.train.output_dir}), where the run writes its checkpoints and "
                      f"exports policy/; copy the model elsewhere or choose another output_dir")
  check_writable(out)
  ckpt_dir = Path(cfg.train.output_dir) / "checkpoints"
  if not cfg.checkpoint.resume and (found := committed_steps(ckpt_dir)):
    raise UserError(f"checkpoint.resume: false, but {ckpt_dir} holds checkpoints (latest step "
                     f"{found[-1]}); remove them or choose another train.output_dir")
  if cfg.train.prompts_per_step % jax.process_count():
    raise UserError(f"train.prompts_per_step: {cfg.train.prompts_per_step} is not divisible by "
                     f"the {jax.process_count()} processes")


class _StopSignal:
  """Turns SIGTERM/SIGINT into a flag the loop checks between steps."""

  def __init__(self):
    self.received: int | None = None
    self._previous = {}

  def __enter__(self):
    for sig in (signal.SIGTERM, signal.SIGINT):
      try:
        self._previous[sig] = signal.signal(sig, self._handle)
      except ValueError:  # not the main thread: leave signals alone
        pass
    return self

  def _handle(self, signum, frame):
    if self.received is not None and signum == signal.SIGINT:
      raise KeyboardInterrupt  # a second Ctrl-C stops at once
    self.received = signum
    log.warning("received %s: stopping after this step and saving a checkpoint",
                signal.Signals(signum).name)

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)


def _fmt_eval(m: dict[str, float]) -> str:
  return " ".join(f"{k}={100 * v:.1f}%" for k, v in m.items() if k in ("accuracy", "format"))


def _say(trainer: Trainer, line: str) -> None:
  if trainer.is_main:
    print(line, flush=True)
