"""Padding-free batches (training/packing.py, train.packing): the packed layout, attention that
never crosses a segment, and packed scoring, loss, gradients and training equal to the padded
ones (float32, 1e-5); and benchmarks/packing.py's refusal of a prompt limit nothing fits."""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from epgrpo_jax.core.advantages import AdvantageConfig
from epgrpo_jax.core.losses import AGGREGATIONS, LossConfig
from epgrpo_jax.io.errors import UserError
from epgrpo_jax.models import LoraConfig, _attention
from epgrpo_jax.training import batches, objective, programs
from epgrpo_jax.training.config import TrainConfig
from epgrpo_jax.training.packing import (check_layout, num_rows, pack, pack_micro_batches,
                                         with_rows)
from epgrpo_jax.training.trainer import Trainer

from helpers import Events, arithmetic_task, random_model, rl_step_config, tiny_config

ATOL = 1e-5


# -- the layout -------------------------------------------------------------------------------

# Three sequences: prompt [5, 6] + completion [10, 11, 12]; a prompt with no completion token
# (nothing to score: left out); prompt [4] + completion [14, 15].
PROMPT_IDS = [[0, 5, 6], [7, 8, 9], [0, 0, 4]]
PROMPT_MASK = [[0, 1, 1], [1, 1, 1], [0, 0, 1]]
COMPLETION = [[10, 11, 12, 0], [13, 0, 0, 0], [14, 15, 0, 0]]
COMPLETION_MASK = [[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 0, 0]]


def _literal(**kw):
  return pack(np.asarray(PROMPT_IDS), np.asarray(PROMPT_MASK, bool), np.asarray(COMPLETION),
              np.asarray(COMPLETION_MASK, bool), **kw)


def test_literal_layout_in_one_row():
  p = _literal(row_length=6)
  # Each sequence's last completion token needs no slot: 2 + 3 - 1 and 1 + 2 - 1 slots.
  np.testing.assert_array_equal(p.tokens, [[5, 6, 10, 11, 4, 14]])
  np.testing.assert_array_equal(p.positions, [[0, 1, 2, 3, 0, 1]])
  np.testing.assert_array_equal(p.segments, [[1, 1, 1, 1, 2, 2]])
  np.testing.assert_array_equal(p.targets, [[0, 10, 11, 12, 14, 15]])
  np.testing.assert_array_equal(p.index, [[1, 2, 3, 0], [0, 0, 0, 0], [4, 5, 0, 0]])


def test_literal_layout_over_rows_bucketed():
  # Rows of 4: the sequences do not share a row; 2 rows used, rounded up to 3 (the multiple).
  p = _literal(row_length=4, multiple=3)
  np.testing.assert_array_equal(p.tokens, [[5, 6, 10, 11], [4, 14, 0, 0], [0, 0, 0, 0]])
  np.testing.assert_array_equal(p.positions, [[0, 1, 2, 3], [0, 1, 0, 0], [0, 0, 0, 0]])
  np.testing.assert_array_equal(p.segments, [[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]])
  np.testing.assert_array_equal(p.index, [[1, 2, 3, 0], [0, 0, 0, 0], [4, 5, 0, 0]])
  with pytest.raises(ValueError, match="4 tokens does not fit a row of 3"):
    _literal(row_length=3)


def test_row_count_buckets():
  assert [num_rows(n) for n in range(14)] == [1, 1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 12, 12, 16]
  assert num_rows(3, multiple=4) == 4 and num_rows(1, multiple=4) == 4
  assert num_rows(5, multiple=6) == 6 and num_rows(7, multiple=6) == 12


# The literal batch and a fourth sequence: prompt [3, 2] + completion [16, 17, 18, 19].
PROMPT_IDS_4, PROMPT_MASK_4 = PROMPT_IDS + [[0, 3, 2]], PROMPT_MASK + [[0, 1, 1]]
COMPLETION_4, COMPLETION_MASK_4 = COMPLETION + [[16, 17, 18, 19]], COMPLETION_MASK + [[1] * 4]


def _micro(x, k):
  """[k, R / k, ...]: `objective.accumulated_gradients`' split of a batch into k micro-batches."""
  return x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1)


