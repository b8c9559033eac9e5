"""Rollouts up to k policy versions stale (`rollout.max_staleness`, training/staleness.py): the
bound, the versions each step trains on, k = 0 as the synchronous step, exact resume."""

from __future__ import annotations

import dataclasses

import chex
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given

from epgrpo_jax.io.errors import UserError
from epgrpo_jax.parallel.sharding import MeshConfig, make_mesh
from epgrpo_jax.rollout.sampling import Sampler
from epgrpo_jax.training.rollouts import SampledRound
from epgrpo_jax.training.staleness import (StaleRollouts, batch_keys, batches_wanted, run_steps,
                                           split_devices, too_stale)
from epgrpo_jax.training.trainer import Trainer
from helpers import arithmetic_task, rl_step_config

P, G = 4, 4
TIMING = ("time", "tokens_per_second", "perf/")


def graded(completions, answers):
  """Deterministic rewards that differ within a group (a random policy never answers right)."""
  return [(sum(map(ord, c)) % 5) / 4 for c in completions]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
  return arithmetic_task(tmp_path_factory.mktemp("arith"))


def config(task, out_dir, *overrides):
  return rl_step_config(task, out_dir, f"reward.function={__name__}:graded", *overrides)


def untimed(m: dict) -> dict:
  return {k: v for k, v in m.items() if not any(t in k for t in TIMING)}


def one_device(cfg) -> Trainer:
  """A Trainer of `cfg` on the first device alone (the sampler shares it)."""
  return Trainer(cfg, mesh=make_mesh(MeshConfig(), jax.devices()[:1]))


def host_copy(tree):
  return jax.tree.map(np.asarray, tree)


# -- the bound, on the queue alone ------------------------------------------------------------


def test_too_stale_split_devices_and_keys_literal():
  assert [too_stale(v, 5, 2) for v in (2, 3, 4, 5)] == [True, False, False, False]
  assert not too_stale(0, 0, 0) and too_stale(0, 1, 0)
  assert split_devices([0, 1, 2, 3, 4, 5, 6, 7], 4) == ([0, 1, 2, 3], [4, 5, 6, 7])
  assert split_devices([0, 1], 0) == ([0, 1], [])
  with pytest.raises(UserError, match=r"^rollout.devices: 2 leaves no device for training"):
    split_devices([0, 1], 2)
  key = jax.random.key(3)
  keys = batch_keys(key, 3)
  assert keys[0] is key
  chex.assert_trees_all_equal(jax.random.key_data(keys[2]),
                              jax.random.key_data(jax.random.fold_in(key, 2)))


class Counter:
  """Host stand-ins for the trainer's parts: prompts drawn in order, a 'policy' that is its
  version, completions that record which version sampled them."""

  def __init__(self):
    self.drawn = 0

  def draw(self):
    self.drawn += 1
    return np.arange(self.drawn * P - P, self.drawn * P) % 8

  def sample(self, params, examples, key):
    z = np.zeros((P, G, 2))
    return SampledRound(examples, np.zeros((P, 1)), np.ones((P, 1), bool), z + params, z > -1, z, z)

  def reward(self, examples, tokens, mask):
    return ["x"] * len(tokens), tokens[:, 0]


def queue(k: int, steps: int = 100) -> tuple[StaleRollouts, Counter]:
  c = Counter()
  return StaleRollouts(k, draw=c.draw, params=lambda v: v, sample=c.sample, reward=c.reward,
                       examples=list(range(8)), steps=steps), c


def test_batches_wanted_and_run_steps_literal():
  # k = 2, a run of 5 steps: 3 at the start, then one new a step, none drawn by the last two.
  assert [batches_wanted(s, 5, 2) for s in range(5)] == [3, 3, 3, 2, 1]
  assert [batches_wanted(s, 2, 3) for s in range(2)] == [2, 1]
  assert batches_wanted(0, 1, 1) == 1 and batches_wanted(7, 5, 2) == 1  # past the end: its own
  # train.max_samples stops the run after the first step whose P x G = 16 completions reach it.
  assert [run_steps(10, m, 16) for m in (0, 32, 40, 1000)] == [10, 2, 3, 10]


