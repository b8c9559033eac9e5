"""Rollouts up to k policy versions stale (`rollout.max_staleness`; docs/async.md).

With k >= 1 a step's batch is not sampled when the step starts: `StaleRollouts` keeps k batches
in flight, sampled and rewarded by one worker thread with the policy of the step that drew them,
while the main thread scores and updates. Each batch carries its policy version v, the number of
optimizer steps its sampling policy had taken; at step s (s steps taken) it is trained on only if
s - v <= k, and an older one is dropped (counted) and replaced by a fresh batch. No batch is
drawn for a step past the run's last, so none is sampled and left untrained. The worker's
sampler programs and the main thread's update programs are both dispatched to JAX: on a rollout
mesh beside the training mesh they run at the same time; on one accelerator the device runs them
in turn and the host's share overlaps (the decode loop's host side, detokenising, rewards); on
one CPU device XLA runs both at once on the host's cores, which they share.

The prompts of every batch are drawn in the main thread in step order, and batch j of the ones
drawn at a step samples with `batch_keys(the step's sample key)[j]`, so a run is a function of
its config and seed alone. A checkpoint holds the batches in flight (`inflight_tree`, taken once
the worker is idle) with their versions and prompt indices; `restore` puts them back and rewards
them again, so a resumed run trains on the completions the uninterrupted one trains on.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import time
from typing import Any, Callable

import jax
import numpy as np

from epgrpo_jax.io.errors import UserError
from epgrpo_jax.training.rollouts import SampledRound

log = logging.getLogger("epgrpo_jax.training.staleness")

ROUND_ARRAYS = ("prompt_ids", "prompt_mask", "tokens", "mask", "logp", "entropy")


def too_stale(version: int, step: int, max_staleness: int) -> bool:
  """Whether a batch sampled by policy version `version` is too old to train on at `step`."""
  return step - version > max_staleness


def batches_wanted(step: int, steps: int, max_staleness: int) -> int:
  """How many batches are in flight once step `step` (of `steps`) has drawn: its own and one for
  each of the next k steps that the run will take (none for a step past the last, so the
  last k steps draw nothing new), at least 1."""
  return 1 + max(min(max_staleness, steps - 1 - step), 0)


def run_steps(steps: int, max_samples: int, samples_per_step: int) -> int:
  """The number of steps a run takes: `train.steps`, or fewer when `train.max_samples` (0: no
  bound) stops it first, after the first step whose completions reach it (a run with rollouts
  ahead samples exactly `samples_per_step` = P x G a step: no dynamic sampling)."""
  return min(steps, -(-max_samples // samples_per_step)) if max_samples else steps


def batch_keys(sample_key: jax.Array, count: int) -> list[jax.Array]:
  """The sampling keys of `count` batches drawn at one step: the step's sample key first (so a
  step that draws one batch samples it as the synchronous run would), then fold_in(key, j)."""
  return [sample_key if j == 0 else jax.random.fold_in(sample_key, j) for j in range(count)]


def split_devices(devices: list, rollout_devices: int) -> tuple[list, list]:
  """(training devices, rollout devices): the last `rollout_devices` go to the sampler
  (none: the sampler shares the training mesh)."""
  if rollout_devices >= len(devices):
    raise UserError(f"rollout.devices: {rollout_devices} leaves no device for training "
                    f"(there are {len(devices)})")
  cut = len(devices) - rollout_devices
  return list(devices[:cut]), list(devices[cut:])


def check_rollout_mesh(section, mesh: jax.sharding.Mesh, rollout_mesh: jax.sharding.Mesh) -> None:
  """Raises a config error when rollouts ahead (`section`: the config's `rollout`) would share
  a training mesh of several devices: two threads dispatching multi-device programs to the
  same devices can queue them in different orders on different devices, and their collectives
  then wait on each other for ever."""
  if section.max_staleness and rollout_mesh is mesh and mesh.size > 1:
    raise UserError(f"rollout.max_staleness: {section.max_staleness} on a mesh of {mesh.size} "
                    f"devices needs rollout.devices (the sampler's own devices, e.g. "
                    f"{mesh.size // 2}); sharing one device with the update is fine")


@dataclasses.dataclass
class InFlight:
  """One batch drawn ahead: its policy version, its prompts' indices into the training
  examples, and the worker's job, which returns (SampledRound, texts, RewardResult)."""

  version: int
  indices: np.ndarray  # [P]
  future: concurrent.futures.Future


class StaleRollouts:
  """The batches in flight of a run with `rollout.max_staleness` = k >= 1.

  `draw()` gives the next P prompts' indices (the data iterator; main thread);
  `params(trainable)` the policy as the sampler takes it (main thread: a copy of the adapters,
  or the adapters sent to the rollout mesh); `sample(params, examples, key)` a SampledRound and
  `reward(examples, completion_BxN, mask_BxN)` its (texts, RewardResult) (both in the worker
  thread; `examples`: `pipeline.Example`s). `steps`: the run's number of steps
  (`train.steps`): no batch is drawn for a step past the last (`batches_wanted`).
  """

  def __init__(self, max_staleness: int, *, draw: Callable, params: Callable, sample: Callable,
               reward: Callable, examples: list, steps: int):
    self.k, self.steps = max_staleness, steps
    self.draw, self.params, self.sample, self.reward = draw, params, sample, reward
    self.examples = examples
    self.queue: collections.deque[InFlight] = collections.deque()
    self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollouts")

  def _job(self, params, indices: np.ndarray, key: jax.Array):
    return self._rewarded(self.sample(params, [self.examples[i] for i in indices], key))

  def _rewarded(self, rnd: SampledRound):
    flat = lambda x_PxGxN: x_PxGxN.reshape(-1, x_PxGxN.shape[-1])
    return (rnd, *self.reward(rnd.examples, flat(rnd.tokens), flat(rnd.mask)))

  def take(self, trainable, step: int, sample_key: jax.Array):
    """The batch step `step` trains on: (SampledRound, texts, rewards, version, metrics).
    First drops the batches too stale for this step, then draws as many new batches (sampled
    by `trainable`, version `step`) as keep k in flight after this one is taken, fewer near
    the run's end (`batches_wanted`)."""
    dropped = 0
    while self.queue and too_stale(self.queue[0].version, step, self.k):
      self.queue.popleft().future.result()  # let it finish: the worker runs one job at a time
      dropped += 1
    want = batches_wanted(step, self.steps, self.k) - len(self.queue)
    if want > 0:
      params = self.params(trainable)
      for key in batch_keys(sample_key, want):
        indices = np.asarray(self.draw(), np.int64)
        self.queue.append(InFlight(step, indices, self.pool.submit(self._job, params, indices, key)))
    batch = self.queue.popleft()
    start = time.perf_counter()
    rnd, texts, rewards = batch.future.result()
    rows = int(np.prod(rnd.tokens.shape[:2]))
    metrics = {"rollout/policy_version": float(batch.version),
               "rollout/staleness": float(step - batch.version),
               "rollout/dropped_stale": float(dropped * rows),
               "rollout/in_flight": float(len(self.queue)),
               "rollout/wait_time": time.perf_counter() - start}
    return rnd, texts, rewards, batch.version, metrics

  def wait(self) -> None:
    """Blocks until the worker has finished every job (its rewards use the shared scorer)."""
    for batch in self.queue:
      batch.future.result()

  def inflight_tree(self) -> dict[str, dict[str, np.ndarray]]:
    """The batches in flight as arrays for a checkpoint ({} when none), once they are done."""
    out = {}
    for j, batch in enumerate(self.queue):
      rnd = batch.future.result()[0]
      out[str(j)] = {"version": np.asarray(batch.version, np.int64), "indices": batch.indices,
                     **{name: np.asarray(getattr(rnd, name)) for name in ROUND_ARRAYS}}
    return out

  def restore(self, tree: dict[str, Any]) -> None:
    """Replaces the batches in flight by a checkpoint's (`inflight_tree`), rewarded again."""
    self.wait()
    self.queue.clear()
    for j in sorted(tree, key=int):
      b = tree[j]
      indices = np.asarray(b["indices"], np.int64)
      rnd = SampledRound([self.examples[i] for i in indices],
                         *(np.asarray(b[name]) for name in ROUND_ARRAYS))
      future = self.pool.submit(self._rewarded, rnd)
      self.queue.append(InFlight(int(b["version"]), indices, future))

  def close(self) -> None:
    self.pool.shutdown(wait=True, cancel_futures=True)