def test_literal_micro_batches_interleave_rows():
  # Micro-batch 0: sequences 0 and 2 (4 and 2 slots: two rows of 5); micro-batch 1: sequences
  # 1 (nothing to score) and 3 (5 slots: one row, and one empty to match).
  p = pack_micro_batches(np.asarray(PROMPT_IDS_4), np.asarray(PROMPT_MASK_4, bool),
                         np.asarray(COMPLETION_4), np.asarray(COMPLETION_MASK_4, bool),
                         micro_batches=2, row_length=5)
  np.testing.assert_array_equal(p.tokens, [[5, 6, 10, 11, 0], [3, 2, 16, 17, 18],
                                           [4, 14, 0, 0, 0], [0, 0, 0, 0, 0]])
  np.testing.assert_array_equal(p.segments, [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1],
                                             [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]])
  # Slots within each micro-batch's own two rows of 5.
  np.testing.assert_array_equal(p.index, [[1, 2, 3, 0], [0, 0, 0, 0], [5, 6, 0, 0],
                                          [1, 2, 3, 4]])


@pytest.mark.parametrize("k,multiple", [(1, 1), (2, 1), (2, 4), (3, 2), (4, 3)])
def test_micro_batches_split_into_their_own_packing(k, multiple):
  """After `accumulated_gradients`' split, micro-batch i is `pack` of sequences i, i + k, ...
  alone, with empty rows up to a row count shared by all; k = 1 is `pack`."""
  batch = _random_batch(np.random.default_rng(k * 10 + multiple))
  p = pack_micro_batches(*batch, micro_batches=k, row_length=16, multiple=multiple)
  rows = p.tokens.shape[0] // k
  assert p.tokens.shape[0] == rows * k and rows % multiple == 0 and rows == num_rows(rows)
  split = jax.tree.map(lambda x: _micro(x, k), p)
  for i in range(k):
    alone = pack(*(x[i::k] for x in batch), row_length=16)
    assert alone.tokens.shape[0] <= rows
    chex.assert_trees_all_equal(jax.tree.map(lambda x: x[i], split), with_rows(alone, rows))
  if k == 1:
    chex.assert_trees_all_equal(p, pack(*batch, row_length=16, multiple=multiple))


@pytest.mark.parametrize("seed", range(4))
def test_check_layout_knows_each_layout(seed):
  """`check_layout` passes `pack_micro_batches`' layout for its own k and refuses it for
  another k (`pack`'s layout is k = 1)."""
  batch = _random_batch(np.random.default_rng(seed))
  completion, completion_mask = batch[2], batch[3]
  for k in (1, 2, 3):
    p = pack_micro_batches(*batch, micro_batches=k, row_length=16)
    check_layout(p, completion, completion_mask, k)
    for other in {1, 2, 3} - {k}:
      with pytest.raises(ValueError, match="packing"):
        check_layout(p, completion, completion_mask, other)


def test_update_refuses_a_packing_without_the_micro_batch_layout():
  padded, packed = _rollouts(seed=5)  # packed: `pack`'s layout, one micro-batch
  policy = _policy(attention="plain")
  tx, _ = objective.make_optimizer(1e-3, 10, warmup_ratio=0.0, weight_decay=0.0,
                                  max_grad_norm=1.0)
  fns = programs.StepFunctions(policy.graphdef, tx, loss_cfg=LossConfig(), temperature=1.0,
                               on_policy=False, model_cfg=policy.model().cfg)
  with pytest.raises(ValueError, match="pack_micro_batches"):
    fns.update(policy.trainable, tx.init(policy.trainable), policy.frozen,
               _update_batch(packed), micro_batches=2)


def _random_batch(rng, b=12, tp=6, n=9):
  """Left-padded prompts of 1..tp tokens, completions of 0..n tokens (tokens >= 2)."""
  prompt_len = rng.integers(1, tp + 1, b)
  completion_len = rng.integers(0, n + 1, b)
  prompt_mask = np.arange(tp)[None] >= (tp - prompt_len)[:, None]
  completion_mask = np.arange(n)[None] < completion_len[:, None]
  return (rng.integers(2, 97, (b, tp)), prompt_mask, rng.integers(2, 97, (b, n)),
          completion_mask)