@given(k=st.integers(1, 3), steps=st.integers(1, 8))
def test_consecutive_steps_train_on_version_step_minus_k(k, steps):
  q, c = queue(k, steps)
  try:
    for s in range(steps):
      rnd, _, rewards, version, m = q.take(s, s, jax.random.key(s))
      assert version == max(s - k, 0) == rnd.tokens[0, 0, 0] == rewards[0]
      assert m["rollout/staleness"] == min(s, k) and m["rollout/dropped_stale"] == 0
      assert len(q.queue) == min(k, steps - 1 - s)  # one batch for each step still to come
    assert c.drawn == steps and not q.queue  # every batch drawn is trained on, none wasted
  finally:
    q.close()


def test_a_batch_older_than_k_is_dropped_counted_and_replaced():
  q, c = queue(2)
  try:
    q.take(0, 0, jax.random.key(0))  # in flight: two batches of version 0
    # Step 3 (a resumed run's or one that skipped): both are 3 versions old, over the bound.
    rnd, _, _, version, m = q.take(3, 3, jax.random.key(3))
    assert version == 3 and rnd.tokens[0, 0, 0] == 3
    assert m["rollout/dropped_stale"] == 2 * P * G and m["rollout/staleness"] == 0
    assert [b.version for b in q.queue] == [3, 3] and c.drawn == 6
    # Step 4: one of version 3 (staleness 1) is within the bound.
    assert q.take(4, 4, jax.random.key(4))[3] == 3
  finally:
    q.close()


# -- on the trainer ---------------------------------------------------------------------------


def test_k0_is_the_synchronous_step_and_k1_samples_ahead_with_the_versions_it_says(task, tmp_path):
  sync = one_device(config(task, tmp_path / "k0", "train.steps=3"))
  try:
    assert sync.rollouts is None and sync.rollout_mesh is sync.mesh
    state = sync.restore_or_init()
    sync_metrics = []
    for _ in range(3):
      state, m, r = sync.step(state)
      sync_metrics.append(m)
      assert not any(k.startswith("rollout/") for k in m)
      np.testing.assert_array_equal(r["policy_version"], np.full(P * G, state.step - 1))
    sync.save(state)
    sync.checkpointer.wait()
    assert sync.checkpointer.restore_inflight(3) == {}  # nothing in flight, nothing saved
  finally:
    sync.close()

  stale = one_device(config(task, tmp_path / "k1", "train.steps=3", "rollout.max_staleness=1"))
  try:
    state0 = stale.restore_or_init()
    state1, m1, _ = stale.step(state0)
    # Step 1 trains on version 0 sampled with the synchronous run's key: the same step.
    assert untimed(m1) == untimed(sync_metrics[0]) | {
        "rollout/policy_version": 0.0, "rollout/staleness": 0.0, "rollout/dropped_stale": 0.0,
        "rollout/in_flight": 1.0}
    trainable1, key1 = host_copy(state1.trainable), state1.key  # the update donates its input
    state2, m2, r2 = stale.step(state1)
    state3, m3, r3 = stale.step(state2)
    versions = [m["rollout/policy_version"] for m in (m1, m2, m3)]
    assert versions == [0.0, 0.0, 1.0]
    assert [m["rollout/staleness"] for m in (m1, m2, m3)] == [0.0, 1.0, 1.0]
    np.testing.assert_array_equal(r3["policy_version"], np.full(P * G, 1))
    assert m2["grad_norm"] > 0 and m3["grad_norm"] > 0
    # Step 3's completions are those policy version 1 samples with step 2's key ...
    sample_key2 = jax.random.split(key1)[1]
    v1 = stale.sample_examples(stale.params(jax.tree.map(jnp.asarray, trainable1)),
                               r3["examples"], sample_key2)
    np.testing.assert_array_equal(np.asarray(r3["rollout"].completion),
                                  v1.tokens.reshape(P * G, -1)[:, :r3["rollout"].completion.shape[1]])
    np.testing.assert_array_equal(np.asarray(r3["rollout"].behaviour_logp),
                                  v1.logp.reshape(P * G, -1)[:, :r3["rollout"].completion.shape[1]])
    # ... not those of version 2 (the one it is trained from), whose log-probs differ.
    v2 = stale.sample_examples(stale.params(state3.trainable), r3["examples"], sample_key2)
    assert not np.array_equal(v2.logp, v1.logp)
    # The mismatch metrics see the staleness: the behaviour policy is one update behind. The
    # ratio's old policy is the current one (decoupled): exactly 1 in the step's one update,
    # never clipped.
    assert m3["sampling/sampling_logp_difference/mean"] > 10 * m1["sampling/sampling_logp_difference/mean"]
    assert m3["clip_ratio/region_mean"] == 0.0
    # The last step drew nothing ahead: no batch is sampled that the run never trains on.
    assert m3["rollout/in_flight"] == 0.0 and not stale.rollouts.queue
  finally:
    stale.close()


