"""The RL step of a run: `Trainer` holds the model split, the jitted programs, the data and the
reward workers; `Trainer.step` is `collect` (sample -> reward -> score -> advantage) then
`update`, and reads top to bottom. Host work (decoding text, rewards) overlaps the scoring
pass on the device; everything on the device is a jitted program (`programs`,
`advantage_program`). A run's pieces are built by `build`, the step's metrics by `metrics`;
the loop around it is `loop.train`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from epgrpo_jax.data import pipeline
from epgrpo_jax.evaluation.heldout import EvalResult, evaluate_examples
from epgrpo_jax.io import configlib
from epgrpo_jax.io.checkpointing import Checkpointer, committed_steps
from epgrpo_jax.io.errors import UserError
from epgrpo_jax.io.metrics import MetricsWriter
from epgrpo_jax.kernels import seam
from epgrpo_jax.models import (as_dtype, check_vocab, from_pretrained, load_hf_config, load_tokenizer,
                               save_pretrained, stop_token_ids)
from epgrpo_jax.parallel import distributed
from epgrpo_jax.parallel.sharding import MeshConfig, make_mesh
from epgrpo_jax.rewards import RewardScorer, overlong_penalty, parse_gold
from epgrpo_jax.rollout import continuous
from epgrpo_jax.rollout.sampling import Sampler, bucket
from epgrpo_jax.training.advantage_program import AdvantageProgram
from epgrpo_jax.training.batches import CompletionBatch, UpdateBatch, split_rows
from epgrpo_jax.training.build import (check_run, load_data, packing_length, step_programs,
                                       with_runtime_options)
from epgrpo_jax.training.config import TrainConfig
from epgrpo_jax.training.metrics import step_report
from epgrpo_jax.training.packing import check_segments, pack_micro_batches
from epgrpo_jax.training.programs import Policy, StepShardings
from epgrpo_jax.training.rollouts import (Collected, SampledRound, dynamic_refill_batch, dynamic_round_batch,
                                          truncated_rows)
from epgrpo_jax.training.staleness import StaleRollouts, check_rollout_mesh, run_steps, split_devices
from epgrpo_jax.training.state import RunState

log = logging.getLogger("epgrpo_jax.training.trainer")


class Trainer:
  """Holds the model split, the jitted programs, data and reward workers of a run."""

  def __init__(self, cfg: TrainConfig, *, model_dir: str | Path | None = None,
               mesh: jax.sharding.Mesh | None = None):
    """`mesh` overrides the one built from `cfg.mesh` over all devices (tests); with
    `rollout.devices`, the sampler gets the last ones as a mesh of its own."""
    self.cfg = cfg
    self.is_main = jax.process_index() == 0
    model_dir = Path(model_dir or cfg.model.path)
    self.out_dir = Path(cfg.train.output_dir)
    t = cfg.train

    # Everything that can be wrong with the input is checked before any weights load.
    train_devices, rollout_devices = split_devices(jax.devices(), cfg.rollout.devices)
    # raises if sizes mismatch
    self.mesh = mesh if mesh is not None else make_mesh(cfg.mesh, devices=train_devices)
    self.rollout_mesh = make_mesh(MeshConfig(), devices=rollout_devices) if rollout_devices else self.mesh
    check_run(cfg, self.mesh, self.out_dir)
    check_rollout_mesh(cfg.rollout, self.mesh, self.rollout_mesh)
    model_cfg = load_hf_config(model_dir)
    self.tokenizer = load_tokenizer(model_dir)
    check_vocab(self.tokenizer, model_cfg, model_dir)
    data = load_data(cfg, self.tokenizer)
    self.renderer, self.train_examples, self.heldout, self.skips = (
        data.renderer, data.train_examples, data.heldout, data.skips)
    if self.is_main:
      log.info("data: %d training problems, %d held-out; skipped rows: %s",
               len(self.train_examples), len(self.heldout), self.skips.summary())
    longest = max(len(e.prompt_ids) for e in self.train_examples + self.heldout)
    self.packing_length = packing_length(cfg, longest, model_cfg.max_position_embeddings)
    self.prompt_slots = bucket(max(len(e.prompt_ids) for e in self.train_examples),  # refilled
                               cfg.sampling.prompt_buckets)  # dynamic sampling's prompts, fixed
    self.eos_ids = stop_token_ids(self.tokenizer, model_cfg)
    if not self.eos_ids:
      raise UserError(f"{model_dir / 'tokenizer_config.json'}: the tokenizer defines no EOS token "
                       f"and config.json no eos_token_id; completions could never end")

    lora = None if cfg.model.full_finetune else cfg.lora
    model = from_pretrained(model_dir, dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype,
                            lora=lora, mesh=self.mesh, seed=t.seed)
    model = with_runtime_options(model, cfg.model)
    self.model_cfg = model.cfg
    self.model_dir = model_dir
    policy = Policy.from_model(model, cfg.model.full_finetune)
    built = step_programs(cfg, policy, self.mesh, model_cfg=model.cfg, warn=True)
    self.tx, self.schedule, self.fused = built.tx, built.schedule, built.fused
    self.shardings, self.fns = built.shardings, built.fns
    self.policy = self.shardings.place_policy(policy)
    self.advantage_fn = AdvantageProgram(self.mesh)

    self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
    self.sampler = Sampler(cfg.sampling, eos_ids=self.eos_ids, pad_id=self.pad_id,
                           mesh=self.rollout_mesh)
    self.scorer = RewardScorer(cfg.reward)
    self.golds = {}
    self.data_iter = pipeline.batch_iterator(
        len(self.train_examples), t.prompts_per_step, seed=t.seed,
        shuffle=cfg.data.shuffle, shard_index=jax.process_index(), shard_count=jax.process_count())
    self.checkpointer = Checkpointer(self.out_dir / "checkpoints", keep=cfg.checkpoint.keep)
    self.writer = MetricsWriter(self.out_dir, enabled=self.is_main,
                                tensorboard=cfg.logging.tensorboard,
                                wandb_project=cfg.logging.wandb_project,
                                config=configlib.to_dict(cfg))
    self.rollouts = None  # rollout.max_staleness >= 1: the batches drawn ahead
    if cfg.rollout.max_staleness:
      # The sampler's own copy of the frozen weights, on the rollout mesh (sent once).
      on_rollout_mesh = StepShardings.create(self.policy, self.tx, self.rollout_mesh)
      self.rollout_frozen = jax.device_put(self.policy.frozen, on_rollout_mesh.frozen)
      self.rollout_trainable = on_rollout_mesh.trainable
      self.rollouts = StaleRollouts(
          cfg.rollout.max_staleness, draw=lambda: distributed.allgather_rows(next(self.data_iter)),
          params=self.sampler_params, sample=self.sample_examples, reward=self.score_rewards,
          examples=self.train_examples,
          steps=run_steps(t.steps, t.max_samples, t.prompts_per_step * t.num_generations))

  # -- state ------------------------------------------------------------------------------

  def initial_state(self) -> RunState:
    trainable = self.policy.trainable
    opt_state = jax.jit(self.tx.init, out_shardings=self.shardings.opt_state)(trainable)
    return RunState(trainable=trainable, opt_state=opt_state,
                    key=distributed.put(jax.random.key(self.cfg.train.seed),
                                        self.shardings.replicated))

  def restore_or_init(self) -> RunState:
    """The newest checkpoint that restores, else a fresh state. Newer checkpoints that fail to
    restore (damaged) are renamed `<step>.damaged`, never deleted; if none restores, the
    checkpoints do not fit this config and the run stops with a one-line error."""
    state = self.initial_state()
    steps = committed_steps(self.checkpointer.directory) if self.cfg.checkpoint.resume else []
    failed: list[tuple[int, str]] = []
    for step in reversed(steps):
      try:
        tree, meta = self.checkpointer.restore(step, state.tree(), self.data_iter)
      except Exception as e:  # Orbax and Grain raise many types for a damaged checkpoint
        failed.append((step, f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"))
        log.warning("checkpoint of step %d cannot be restored (%s)", step, failed[-1][1])
        continue
      if failed:
        self.checkpointer.set_aside([s for s, _ in failed], "damaged")
        log.warning("resumed from step %d; the newer checkpoint(s) of step %s could not be "
                    "restored and were renamed *.damaged in %s", step,
                    ", ".join(str(s) for s, _ in failed), self.checkpointer.directory)
      state = RunState(trainable=tree["trainable"], opt_state=tree["opt_state"],
                       key=jax.random.wrap_key_data(tree["key"]), **meta)
      if self.rollouts is not None:
        self.rollouts.restore(self.checkpointer.restore_inflight(step))
      if self.is_main:
        log.info("resumed from %s at step %d", self.checkpointer.directory, state.step)
      return state
    if failed:
      raise UserError(
          f"checkpoint.resume: no checkpoint in {self.checkpointer.directory} restores into this "
          f"config (step {failed[0][0]}: {failed[0][1]}); was model, lora or full_finetune "
          f"changed? Restore the config of the run, or choose another train.output_dir")
    return state

  def save(self, state: RunState) -> None:
    inflight = self.rollouts.inflight_tree() if self.rollouts is not None else None
    self.checkpointer.save(state.step, state.tree(), self.data_iter, state.meta(), inflight=inflight)

  def params(self, trainable: nnx.State) -> tuple[Any, nnx.State]:
    """(graphdef, full state) of the current policy, for the sampler."""
    return self.policy.graphdef, nnx.merge_state(self.policy.frozen, trainable)

  def sampler_params(self, trainable: nnx.State) -> tuple[Any, nnx.State]:
    """(graphdef, full state) of the current policy for the rollout worker: only the trainable
    state (the LoRA adapters) moves, sent to the rollout mesh or, on a shared mesh, copied (the
    update donates its own buffers while the worker may still read them)."""
    if self.rollout_mesh is self.mesh:
      return self.params(jax.tree.map(jnp.copy, trainable))
    sent = jax.device_put(trainable, self.rollout_trainable)
    return self.policy.graphdef, nnx.merge_state(self.rollout_frozen, sent)

  # -- one RL step ------------------------------------------------------------------------

  def step(self, state: RunState) -> tuple[RunState, dict[str, float], dict[str, Any]]:
    """One RL step: `collect` (sample -> reward -> score -> advantage), then `update`. With
    the fused update, scoring and advantage run inside the update's program instead."""
    return self.update(state, self.collect(state, score=not self.fused))

  def collect(self, state: RunState, examples: list[pipeline.Example] | None = None, *,
              score: bool = True) -> Collected:
    """Samples G completions of P prompts (the next batch of the data iterator, or `examples`),
    rewards them on the host while the scoring pass runs, and computes the token-level
    advantages: everything `update` trains on. Tools (the heat map) call this alone.
    `score=False` stops after the rewards (`Collected.scored` false): the fused update
    scores and computes the advantage in its own program.

    With dynamic sampling (and no `examples`), rewards come first: `dynamic_round_batch`
    samples further batches of prompts until P groups have a reward signal (or the rounds
    run out), with `sampling.continuous` `dynamic_refill_batch` queues a further prompt
    in the engine per group without one; the scoring pass runs on the P groups kept.
    """
    cfg, t = self.cfg, self.cfg.train
    P, G = t.prompts_per_step, t.num_generations
    start = time.perf_counter()
    key, sample_key = jax.random.split(state.key)

    # 1. Sample G completions per prompt with the current policy (or, with
    # rollout.max_staleness, take the oldest batch drawn ahead, sampled and rewarded).
    rewards, dynamic_metrics, rollout_metrics, version = None, {}, {}, state.step
    if self.rollouts is not None and examples is None:
      host, texts, rewards, version, rollout_metrics = self.rollouts.take(
          state.trainable, state.step, sample_key)
    elif cfg.dynamic_sampling.enabled and examples is None and cfg.sampling.continuous:
      host, texts, rewards, dynamic_metrics = dynamic_refill_batch(
          cfg, sample_key, self.draw_examples,
          functools.partial(continuous.sample_queue, self.sampler, self.params(state.trainable), G,
                            prompt_len=self.prompt_slots), self.score_rewards, self.pad_id)
    elif cfg.dynamic_sampling.enabled and examples is None:
      host, texts, rewards, dynamic_metrics = dynamic_round_batch(
          cfg, sample_key, functools.partial(self.sample_round, state.trainable),
          self.score_rewards, self.pad_id)
    else:
      host = self.sample_round(state.trainable, sample_key, examples)
    completion_BxN = host.tokens.reshape(P * G, -1)
    completion_mask_BxN = host.mask.reshape(P * G, -1)
    # Score and train on the used part of the completion buffer only (bucketed, so that
    # the jitted passes compile a bounded number of times).
    n = min(bucket(max(int(completion_mask_BxN.sum(1).max()), 1), cfg.sampling.length_buckets),
            completion_BxN.shape[1])
    completion_BxN, completion_mask_BxN = completion_BxN[:, :n], completion_mask_BxN[:, :n]
    sample_logp_BxN = host.logp.reshape(P * G, -1)[:, :n]
    sample_entropy_BxN = host.entropy.reshape(P * G, -1)[:, :n]
    sample_time = time.perf_counter() - start
    # DAPO overlong filtering: truncated completions are padding from here on (TRL's order).
    truncated_B = truncated_rows(completion_BxN, completion_mask_BxN, self.eos_ids)
    loss_mask_BxN = completion_mask_BxN
    if cfg.loss.mask_truncated_completions:
      loss_mask_BxN = completion_mask_BxN & ~truncated_B[:, None]
    rollout = distributed.place(self.packed(CompletionBatch(
        prompt_ids=np.repeat(host.prompt_ids, G, axis=0),
        prompt_mask=np.repeat(host.prompt_mask, G, axis=0),
        completion=completion_BxN, completion_mask=loss_mask_BxN,
        behaviour_logp=sample_logp_BxN)), self.shardings.rollout())

    # 2. Dispatch the scoring and reference passes, then score rewards on the host meanwhile.
    logp_old = entropy = logp_ref = None  # without `score`, the fused update scores
    if score and t.reuse_sampler_logprobs:
      logp_old, entropy = (distributed.put(x, self.shardings.rows)
                           for x in (sample_logp_BxN, sample_entropy_BxN))
      logp_ref = self.fns.reference(state.trainable, self.policy.frozen, self.policy.reference,
                                    rollout)
    elif score:
      logp_old, entropy, logp_ref = self.fns.score(state.trainable, self.policy.frozen,
                                                   self.policy.reference, rollout)
    if rewards is None:
      texts, rewards = self.score_rewards(host.examples, completion_BxN, completion_mask_BxN)
    # Process 0's rewards feed the advantage (a check timing out on one host only cannot split).
    rewards_PxG = distributed.broadcast_from_main(np.asarray(rewards.reward, np.float32).reshape(P, G))

    # 3. Token-level advantages.
    adv = comps = adv_metrics = None
    if score:
      shape = (P, G, -1)
      adv, comps, adv_metrics = self.advantage_fn(
          rewards_PxG, entropy.reshape(shape), logp_old.reshape(shape), logp_ref.reshape(shape),
          rollout.completion_mask.reshape(shape), cfg=cfg.advantage)
    return Collected(key=key, start=start, sample_time=sample_time, host=host, texts=texts,
                     rewards=rewards, rewards_PxG=np.asarray(rewards_PxG), rollout=rollout,
                     completion_BxN=completion_BxN, completion_mask_BxN=completion_mask_BxN,
                     loss_mask_BxN=loss_mask_BxN, truncated_B=truncated_B, logp_old=logp_old,
                     logp_ref=logp_ref, entropy=entropy, advantage=adv, components=comps,
                     adv_metrics=adv_metrics, dynamic_metrics=dynamic_metrics,
                     sampled_prompts=P + int(dynamic_metrics.get("dynamic/extra_prompts", 0)),
                     version_B=np.full(P * G, version, np.int64), rollout_metrics=rollout_metrics)

  def update(self, state: RunState, c: Collected
             ) -> tuple[RunState, dict[str, float], dict[str, Any]]:
    """num_iterations x mini_batches clipped-surrogate updates on `c`, then the step's
    bookkeeping: (new state, metrics, record of the step for sample dumps)."""
    cfg, t = self.cfg, self.cfg.train
    P, G = t.prompts_per_step, t.num_generations
    update_start = time.perf_counter()
    trainable, opt_state = state.trainable, state.opt_state
    update_metrics = []
    fused = not c.scored
    if fused:  # one program: score, reference, advantage, update
      trainable, opt_state, m, s = self.fns.fused_update(
          trainable, opt_state, self.policy.frozen, self.policy.reference, c.rollout,
          c.rewards_PxG)
      c = dataclasses.replace(c, logp_old=s.logp_old, entropy=s.entropy, logp_ref=s.logp_ref,
                              advantage=s.advantage, components=s.components,
                              adv_metrics=s.adv_metrics)
      update_metrics.append(m)
    else:
      batch = UpdateBatch(rollout=c.rollout, logp_old=c.logp_old, logp_ref=c.logp_ref,
                          advantage=c.advantage.reshape(P * G, -1))
      mini_batches = self.mini_batches(batch)
      for _ in range(t.num_iterations):
        for mb in mini_batches:
          trainable, opt_state, m = self.fns.update(trainable, opt_state, self.policy.frozen, mb,
                                                    micro_batches=t.grad_accumulation)
          update_metrics.append(m)
    update_metrics = distributed.to_host(update_metrics)
    update_time = time.perf_counter() - update_start

    # Bookkeeping and metrics.
    skipped = int(sum(m["skipped"] for m in update_metrics))
    num_completion_tokens = int(c.completion_mask_BxN.sum())
    num_prompt_tokens = int(c.host.prompt_mask.sum()) * G
    new_state = RunState(
        trainable=trainable, opt_state=opt_state, key=c.key, step=state.step + 1,
        consecutive_skips=state.consecutive_skips + 1 if skipped else 0,
        skipped_updates=state.skipped_updates + skipped,
        num_tokens=state.num_tokens + num_completion_tokens + num_prompt_tokens,
        num_samples=state.num_samples + c.sampled_prompts * G)
    step_time = time.perf_counter() - c.start
    metrics = step_report(cfg, c, update_metrics, new_state, update_time=update_time,
                          step_time=step_time, completion_tokens=num_completion_tokens,
                          prompt_tokens=num_prompt_tokens, schedule=self.schedule,
                          model_cfg=self.model_cfg, eos_ids=self.eos_ids, fused=fused)
    return new_state, metrics, c.record()

  def sample_round(self, trainable: nnx.State, key: jax.Array,
                   examples: list[pipeline.Example] | None = None) -> SampledRound:
    """G completions of each of P prompts: `examples`, else the data iterator's next batch."""
    return self.sample_examples(self.params(trainable), examples or self.draw_examples(), key)

  def draw_examples(self) -> list[pipeline.Example]:
    """The data iterator's next P examples (each process reads its slice; all see the whole)."""
    return [self.train_examples[i] for i in distributed.allgather_rows(next(self.data_iter))]

  def sample_examples(self, params, examples: list[pipeline.Example], key: jax.Array) -> SampledRound:
    """G completions of each of `examples` sampled by `params` ((graphdef, state))."""
    out = self.sampler.sample(params, [e.prompt_ids for e in examples],
                              num_samples=self.cfg.train.num_generations, key=key)
    host = distributed.to_host(out)  # every row on every process
    return SampledRound(examples, host.prompt_ids, host.prompt_mask, host.tokens, host.mask,
                        host.logp, host.entropy)

  def score_rewards(self, examples: list[pipeline.Example], completion_BxN: np.ndarray,
                    mask_BxN: np.ndarray) -> tuple[list[str], Any]:
    """(texts, RewardResult) of the completions; with `reward.overlong_buffer`, the reward
    includes DAPO's soft overlong punishment (also kept apart as `overlong_penalty`)."""
    G = self.cfg.train.num_generations
    texts = self.decode(completion_BxN, mask_BxN)
    golds = [self.gold(e) for e in examples for _ in range(G)]
    rewards = self.scorer.score(texts, golds)
    r = self.cfg.reward
    if r.overlong_buffer:
      penalty_B = overlong_penalty(mask_BxN.sum(axis=1), max_len=self.cfg.sampling.max_new_tokens,
                                   buffer=r.overlong_buffer, factor=r.overlong_penalty_factor)
      rewards = dataclasses.replace(rewards, reward=np.asarray(rewards.reward, np.float32)
                                    + penalty_B, overlong_penalty=penalty_B)
    return texts, rewards

  # -- helpers ----------------------------------------------------------------------------

  def packed(self, rollout: CompletionBatch, micro_batches: int = 1) -> CompletionBatch:
    """`rollout` with its `PackedRows` (built on the host) under train.packing, else as it is;
    `micro_batches` > 1: each micro-batch of the update packed apart (`pack_micro_batches`),
    a layout only `fns.update(..., micro_batches=...)` reads."""
    if not self.cfg.train.packing:
      return rollout
    host = distributed.to_host(rollout)
    shards = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
    packing = pack_micro_batches(
        host.prompt_ids, host.prompt_mask, host.completion, host.completion_mask,
        micro_batches=micro_batches, row_length=self.packing_length, multiple=shards)
    if seam.resolve(self.model_cfg.attention, as_dtype(self.model_cfg.dtype),
                    seam.backend_of(self.mesh)) == "cudnn":
      check_segments(packing, self.model_cfg.attention_segments)
    return host.replace(packing=packing)

  def mini_batches(self, batch: UpdateBatch) -> list[UpdateBatch]:
    """The update's `train.mini_batches` row slices of `batch`; packed rollouts are packed
    again per slice, into its `train.grad_accumulation` micro-batches' rows."""
    t = self.cfg.train
    if not t.packing or t.mini_batches * t.grad_accumulation == 1:
      return split_rows(batch, t.mini_batches)
    padded = batch.replace(rollout=batch.rollout.replace(packing=None))
    return [mb.replace(rollout=self.packed(mb.rollout, t.grad_accumulation))
            for mb in split_rows(padded, t.mini_batches)]

  def gold(self, example: pipeline.Example):
    """The parsed gold answer, cached by the answer text itself: ids may repeat across files."""
    if example.answer not in self.golds:
      self.golds[example.answer] = parse_gold(example.answer)
    return self.golds[example.answer]

  def decode(self, tokens_BxN: np.ndarray, mask_BxN: np.ndarray) -> list[str]:
    seqs = [row[m].tolist() for row, m in zip(tokens_BxN, mask_BxN)]
    return self.tokenizer.batch_decode(seqs, skip_special_tokens=True)

  def evaluate(self, trainable: nnx.State, key: jax.Array) -> dict[str, float]:
    return self.heldout_result(trainable, key).summary()

  def heldout_result(self, trainable: nnx.State, key: jax.Array) -> EvalResult:
    """Every held-out problem's per-sample scores under `trainable` (`evaluate` summarises them)."""
    e = self.cfg.eval
    if self.rollouts is not None:
      self.rollouts.wait()  # the worker's rewards and the evaluation share the scorer
    return evaluate_examples(
        self.sampler_for_eval(), self.params(trainable), self.heldout, self.tokenizer, self.scorer,
        num_samples=e.samples, key=key, prompts_per_batch=e.prompts_per_batch,
        golds=[self.gold(x) for x in self.heldout])

  def sampler_for_eval(self) -> Sampler:
    e, s = self.cfg.eval, self.cfg.sampling
    if not hasattr(self, "_eval_sampler"):
      eval_cfg = dataclasses.replace(s, temperature=e.temperature, top_p=e.top_p, top_k=0,
                                     max_new_tokens=e.max_new_tokens or s.max_new_tokens)
      self._eval_sampler = Sampler(eval_cfg, eos_ids=self.eos_ids, pad_id=self.pad_id,
                                   mesh=self.mesh)
    return self._eval_sampler

  def export(self, trainable: nnx.State, directory: Path) -> Path:
    """The trained policy as an HF directory with LoRA merged."""
    model = nnx.merge(self.policy.graphdef, self.policy.frozen, trainable)
    return save_pretrained(model, directory, tokenizer_dir=self.model_dir)

  def close(self) -> None:
    if self.rollouts is not None:
      self.rollouts.close()
    self.checkpointer.close()
    self.scorer.close()
    self.writer.close()