@pytest.mark.parametrize("seed", range(6))
def test_every_token_placed_once_in_whole_segments(seed):
  prompt_ids, prompt_mask, completion, completion_mask = batch = _random_batch(
      np.random.default_rng(seed))
  p = pack(*batch, row_length=16)
  rows = p.tokens.shape[0]
  assert p.tokens.shape[1] == 16 and rows == num_rows(rows)  # static: fixed length, a bucket
  # Every scored completion token is the target of exactly one slot, and only those are.
  scored = completion_mask
  np.testing.assert_array_equal(p.targets.reshape(-1)[p.index[scored]], completion[scored])
  assert len(np.unique(p.index[scored])) == scored.sum() == (p.targets > 0).sum()
  # Every sequence is one run of slots in one row, its prompt then its completion, positions
  # from 0; nothing else is in the rows.
  expected = []
  for b in np.flatnonzero(completion_mask.any(1)):
    expected.append(np.concatenate([prompt_ids[b][prompt_mask[b]],
                                    completion[b][completion_mask[b]][:-1]]).tolist())
  found = []
  for r in range(rows):
    for s in np.unique(p.segments[r][p.segments[r] > 0]):
      slots = np.flatnonzero(p.segments[r] == s)
      np.testing.assert_array_equal(slots, np.arange(slots[0], slots[0] + len(slots)))
      np.testing.assert_array_equal(p.positions[r, slots], np.arange(len(slots)))
      found.append(p.tokens[r, slots].tolist())
  assert sorted(found) == sorted(expected)
  assert (p.segments > 0).sum() == sum(map(len, expected))


# -- attention within segments ----------------------------------------------------------------

# Two packed rows of 12 slots: three sequences and empty slots; one sequence filling its row.
SEGMENTS = np.asarray([[1, 1, 1, 1, 2, 2, 2, 2, 2, 3, 3, 0], [1] * 12])


def _per_segment(fn, q, keys, values, weights):
  """Values and grads of `fn` (attention of one unpadded sequence) run on each segment alone,
  placed back at its slots (zero elsewhere)."""
  out = jnp.zeros_like(q)
  grads = [jnp.zeros_like(q), jnp.zeros_like(keys), jnp.zeros_like(values)]
  for r, row in enumerate(SEGMENTS):
    for s in np.unique(row[row > 0]):
      slots = np.flatnonzero(row == s)
      o, vjp = jax.vjp(fn, q[r:r + 1, :, :, slots], keys[r:r + 1, :, :, slots],
                       values[r:r + 1, :, slots])
      dq, dk, dv = vjp(weights[r:r + 1, :, :, slots])
      out = out.at[r, :, :, slots].set(o[0].transpose(2, 0, 1, 3))
      grads[0] = grads[0].at[r, :, :, slots].set(dq[0].transpose(2, 0, 1, 3))
      grads[1] = grads[1].at[r, :, :, slots].set(dk[0].transpose(2, 0, 1))
      grads[2] = grads[2].at[r, :, slots].set(dv[0].transpose(1, 0, 2))
  return out, tuple(grads)