def test_resume_with_k1_is_exact_and_a_smaller_k_drops_what_is_too_old(task, tmp_path):
  run = tmp_path / "run"
  first = one_device(config(task, run, "train.steps=4", "rollout.max_staleness=2"))
  try:
    state = first.restore_or_init()
    for _ in range(2):
      state, _, _ = first.step(state)
    first.save(state)
    first.checkpointer.wait()
    saved = first.checkpointer.restore_inflight(2)
    assert sorted(saved) == ["0", "1"] and [int(saved[j]["version"]) for j in "01"] == [0, 1]
    expected = []
    for _ in range(2):
      state, m, _ = first.step(state)
      expected.append(untimed(m))
    final = host_copy(state.trainable)
  finally:
    first.close()

  again = one_device(config(task, run, "train.steps=4", "rollout.max_staleness=2"))
  try:
    state = again.restore_or_init()
    assert state.step == 2 and [b.version for b in again.rollouts.queue] == [0, 1]
    got = []
    for _ in range(2):
      state, m, _ = again.step(state)
      got.append(untimed(m))
    assert got == expected
    chex.assert_trees_all_equal(host_copy(state.trainable), final)
  finally:
    again.close()

  # The step-2 checkpoint resumed with k = 1: the batch of version 0 is two versions old.
  smaller = one_device(config(task, run, "train.steps=4", "rollout.max_staleness=1"))
  try:
    state = smaller.restore_or_init()
    assert state.step == 2  # checkpoints 3 and 4 were never saved
    state, m, _ = smaller.step(state)
    assert m["rollout/dropped_stale"] == P * G and m["rollout/policy_version"] == 1.0
    assert m["rollout/staleness"] == 1.0
  finally:
    smaller.close()


def test_reusing_the_sampler_log_probs_clips_a_stale_batch_against_them(task, tmp_path):
  trainer = one_device(config(task, tmp_path / "run", "train.steps=2", "rollout.max_staleness=1",
                              "train.reuse_sampler_logprobs=true"))
  try:
    state = trainer.restore_or_init()
    for _ in range(2):
      state, m, _ = trainer.step(state)
    assert m["rollout/staleness"] == 1.0
    # pi_old is the sampler's mu: no gap between them, and the ratio pi_theta / mu (one update
    # apart) leaves the clip range on some tokens.
    assert m["sampling/sampling_logp_difference/mean"] == 0.0 and m["clip_ratio/region_mean"] > 0
  finally:
    trainer.close()


@pytest.mark.parametrize("overrides,expected", [
    (["rollout.max_staleness=-1"], "rollout.max_staleness: must be >= 0, got -1"),
    (["rollout.devices=2"], "rollout.devices: a rollout mesh of 2 device(s) needs "
                            "rollout.max_staleness >= 1"),
    (["rollout.max_staleness=1", "sampling.temperature=0", "loss.rollout_correction=token"],
     "rollout.max_staleness: 1 with loss.rollout_correction"),
    (["rollout.max_staleness=1", "dynamic_sampling.enabled=true"],
     "rollout.max_staleness: 1 cannot be combined with dynamic_sampling.enabled"),
])
def test_bad_staleness_settings_are_one_line_errors(task, tmp_path, overrides, expected):
  with pytest.raises(UserError) as e:
    config(task, tmp_path, *overrides)
  assert str(e.value).startswith(expected) and "\n" not in str(e.value)


def test_rollouts_ahead_on_a_shared_mesh_of_several_devices_are_refused(task, tmp_path):
  with pytest.raises(UserError, match=r"^rollout.max_staleness: 1 on a mesh of 8 devices needs "
                                      r"rollout.devices"):
    Trainer(config(task, tmp_path, "rollout.max_staleness=1"))


