"""Steady state compiles nothing: after the first RL step, further steps trace and compile no program."""

from __future__ import annotations

import threading

import jax
import pytest

from epgrpo_jax.config import TrainConfig
from epgrpo_jax.tasks import arithmetic
from epgrpo_jax.trainer import Trainer

TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # also fires on persistent-cache hits


class Events:
  """Counts jit tracings and XLA executable builds while installed."""

  def __init__(self):
    self.traces = self.compiles = 0
    self._lock = threading.Lock()

  def _listener(self, event: str, duration: float, **_) -> None:
    with self._lock:
      if event == TRACE_EVENT:
        self.traces += 1
      elif event == COMPILE_EVENT:
        self.compiles += 1

  def __enter__(self) -> "Events":
    jax.monitoring.register_event_duration_secs_listener(self._listener)
    return self

  def __exit__(self, *exc) -> None:
    jax.monitoring.unregister_event_duration_listener(self._listener)


def parity(completions: list[str], answers: list[str]) -> list[float]:
  """A cheap in-process reward with both values in every group."""
  return [float(len(c) % 2 == 0) for c in completions]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
  return arithmetic.build_assets(tmp_path_factory.mktemp("arith"), seed=0, train_per_level=60,
                                 heldout_per_level=4, verbose=False)


def test_second_and_third_steps_compile_nothing(task, tmp_path):
  cfg = TrainConfig().override(
      f"model.path={task.model_dir}", f"data.train_files=[{task.train_file}]",
      "data.prompt_template='{problem}'", "train.steps=10", "train.prompts_per_step=4",
      "train.num_generations=4", "sampling.max_new_tokens=16", "lora.rank=4",
      f"reward.function={__name__}:parity", f"train.output_dir={tmp_path / 'run'}",
      "logging.progress=false", "logging.tensorboard=false", "logging.samples_every=0")
  trainer = Trainer(cfg)
  try:
    state = trainer.initial_state()
    with Events() as first:
      state, _, _ = trainer.step(state)
    assert 0 < first.compiles < 40  # bounded: sampler, score, advantage, update and small ops
    for _ in range(2):
      with Events() as later:
        state, metrics, _ = trainer.step(state)
        jax.block_until_ready(state.trainable)
      assert (later.traces, later.compiles) == (0, 0), metrics["completions/mean_length"]
    assert trainer.sampler.num_compilations == 1
  finally:
    trainer.close()