class SegmentAttentionTest(chex.TestCase):

  def _inputs(self):
    b, k, g, s, hd = 2, 2, 3, SEGMENTS.shape[1], 8  # GQA: 3 query heads per KV head
    rng = np.random.default_rng(0)
    q, weights = (jnp.asarray(rng.standard_normal((b, k, g, s, hd)), jnp.float32) for _ in "qw")
    keys = jnp.asarray(rng.standard_normal((b, k, hd, s)), jnp.float32)
    values = jnp.asarray(rng.standard_normal((b, k, s, hd)), jnp.float32)
    # Empty slots' outputs are never read (no cotangent): their queries see no key.
    weights = weights * jnp.asarray(SEGMENTS > 0)[:, None, None, :, None]
    plain_one = lambda q, kk, v: _attention.attend(
        q, kk, v, _attention.visible(jnp.ones((1, q.shape[3]), bool), 0, q.shape[3]))
    return (q, keys, values, weights), _per_segment(plain_one, q, keys, values, weights)

  def _packed(self, fn, q, keys, values, weights):
    out, vjp = jax.vjp(fn, q, keys, values)
    return out * (jnp.asarray(SEGMENTS > 0)[:, None, None, :, None]), vjp(weights)

  @chex.variants(with_jit=True, without_jit=True)
  def test_plain_and_blockwise_equal_each_sequence_alone(self):
    args, want = self._inputs()
    valid, segments = jnp.asarray(SEGMENTS > 0), jnp.asarray(SEGMENTS)
    paths = {
        "plain": lambda q, kk, v: _attention.attend(
            q, kk, v, _attention.visible(valid, 0, q.shape[3], segments)),
        "blockwise": lambda q, kk, v: _attention.blockwise(q, kk, v, valid, 0, block=5,
                                                           segments_BxS=segments),
        "blockwise-scan": lambda q, kk, v: _attention.blockwise(
            q, kk, v, valid, 0, block=5, loop="scan", segments_BxS=segments)}
    for name, fn in paths.items():
      got = self.variant(functools.partial(self._packed, fn))(*args)
      chex.assert_trees_all_close(got, want, atol=ATOL, rtol=0, custom_message=name)

  @chex.variants(with_jit=True, without_jit=True)
  def test_jax_nn_path_equals_each_sequence_alone(self):
    # The cudnn path's call (its mask carries the segments) by jax.nn's XLA implementation.
    (q, keys, values, _), (want, _) = self._inputs()
    valid, segments = jnp.asarray(SEGMENTS > 0), jnp.asarray(SEGMENTS)
    got = self.variant(lambda *a: _attention.cudnn(*a, valid, implementation="xla",
                                                   segments_BxS=segments))(q, keys, values)
    real = np.broadcast_to((SEGMENTS > 0)[:, None, None, :, None], want.shape)
    chex.assert_trees_all_close(np.asarray(got)[real], np.asarray(want)[real], atol=ATOL, rtol=0)


# -- scoring, loss and gradients --------------------------------------------------------------


def _rollouts(seed=0, b=8, tp=5, n=7, row_length=32):
  """A padded rollout (row 0 without completion tokens) and the same rollout packed."""
  prompt_ids, prompt_mask, completion, completion_mask = _random_batch(
      np.random.default_rng(seed), b, tp, n)
  completion_mask[0] = False
  completion_mask[1] = True  # one at the full length
  padded = batches.CompletionBatch(*map(jnp.asarray, (prompt_ids, prompt_mask, completion,
                                               completion_mask)))
  packing = pack(prompt_ids, prompt_mask, completion, completion_mask, row_length=row_length)
  assert packing.tokens.shape[0] < b  # the point: fewer rows than sequences
  return padded, padded.replace(packing=jax.tree.map(jnp.asarray, packing))


def _policy(**cfg):
  model = random_model(tiny_config(**cfg), lora=LoraConfig(rank=2, alpha=4.0), seed=1)
  return programs.Policy.from_model(model, full_finetune=False)


def _masked(tree, mask):
  return jax.tree.map(lambda x: np.asarray(x)[np.asarray(mask)], tree)


@pytest.mark.parametrize("cfg", [dict(attention="plain"), dict(attention="blockwise",
                                                               attention_block=4, remat=True)],
                         ids=["plain", "blockwise-remat"])
def test_logprobs_and_entropies_equal_padded(cfg):
  padded, packed = _rollouts()
  policy = _policy(**cfg)
  score = functools.partial(objective.score, policy.graphdef, temperature=0.7)
  want = jax.jit(score)(policy.trainable, policy.frozen, None, padded)
  mask = padded.completion_mask
  for fn in (jax.jit(score), score):
    got = fn(policy.trainable, policy.frozen, None, packed)
    chex.assert_trees_all_close(_masked(got, mask), _masked(want, mask), atol=ATOL, rtol=0)
    assert all(np.all(np.asarray(x)[~np.asarray(mask)] == 0) for x in got)  # never read