def test_a_rollout_mesh_beside_the_training_mesh_gets_only_the_adapters(task, tmp_path):
  trainer = Trainer(config(task, tmp_path / "run", "train.steps=2", "rollout.max_staleness=1",
                           "rollout.devices=4"))
  try:
    train_devices, rollout_devices = set(trainer.mesh.devices.flat), set(trainer.rollout_mesh.devices.flat)
    assert len(train_devices) == len(rollout_devices) == 4 and not train_devices & rollout_devices
    state = trainer.restore_or_init()
    graphdef, sent = trainer.sampler_params(state.trainable)
    # The frozen weights are the rollout mesh's own copy, placed once: the very same arrays.
    frozen_ids = {id(x) for x in jax.tree.leaves(trainer.rollout_frozen)}
    trainable_paths = {p for p, _ in jax.tree_util.tree_flatten_with_path(state.trainable)[0]}
    for path, leaf in jax.tree_util.tree_flatten_with_path(sent)[0]:
      assert leaf.sharding.device_set <= rollout_devices
      assert (id(leaf) in frozen_ids) != (path in trainable_paths), path
    versions = []
    for _ in range(2):
      state, m, _ = trainer.step(state)
      versions.append(m["rollout/policy_version"])
      assert np.isfinite(m["loss"])
    assert versions == [0.0, 0.0]
    assert all(x.sharding.device_set <= train_devices for x in jax.tree.leaves(state.trainable))
  finally:
    trainer.close()


def test_the_continuous_engine_on_a_rollout_mesh_samples_the_static_batches_and_resumes_exactly(
    task, tmp_path):
  run = tmp_path / "run"
  overrides = ("train.steps=3", "rollout.max_staleness=1", "rollout.devices=4",
               "sampling.continuous=true", "sampling.slots=8", "sampling.refill_every=4")
  first = Trainer(config(task, run, *overrides))
  try:
    assert first.sampler.config.continuous and first.sampler.mesh is first.rollout_mesh
    static = Sampler(dataclasses.replace(first.sampler.config, continuous=False),
                     eos_ids=first.eos_ids, pad_id=first.pad_id, mesh=first.rollout_mesh)
    state = first.restore_or_init()
    trainables, sample_keys, records, expected = [], [], [], []
    for step in range(3):
      trainables.append(host_copy(state.trainable))  # the update donates its input
      sample_keys.append(jax.random.split(state.key)[1])
      state, m, r = first.step(state)
      records.append(r)
      expected.append(untimed(m))
      if step == 0:
        first.save(state)  # in flight: the engine's batch for step 2
        first.checkpointer.wait()
    final = host_copy(state.trainable)
    # Each step's batch is the one the static sampler draws on the same rollout mesh from the
    # same policy version and key: steps 1 and 2 train on the two batches of version 0 that
    # step 1 drew, step 3 on the batch of version 1 that step 2 drew.
    drawn = [(0, key) for key in batch_keys(sample_keys[0], 2)] + [(1, sample_keys[1])]
    for r, (version, key) in zip(records, drawn):
      np.testing.assert_array_equal(r["policy_version"], np.full(P * G, version))
      want = static.sample(first.sampler_params(jax.tree.map(jnp.asarray, trainables[version])),
                           [e.prompt_ids for e in r["examples"]], num_samples=G, key=key)
      n = r["rollout"].completion.shape[1]
      np.testing.assert_array_equal(np.asarray(r["rollout"].completion),
                                    np.asarray(want.tokens).reshape(P * G, -1)[:, :n])
      np.testing.assert_allclose(np.asarray(r["rollout"].behaviour_logp),
                                 np.asarray(want.logp).reshape(P * G, -1)[:, :n], atol=1e-5)
  finally:
    first.close()

  # Resumed from step 1: the engine's batch in flight comes back from the checkpoint, and the
  # batch of version 1 is sampled again by the engine: metrics and parameters bit-identical.
  again = Trainer(config(task, run, *overrides))
  try:
    state = again.restore_or_init()
    assert state.step == 1 and [b.version for b in again.rollouts.queue] == [0]
    got = []
    for _ in range(2):
      state, m, _ = again.step(state)
      got.append(untimed(m))
    assert got == expected[1:]
    chex.assert_trees_all_equal(host_copy(state.trainable), final)
  finally:
    again.close()
