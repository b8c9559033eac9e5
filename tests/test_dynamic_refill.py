"""DAPO dynamic sampling refilled from the continuous engine's queue (`dynamic_refill_batch`):
on the embedded task's tiny model with reward functions run by the reward scorer, it keeps P
groups with a signal when the iterator has them, counts its refills, stops at the budget,
is deterministic for a key (whatever the slots), keeps the groups the rounds path keeps from
the same draws, and a run resumes from a checkpoint exactly."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from epgrpo_jax.data import pipeline
from epgrpo_jax.rewards import RewardScorer
from epgrpo_jax.rollout import continuous
from epgrpo_jax.rollout.sampling import Sampler
from epgrpo_jax.training.rollouts import (dynamic_refill_batch, dynamic_round_batch, group_has_signal,
                                          select_groups)
from epgrpo_jax.training.trainer import Trainer

from helpers import arithmetic_task, rl_step_config

P, G = 4, 4


def some_signal(completions: list[str], answers: list[str]) -> list[float]:
  """A signal (completion length odd or even) only for problems whose answer does not end in
  0, 3 or 6: the other groups all score 0."""
  return [float(len(c) % 2) if a[-1:] not in "036" else 0.0 for c, a in zip(completions, answers)]


def no_signal(completions: list[str], answers: list[str]) -> list[float]:
  """Every completion scores 1: no group has a signal."""
  return [1.0 for _ in completions]


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
  task = arithmetic_task(tmp_path_factory.mktemp("arith"))
  cfg = rl_step_config(
      task, tmp_path_factory.mktemp("run"), "train.steps=2", f"reward.function={__name__}:some_signal",
      "dynamic_sampling.enabled=true", "dynamic_sampling.max_extra_rounds=2", "sampling.continuous=true",
      "sampling.slots=8", "sampling.refill_every=4")
  trainer = Trainer(cfg)
  yield trainer
  trainer.close()


def fresh_iterator(trainer: Trainer):
  return pipeline.batch_iterator(len(trainer.train_examples), P, seed=trainer.cfg.train.seed)


def refill(trainer: Trainer, key, sampler: Sampler | None = None):
  """One refilled draw from the start of the data (the trainer's iterator reset)."""
  trainer.data_iter = fresh_iterator(trainer)
  sample = functools.partial(continuous.sample_queue, sampler or trainer.sampler,
                             trainer.params(trainer.policy.trainable), G, prompt_len=trainer.prompt_slots)
  return dynamic_refill_batch(trainer.cfg, key, trainer.draw_examples, sample, trainer.score_rewards,
                              trainer.pad_id)


def signal_of(rewards) -> np.ndarray:
  return group_has_signal(np.asarray(rewards.reward).reshape(-1, G), 1e-6)


@pytest.mark.parametrize("seed", [0, 3])
def test_refill_keeps_the_rounds_paths_groups(trainer, seed):
  key = jax.random.key(seed)
  batch, texts, rewards, m = refill(trainer, key)
  position = trainer.data_iter.get_state()
  # P groups, all with a signal (the iterator has them), in the step's shapes.
  assert batch.tokens.shape == (P, G, trainer.cfg.sampling.max_new_tokens)
  assert signal_of(rewards).all() and m["dynamic/filled_zero_variance_groups"] == 0
  # Each group without a signal queued one more prompt and was dropped.
  assert m["dynamic/refilled_prompts"] == m["dynamic/extra_prompts"] == m["dynamic/dropped_groups"] > 0
  sampled = P + int(m["dynamic/refilled_prompts"])
  assert m["dynamic/rounds"] == -(-sampled // P)
  assert m["dynamic/unused_prompts"] == m["dynamic/rounds"] * P - sampled
  reference = fresh_iterator(trainer)
  for _ in range(int(m["dynamic/rounds"])):
    next(reference)
  assert position == reference.get_state()  # the batches taken, no more

  # The rounds path (static sampler, the same keys per draw) keeps the same groups.
  engine = trainer.sampler
  trainer.sampler = Sampler(trainer.cfg.sampling.replace(continuous=False), eos_ids=trainer.eos_ids,
                            pad_id=trainer.pad_id)
  try:
    trainer.data_iter = fresh_iterator(trainer)
    r_batch, r_texts, r_rewards, r_m = dynamic_round_batch(
        trainer.cfg, key, functools.partial(trainer.sample_round, trainer.policy.trainable),
        trainer.score_rewards, trainer.pad_id)
  finally:
    trainer.sampler = engine
  assert [e.id for e in batch.examples] == [e.id for e in r_batch.examples]
  assert texts == r_texts
  np.testing.assert_array_equal(rewards.reward, r_rewards.reward)
  np.testing.assert_array_equal(batch.tokens, r_batch.tokens)
  np.testing.assert_array_equal(batch.mask, r_batch.mask)
  np.testing.assert_array_equal(batch.prompt_ids, r_batch.prompt_ids)
  np.testing.assert_allclose(batch.logp, r_batch.logp, atol=1e-5)
  assert m["dynamic/rounds"] == r_m["dynamic/rounds"]
  assert trainer.data_iter.get_state() == position
  assert m["dynamic/extra_prompts"] <= r_m["dynamic/extra_prompts"]  # fewer prompts sampled


def test_refill_is_deterministic_for_a_key_whatever_the_slots(trainer):
  key = jax.random.key(5)
  batch, texts, rewards, m = refill(trainer, key)
  again = refill(trainer, key)
  narrow = refill(trainer, key, Sampler(trainer.cfg.sampling.replace(slots=4, refill_every=2),
                                        eos_ids=trainer.eos_ids, pad_id=trainer.pad_id))
  for other in (again, narrow):
    np.testing.assert_array_equal(other[0].tokens, batch.tokens)
    np.testing.assert_allclose(other[0].logp, batch.logp, atol=1e-5)
    assert other[1] == texts and other[3] == m
    np.testing.assert_array_equal(other[2].reward, rewards.reward)
  other_key = refill(trainer, jax.random.key(6))
  assert not np.array_equal(other_key[0].tokens, batch.tokens)


def test_refill_stops_at_the_budget(trainer):
  extra = trainer.cfg.dynamic_sampling.max_extra_rounds
  cfg = trainer.cfg.override(f"reward.function={__name__}:no_signal")
  scorer, trainer.scorer, trainer.cfg = trainer.scorer, RewardScorer(cfg.reward), cfg
  try:
    batch, _, rewards, m = refill(trainer, jax.random.key(1))
    position = trainer.data_iter.get_state()
  finally:
    trainer.scorer.close()
    trainer.scorer, trainer.cfg = scorer, trainer.cfg.override(f"reward.function={__name__}:some_signal")
  # No group has a signal: every prompt the budget allows is sampled, the first P kept.
  assert m["dynamic/refilled_prompts"] == extra * P and m["dynamic/rounds"] == 1 + extra
  assert m["dynamic/unused_prompts"] == 0 and m["dynamic/filled_zero_variance_groups"] == P
  assert m["dynamic/dropped_groups"] == extra * P
  np.testing.assert_array_equal(select_groups(np.zeros((1 + extra) * P, bool), P), np.arange(P))
  reference = fresh_iterator(trainer)
  first = [trainer.train_examples[i].id for i in next(reference)]
  for _ in range(extra):
    next(reference)
  assert [e.id for e in batch.examples] == first
  assert position == reference.get_state()
  assert not signal_of(rewards).any()


def test_training_steps_refill_and_resume_exactly(trainer):
  trainer.data_iter = fresh_iterator(trainer)
  state = trainer.initial_state()
  state, m1, _ = trainer.step(state)
  trainer.save(state)
  trainer.checkpointer.wait()
  state, m2, r2 = trainer.step(state)
  for m in (m1, m2):
    assert "dynamic/refilled_prompts" in m
  assert m2["num_samples"] == (2 * P + m1["dynamic/extra_prompts"] + m2["dynamic/extra_prompts"]) * G
  position = trainer.data_iter.get_state()
  state = trainer.restore_or_init()  # the step-1 checkpoint: state, key and iterator in place
  assert state.step == 1
  state, m2b, r2b = trainer.step(state)
  assert [e.id for e in r2b["examples"]] == [e.id for e in r2["examples"]]
  assert r2b["texts"] == r2["texts"]
  np.testing.assert_array_equal(r2b["rewards"].reward, r2["rewards"].reward)
  assert {k: v for k, v in m2b.items() if k.startswith("dynamic/")} == \
      {k: v for k, v in m2.items() if k.startswith("dynamic/")}
  assert trainer.data_iter.get_state() == position