def _update_batch(rollout, seed=2):
  rng = np.random.default_rng(seed)
  b, n = rollout.completion.shape
  noise = lambda scale: jnp.asarray(scale * rng.standard_normal((b, n)), jnp.float32)
  return batches.UpdateBatch(rollout=rollout, logp_old=noise(0.1) - 4.5,
                              logp_ref=noise(0.1) - 4.5, advantage=noise(1.0))


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_loss_and_gradients_equal_padded(aggregation):
  """The separate update's gradients (off-policy: a ratio away from 1, clipped in places)."""
  padded, packed = _rollouts(seed=3)
  policy = _policy(attention="plain")
  grads = jax.jit(functools.partial(
      objective.gradients, policy.graphdef, loss_cfg=LossConfig(aggregation=aggregation, beta=0.04),
      temperature=1.0, on_policy=False))
  want = grads(policy.trainable, policy.frozen, _update_batch(padded))
  got = grads(policy.trainable, policy.frozen, _update_batch(packed))
  chex.assert_trees_all_close(got, want, atol=ATOL, rtol=1e-5)
  assert float(want[0]) != 0.0


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_accumulated_gradients_equal_padded(aggregation):
  """Gradient accumulation over 2 micro-batches, each packed apart: the padded batch's loss,
  metrics and gradients, in 2 micro-batches or in one pass."""
  padded, _ = _rollouts(seed=5)
  packing = pack_micro_batches(padded.prompt_ids, padded.prompt_mask, padded.completion,
                               padded.completion_mask, micro_batches=2, row_length=32)
  packed = padded.replace(packing=jax.tree.map(jnp.asarray, packing))
  policy = _policy(attention="plain")
  trainable = jax.tree.map(lambda x: x + 0.05, policy.trainable)  # every adapter has a gradient
  grads = lambda k: jax.jit(functools.partial(
      objective.accumulated_gradients, policy.graphdef, micro_batches=k,
      loss_cfg=LossConfig(aggregation=aggregation, beta=0.04), temperature=1.0, on_policy=False))
  got = grads(2)(trainable, policy.frozen, _update_batch(packed))
  for k in (2, 1):
    want = grads(k)(trainable, policy.frozen, _update_batch(padded))
    chex.assert_trees_all_close(got, want, atol=ATOL, rtol=1e-5, custom_message=f"k={k}")
  assert float(got[0]) != 0.0


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_fused_gradients_equal_padded(aggregation):
  """The fused update: scoring pass, reference pass, advantage ([P, G, N] groups), loss and
  gradients."""
  padded, packed = _rollouts(seed=4)
  policy = _policy(attention="blockwise", attention_block=4)
  trainable = jax.tree.map(lambda x: x + 0.05, policy.trainable)  # adapters on: policy != ref
  rewards_PxG = jnp.asarray([[1.0, 0.0, 0.5, 0.0], [0.0, 1.0, 1.0, 0.0]])
  fused = jax.jit(functools.partial(
      objective.fused_gradients, policy.graphdef, loss_cfg=LossConfig(aggregation=aggregation),
      adv_cfg=AdvantageConfig(), temperature=1.0))
  want = fused(trainable, policy.frozen, None, padded, rewards_PxG)
  got = fused(trainable, policy.frozen, None, packed, rewards_PxG)
  mask = padded.completion_mask
  (loss, aux, grads, scored), (loss_w, aux_w, grads_w, scored_w) = got, want
  chex.assert_trees_all_close((loss, aux, grads), (loss_w, aux_w, grads_w), atol=ATOL, rtol=1e-5)
  per_token = lambda s: _masked((s.logp_old, s.entropy, s.logp_ref, s.advantage.reshape(8, -1)),
                                mask)
  chex.assert_trees_all_close(per_token(scored), per_token(scored_w), atol=ATOL, rtol=0)
  chex.assert_trees_all_close(scored.adv_metrics, scored_w.adv_metrics, atol=ATOL, rtol=1e-5)


# -- the trainer ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def task(tmp_path_factory):
  return arithmetic_task(tmp_path_factory.mktemp("arith"))


def digit_reward(completions: list[str], answers: list[str]) -> list[float]:
  """A dense reward (the share of digits): rewards vary within a group."""
  return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


TIMINGS = ("step_time", "sample_time", "update_time", "tokens_per_second",
           "sampling/tokens_per_second", "train/tokens_per_second", "perf/update_tflops", "perf/mfu")


