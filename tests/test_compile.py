"""Steady state compiles nothing: after the first RL step, further steps trace and compile no program."""

from __future__ import annotations

import jax
import pytest

from epgrpo_jax.training.trainer import Trainer

from helpers import Events, arithmetic_task, rl_step_config


def parity(completions: list[str], answers: list[str]) -> list[float]:
  """A cheap in-process reward with both values in every group."""
  return [float(len(c) % 2 == 0) for c in completions]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
  return arithmetic_task(tmp_path_factory.mktemp("arith"))


def test_second_and_third_steps_compile_nothing(task, tmp_path):
  cfg = rl_step_config(task, tmp_path / "run", "train.steps=10",
                       f"reward.function={__name__}:parity")
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
    assert trainer.sampler.num_compilations == 2  # the weights prepared, then the sampling program
  finally:
    trainer.close()