@pytest.mark.parametrize("extra", [
    (), ("train.fused_update=false", "train.mini_batches=2"), ("train.grad_accumulation=2",),
    # 32 sequences: 8 per micro-batch, one per batch shard (the tests' 8 CPU devices).
    ("train.mini_batches=2", "train.grad_accumulation=2", "train.num_generations=8")],
    ids=["fused", "separate-programs", "accumulation", "mini-batches-accumulation"])
def test_packed_training_step_equals_padded(task, tmp_path, extra):
  """One training step (fused; or separate programs: 2 mini-batches, 2 micro-batches or both,
  each packed apart): the same metrics and new weights packed and padded."""
  runs, weights = [], []
  for packing in ("true", "false"):
    # No warm-up: the step moves the weights (its learning rate would be 0).
    trainer = Trainer(rl_step_config(task, tmp_path / packing, f"train.packing={packing}",
                                     f"reward.function={__name__}:digit_reward",
                                     "advantage.eps=1e-3", "optim.warmup_ratio=0",
                                     "optim.eps=1e-4", *extra))
    try:
      assert trainer.fused == (not extra)
      state = trainer.initial_state()
      before = jax.device_get(state.trainable)
      state, metrics, _ = trainer.step(state)
      runs.append({k: v for k, v in metrics.items() if k not in TIMINGS})
      weights.append(jax.device_get(state.trainable))
    finally:
      trainer.close()
  # Adam's first step divides each gradient by its size (here plus `optim.eps` 1e-4), which
  # magnifies 1e-7 gradient rounding to ~1e-5 in the weights; the step moved them by ~1e-3.
  moved = jax.tree.map(lambda a, b: np.abs(a - b).max(), weights[1], before)
  assert max(jax.tree.leaves(moved)) > 1e-3
  chex.assert_trees_all_close(weights[0], weights[1], atol=1e-4, rtol=0)
  assert runs[0].keys() == runs[1].keys()
  bad = {k: (runs[0][k], runs[1][k]) for k in runs[0]
         if not np.allclose(runs[0][k], runs[1][k], atol=ATOL, rtol=ATOL)}
  # The gradient norm sums the squares of every adapter's gradient: 1e-7 rounding apart.
  assert bad.keys() <= {"grad_norm"}, bad
  np.testing.assert_allclose(runs[0]["grad_norm"], runs[1]["grad_norm"], rtol=5e-5)


def test_steps_of_varying_lengths_compile_nothing(task, tmp_path):
  """Rows of 512 tokens hold a step's 16 sequences whatever their lengths: after the first
  step, steps with other completion lengths trace and compile nothing."""
  cfg = rl_step_config(task, tmp_path / "run", "train.packing=true", "train.packing_length=512",
                       f"reward.function={__name__}:digit_reward")
  trainer = Trainer(cfg)
  try:
    state, lengths = trainer.initial_state(), []
    state, metrics, _ = trainer.step(state)
    lengths.append(metrics["completions/mean_length"])
    for _ in range(2):
      with Events() as later:
        state, metrics, _ = trainer.step(state)
        jax.block_until_ready(state.trainable)
      lengths.append(metrics["completions/mean_length"])
      assert (later.traces, later.compiles) == (0, 0), lengths
    assert len(set(lengths)) > 1, lengths  # the lengths did vary
  finally:
    trainer.close()


def test_config_errors(task, tmp_path):
  accumulated = TrainConfig().override("train.packing=true", "train.grad_accumulation=2").train
  assert accumulated.packing and accumulated.grad_accumulation == 2
  with pytest.raises(UserError, match="train.packing_length: must be >= 0"):
    TrainConfig().override("train.packing_length=-1")
  with pytest.raises(UserError, match="train.packing_length: 8 tokens cannot hold"):
    Trainer(rl_step_config(task, tmp_path / "run", "train.packing=true",
                           "train.packing_length=8"))


def test_packing_benchmark_refuses_a_prompt_limit_no_prompt_fits():
  script = Path(__file__).resolve().parents[1] / "benchmarks" / "packing.py"
  proc = subprocess.run([sys.executable, str(script), "--max-prompt-tokens", "8"],
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr
  assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]  # one line, no traceback
  assert "--max-prompt-tokens 8: no training prompt fits" in proc.stderr
