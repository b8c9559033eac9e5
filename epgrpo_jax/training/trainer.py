"""The EP-GRPO training loop: sample -> score -> advantage -> update, with checkpoints.

`train(cfg)` is the whole run; `Trainer.step` is one RL step and reads top to
bottom. Host work (decoding text, rewards) overlaps the scoring pass on the
device; everything on the device is a jitted function of `steps`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from epgrpo_jax import evaluate
from epgrpo_jax.core import advantages
from epgrpo_jax.io import configlib
from epgrpo_jax.data import pipeline
from epgrpo_jax.parallel import distributed
from epgrpo_jax.parallel import sharding
from epgrpo_jax.training import programs
from epgrpo_jax.io.atomic import write_text_atomic
from epgrpo_jax.io.checkpointing import Checkpointer, committed_steps
from epgrpo_jax.training.config import EMBEDDED, TrainConfig
from epgrpo_jax.io.errors import RunError, UserError
from epgrpo_jax.io.metrics import MetricsWriter, Progress
from epgrpo_jax.models import (check_vocab, from_pretrained, load_hf_config, load_tokenizer, save_pretrained,
                               stop_token_ids)
from epgrpo_jax.parallel.sharding import make_mesh
from epgrpo_jax.rewards import RewardScorer, overlong_penalty, parse_gold
from epgrpo_jax.rollout.sampling import Sampler, bucket
from epgrpo_jax.training.programs import Policy, Rollout, StepFunctions, StepShardings, UpdateBatch, split_rows

log = logging.getLogger("epgrpo_jax.training.trainer")


class TrainingError(RunError):
  """The run cannot continue (e.g. too many non-finite updates in a row)."""


@dataclasses.dataclass
class RunState:
  """Everything a checkpoint restores."""

  trainable: nnx.State
  opt_state: Any
  key: jax.Array
  step: int = 0
  consecutive_skips: int = 0
  skipped_updates: int = 0
  num_tokens: int = 0
  num_samples: int = 0  # completions sampled (dynamic sampling draws more than P x G a step)

  def tree(self) -> dict:
    return {"trainable": self.trainable, "opt_state": self.opt_state,
            "key": jax.random.key_data(self.key)}

  def meta(self) -> dict:
    return {"step": self.step, "consecutive_skips": self.consecutive_skips,
            "skipped_updates": self.skipped_updates, "num_tokens": self.num_tokens,
            "num_samples": self.num_samples}


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


def resolve_embedded(cfg: TrainConfig, progress: bool = True) -> TrainConfig:
  """For model.path=embedded: builds the task and tiny model, warm-starts it, points cfg at them."""
  if cfg.model.path != EMBEDDED:
    return cfg
  from epgrpo_jax.tasks import arithmetic
  e = cfg.embedded
  assets = arithmetic.build_assets(e.resolved_data_dir(), seed=e.seed)
  model_dir = arithmetic.warm_start(assets, steps=e.sft_steps, learning_rate=e.sft_learning_rate,
                                    batch_size=e.sft_batch_size, seed=e.seed, slip=e.sft_slip,
                                    progress=progress)
  data_cfg = cfg.data
  if not data_cfg.train_files:
    # The task's prompts are bare problems ("Compute 7*5-3*2."), as in the warm start.
    template = (arithmetic.PROMPT_TEMPLATE if data_cfg.prompt_template == pipeline.MATH_TEMPLATE
                else data_cfg.prompt_template)
    data_cfg = dataclasses.replace(data_cfg, train_files=(str(assets.train_file),),
                                   heldout_file=data_cfg.heldout_file or str(assets.heldout_file),
                                   heldout_limit=data_cfg.heldout_limit or e.heldout_problems,
                                   prompt_template=template)
  return cfg.replace(model=dataclasses.replace(cfg.model, path=str(model_dir)), data=data_cfg)


class Trainer:
  """Holds the model split, the jitted programs, data and reward workers of a run."""

  def __init__(self, cfg: TrainConfig, *, model_dir: str | Path | None = None,
               mesh: jax.sharding.Mesh | None = None):
    """`mesh` overrides the one built from `cfg.mesh` over all devices (tests)."""
    self.cfg = cfg
    self.is_main = jax.process_index() == 0
    model_dir = Path(model_dir or cfg.model.path)
    self.out_dir = Path(cfg.train.output_dir)
    t = cfg.train

    # Everything that can be wrong with the input is checked before any weights load.
    self.mesh = mesh if mesh is not None else make_mesh(cfg.mesh)  # raises if sizes mismatch
    rows = t.prompts_per_step * t.num_generations
    sharding.check_batch(self.mesh, rows, "train.prompts_per_step x train.num_generations")
    if t.mini_batches * t.grad_accumulation > 1:
      sharding.check_batch(self.mesh, rows // (t.mini_batches * t.grad_accumulation),
                           "train.prompts_per_step x train.num_generations / "
                           "(train.mini_batches x train.grad_accumulation)")
    check_writable(self.out_dir)
    if t.prompts_per_step % jax.process_count():
      raise UserError(f"train.prompts_per_step: {t.prompts_per_step} is not divisible by the "
                       f"{jax.process_count()} processes")
    model_cfg = load_hf_config(model_dir)
    self.tokenizer = load_tokenizer(model_dir)
    check_vocab(self.tokenizer, model_cfg, model_dir)
    self.renderer = pipeline.PromptRenderer(self.tokenizer, cfg.data)
    self.train_examples, self.skips = pipeline.load_examples(cfg.data.train_files, self.renderer,
                                                         cfg.data, answer_ok=answer_parses)
    self.heldout: list[pipeline.Example] = []
    if cfg.data.heldout_file:
      self.heldout, heldout_skips = pipeline.load_examples([cfg.data.heldout_file], self.renderer,
                                                       cfg.data, answer_ok=answer_parses,
                                                       field="data.heldout_file")
      if cfg.data.heldout_limit:
        self.heldout = self.heldout[:cfg.data.heldout_limit]
      self.skips.update({f"heldout_{k}": v for k, v in heldout_skips.items()})
    if self.is_main:
      log.info("data: %d training problems, %d held-out; skipped rows: %s",
               len(self.train_examples), len(self.heldout), self.skips.summary())

    longest = max(len(e.prompt_ids) for e in self.train_examples + self.heldout)
    if longest + cfg.sampling.max_new_tokens > model_cfg.max_position_embeddings:
      raise UserError(f"sampling.max_new_tokens: the longest prompt ({longest} tokens) plus "
                       f"{cfg.sampling.max_new_tokens} new tokens exceeds the model's context of "
                       f"{model_cfg.max_position_embeddings} tokens")
    self.eos_ids = stop_token_ids(self.tokenizer, model_cfg)
    if not self.eos_ids:
      raise UserError(f"{model_dir / 'tokenizer_config.json'}: the tokenizer defines no EOS token "
                       f"and config.json no eos_token_id; completions could never end")

    lora = None if cfg.model.full_finetune else cfg.lora
    model = from_pretrained(model_dir, dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype,
                            lora=lora, mesh=self.mesh, seed=t.seed)
    model = _with_runtime_options(model, cfg.model)
    self.model_cfg = model.cfg
    self.policy = Policy.from_model(model, cfg.model.full_finetune)
    self.model_dir = model_dir

    total_updates = t.steps * t.num_iterations * t.mini_batches
    o = cfg.optim
    self.tx, self.schedule = programs.make_optimizer(
        o.learning_rate, total_updates, warmup_ratio=o.warmup_ratio, weight_decay=o.weight_decay,
        max_grad_norm=o.max_grad_norm, b1=o.b1, b2=o.b2, eps=o.eps)
    on_policy = t.num_iterations == 1 and t.mini_batches == 1
    self.shardings = StepShardings.create(self.policy, self.tx, self.mesh)
    self.policy = self.shardings.place_policy(self.policy)
    self.fns = StepFunctions(self.policy.graphdef, self.tx, loss_cfg=cfg.loss,
                             temperature=cfg.sampling.temperature or 1.0, on_policy=on_policy,
                             shardings=self.shardings, remat=cfg.model.remat)
    self.advantage_fn = AdvantageProgram(self.mesh)

    self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
    self.sampler = Sampler(cfg.sampling, eos_ids=self.eos_ids, pad_id=self.pad_id, mesh=self.mesh)
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
    self.checkpointer.save(state.step, state.tree(), self.data_iter, state.meta())

  def params(self, trainable: nnx.State) -> tuple[Any, nnx.State]:
    """(graphdef, full state) of the current policy, for the sampler."""
    return self.policy.graphdef, nnx.merge_state(self.policy.frozen, trainable)

  # -- one RL step ------------------------------------------------------------------------

  def step(self, state: RunState) -> tuple[RunState, dict[str, float], dict[str, Any]]:
    """One RL step: `collect` (sample -> reward -> score -> advantage), then `update`."""
    return self.update(state, self.collect(state))

  def collect(self, state: RunState, examples: list[pipeline.Example] | None = None) -> Collected:
    """Samples G completions of P prompts (the next batch of the data iterator, or `examples`),
    rewards them on the host while the scoring pass runs, and computes the token-level
    advantages: everything `update` trains on. Tools (the heat map) call this alone.

    With dynamic sampling (and no `examples`), rewards come first: `dynamic_round_batch`
    samples further batches of prompts until P groups have a reward signal (or the rounds
    run out), then the scoring pass runs on the P groups it keeps.
    """
    cfg, t = self.cfg, self.cfg.train
    P, G = t.prompts_per_step, t.num_generations
    start = time.perf_counter()
    key, sample_key = jax.random.split(state.key)

    # 1. Sample G completions per prompt with the current policy.
    rewards, dynamic_metrics, rounds = None, {}, 1
    if cfg.dynamic_sampling.enabled and examples is None:
      host, texts, rewards, dynamic_metrics = self.dynamic_round_batch(state.trainable, sample_key)
      rounds = int(dynamic_metrics["dynamic/rounds"])
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
    rollout = distributed.place(Rollout(
        prompt_ids=np.repeat(host.prompt_ids, G, axis=0),
        prompt_mask=np.repeat(host.prompt_mask, G, axis=0),
        completion=completion_BxN, completion_mask=loss_mask_BxN), self.shardings.rollout())

    # 2. Dispatch the scoring and reference passes, then score rewards on the host meanwhile.
    if t.reuse_sampler_logprobs:
      logp_old, entropy = (distributed.put(x, self.shardings.rows)
                           for x in (sample_logp_BxN, sample_entropy_BxN))
      logp_ref = self.fns.reference(state.trainable, self.policy.frozen, self.policy.reference,
                                    rollout)
    else:
      logp_old, entropy, logp_ref = self.fns.score(state.trainable, self.policy.frozen,
                                                   self.policy.reference, rollout)
    if rewards is None:
      texts, rewards = self.score_rewards(host.examples, completion_BxN, completion_mask_BxN)
    # Process 0's rewards feed the advantage (a check timing out on one host only cannot split).
    rewards_PxG = distributed.broadcast_from_main(np.asarray(rewards.reward, np.float32).reshape(P, G))

    # 3. Token-level advantages.
    shape = (P, G, -1)
    adv, comps, adv_metrics = self.advantage_fn(
        rewards_PxG, entropy.reshape(shape), logp_old.reshape(shape), logp_ref.reshape(shape),
        rollout.completion_mask.reshape(shape), cfg=cfg.advantage)
    return Collected(key=key, start=start, sample_time=sample_time, host=host, texts=texts,
                     rewards=rewards, rewards_PxG=np.asarray(rewards_PxG), rollout=rollout,
                     completion_BxN=completion_BxN, completion_mask_BxN=completion_mask_BxN,
                     loss_mask_BxN=loss_mask_BxN, truncated_B=truncated_B, logp_old=logp_old,
                     logp_ref=logp_ref, entropy=entropy, advantage=adv, components=comps,
                     adv_metrics=adv_metrics, rounds=rounds, dynamic_metrics=dynamic_metrics)

  def update(self, state: RunState, c: Collected
             ) -> tuple[RunState, dict[str, float], dict[str, Any]]:
    """num_iterations x mini_batches clipped-surrogate updates on `c`, then the step's
    bookkeeping: (new state, metrics, record of the step for sample dumps)."""
    cfg, t = self.cfg, self.cfg.train
    P, G = t.prompts_per_step, t.num_generations
    update_start = time.perf_counter()
    batch = UpdateBatch(rollout=c.rollout, logp_old=c.logp_old, logp_ref=c.logp_ref,
                        advantage=c.advantage.reshape(P * G, -1))
    trainable, opt_state = state.trainable, state.opt_state
    update_metrics = []
    for _ in range(t.num_iterations):
      for mb in split_rows(batch, t.mini_batches):
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
        num_samples=state.num_samples + c.rounds * P * G)
    step_time = time.perf_counter() - c.start
    metrics = step_metrics(
        rewards=c.rewards, rewards_PxG=c.rewards_PxG, mask_BxN=c.completion_mask_BxN,
        entropy=distributed.to_host(c.entropy), update_metrics=update_metrics,
        adv_metrics=distributed.to_host(c.adv_metrics), eos_ids=self.eos_ids,
        completion_BxN=c.completion_BxN, entropy_mask_BxN=c.loss_mask_BxN)
    metrics.update(c.dynamic_metrics)
    if cfg.loss.mask_truncated_completions:
      metrics["overlong/masked_frac"] = float(c.truncated_B.mean())
    if cfg.reward.overlong_buffer:
      metrics["overlong/penalty_mean"] = float(c.rewards.overlong_penalty.mean())
    optimizer_updates = new_state.step * t.num_iterations * t.mini_batches
    metrics.update({
        "learning_rate": float(self.schedule(max(optimizer_updates - 1, 0))),
        "step_time": step_time,
        "sample_time": c.sample_time,
        "update_time": update_time,
        "num_tokens": new_state.num_tokens,
        "tokens_per_second": num_completion_tokens / step_time,
        "sampling/tokens_per_second": num_completion_tokens / max(c.sample_time, 1e-9),
        "train/tokens_per_second": (t.num_iterations * (num_completion_tokens + num_prompt_tokens)
                                    / max(update_time, 1e-9)),
        "skipped_updates": new_state.skipped_updates,
        "num_samples": new_state.num_samples,
        "reward_timeouts": float(c.rewards.timeouts),
        "reward_errors": float(c.rewards.errors),
    })
    return new_state, metrics, c.record()

  def sample_round(self, trainable: nnx.State, key: jax.Array,
                   examples: list[pipeline.Example] | None = None) -> SampledRound:
    """G completions of each of P prompts: `examples`, else the data iterator's next batch."""
    G = self.cfg.train.num_generations
    if examples is None:
      # Each process reads its slice of the global batch; all processes see the whole batch.
      examples = [self.train_examples[i] for i in distributed.allgather_rows(next(self.data_iter))]
    out = self.sampler.sample(self.params(trainable), [e.prompt_ids for e in examples],
                              num_samples=G, key=key)
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

  def dynamic_round_batch(self, trainable: nnx.State, sample_key: jax.Array):
    """DAPO dynamic sampling: `(round, texts, rewards, metrics)` for P groups.

    Round 0 samples with `sample_key` (what a step without dynamic sampling
    samples); extra round r with `fold_in(sample_key, r)` on the next batch of
    P prompts of the data iterator, until P groups with a reward signal are in
    hand or `dynamic_sampling.max_extra_rounds` are spent. `select_groups`
    then keeps P groups (see there); every round has the step's shapes, so
    nothing recompiles. The data iterator's position (checkpointed) counts
    every round.
    """
    cfg = self.cfg
    P, G = cfg.train.prompts_per_step, cfg.train.num_generations
    rounds, texts, results, signal = [], [], [], []
    for r in range(1 + cfg.dynamic_sampling.max_extra_rounds):
      key = sample_key if r == 0 else jax.random.fold_in(sample_key, r)
      rnd = self.sample_round(trainable, key)
      text, result = self.score_rewards(rnd.examples, rnd.tokens.reshape(P * G, -1),
                                        rnd.mask.reshape(P * G, -1))
      # Every process selects the same groups: process 0's rewards decide.
      result.reward = distributed.broadcast_from_main(
          np.asarray(result.reward, np.float32).reshape(P, G)).reshape(-1)
      rounds.append(rnd)
      texts.append(text)
      results.append(result)
      signal.append(group_has_signal(result.reward.reshape(P, G), cfg.advantage.zero_std_tol))
      if np.concatenate(signal).sum() >= P:
        break
    has_signal = np.concatenate(signal)
    keep = select_groups(has_signal, P)
    batch = merge_rounds(rounds, keep, self.pad_id)
    flat = lambda lists: [x for sub in lists for x in sub]
    all_texts = flat(texts)
    kept_texts = [all_texts[g * G + i] for g in keep for i in range(G)]
    rewards = merge_rewards(results, keep, G)
    kept_signal = int(has_signal[keep].sum())
    metrics = {
        "dynamic/rounds": float(len(rounds)),
        "dynamic/extra_prompts": float((len(rounds) - 1) * P),
        "dynamic/dropped_groups": float((~has_signal).sum() - (P - kept_signal)),
        "dynamic/filled_zero_variance_groups": float(P - kept_signal),
        "dynamic/surplus_signal_groups": float(has_signal.sum() - kept_signal),
    }
    return batch, kept_texts, rewards, metrics

  # -- helpers ----------------------------------------------------------------------------

  def gold(self, example: pipeline.Example):
    """The parsed gold answer, cached by the answer text itself: ids may repeat across files."""
    if example.answer not in self.golds:
      self.golds[example.answer] = parse_gold(example.answer)
    return self.golds[example.answer]

  def decode(self, tokens_BxN: np.ndarray, mask_BxN: np.ndarray) -> list[str]:
    seqs = [row[m].tolist() for row, m in zip(tokens_BxN, mask_BxN)]
    return self.tokenizer.batch_decode(seqs, skip_special_tokens=True)

  def evaluate(self, trainable: nnx.State, key: jax.Array) -> dict[str, float]:
    e = self.cfg.eval
    result = evaluate.evaluate_examples(
        self.sampler_for_eval(), self.params(trainable), self.heldout, self.tokenizer, self.scorer,
        num_samples=e.samples, key=key, prompts_per_batch=e.prompts_per_batch,
        golds=[self.gold(x) for x in self.heldout])
    return result.summary()

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
    self.checkpointer.close()
    self.scorer.close()
    self.writer.close()


def preflight(cfg: TrainConfig) -> None:
  """Checks against this machine what the config cannot check alone, before heavy work."""
  cfg.mesh.shape(jax.device_count())
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
  try:
    parse_gold(answer)
    return True
  except ValueError:
    return False


def _with_runtime_options(model, section):
  """The model with `model.remat`, `model.attention` and `model.attention_block` applied."""
  model.cfg = model.cfg.replace(remat=model.cfg.remat or section.remat, attention=section.attention,
                                attention_block=section.attention_block)
  return model




def advantage_step(rewards_PxG, entropy_PxGxT, logp_old_PxGxT, logp_ref_PxGxT, mask_PxGxT, *,
                   cfg: advantages.AdvantageConfig):
  """The advantage and its diagnostics (gate, components, polarity, zero variance, buckets)."""
  adv, c = advantages.compute_advantages(rewards_PxG, entropy_PxGxT, logp_old_PxGxT,
                                         logp_ref_PxGxT, mask_PxGxT, cfg)
  m = mask_PxGxT.astype(bool)
  n = jnp.maximum(m.sum(), 1)
  mean = lambda x: jnp.sum(jnp.where(m, x, 0.0)) / n
  outcome_sign = jnp.sign(c.outcome)[..., None]
  signed = m & (outcome_sign != 0)
  flips = signed & (jnp.sign(adv) != outcome_sign)
  gate_mean = mean(c.gate)
  zv = c.zero_variance
  buckets = jax.nn.one_hot(c.bucket, cfg.num_buckets) * m[..., None]
  occupancy = buckets.sum(axis=(0, 1, 2)) / n
  cells_PxK = buckets.sum(axis=(1, 2))  # tokens per (group, bucket)
  has_tokens_P = m.any(axis=(1, 2))
  metrics = {
      "ep/gate_mean": gate_mean,
      "ep/gate_std": jnp.sqrt(mean(jnp.square(c.gate - gate_mean))),
      "ep/outcome_adv_mean": mean(c.outcome_token),
      "ep/outcome_adv_abs_mean": mean(jnp.abs(c.outcome_token)),
      "ep/progress_adv_mean": mean(c.progress),
      "ep/progress_adv_abs_mean": mean(jnp.abs(c.progress)),
      "ep/final_adv_mean": mean(adv),
      "ep/final_adv_abs_mean": mean(jnp.abs(adv)),
      "ep/polarity_flip_frac": flips.sum() / jnp.maximum(signed.sum(), 1),
      "ep/zero_variance_frac": zv.mean(),
      "ep/anchor_groups_frac": (zv & jnp.any(c.anchor != 0, axis=-1)).mean(),
      "ep/zero_variance_token_frac": jnp.sum(m & zv[:, None, None]) / n,
      "ep/bucket_occupancy_min": occupancy.min(),
      "ep/bucket_occupancy_max": occupancy.max(),
      "ep/bucket_empty_frac": jnp.sum((cells_PxK == 0) & has_tokens_P[:, None])
                              / jnp.maximum(has_tokens_P.sum() * cfg.num_buckets, 1),
      "ep/signal_abs_mean": mean(jnp.abs(c.signal)),
  }
  return adv, c, metrics


class AdvantageProgram:
  """`advantage_step` jitted with explicit shardings; called like it (with `cfg=`).

  Groups P are split over data x fsdp when those divide P (else replicated);
  the metrics are replicated. One program per (P sharding, config).
  """

  def __init__(self, mesh: jax.sharding.Mesh):
    self.mesh = mesh
    self._programs: dict[Any, Any] = {}

  def __call__(self, rewards_PxG, entropy_PxGxT, logp_old_PxGxT, logp_ref_PxGxT, mask_PxGxT, *,
               cfg: advantages.AdvantageConfig):
    groups = sharding.leading_sharding(self.mesh, np.shape(rewards_PxG))
    program = self._programs.get((groups, cfg))
    if program is None:
      program = jax.jit(functools.partial(advantage_step, cfg=cfg), in_shardings=(groups,) * 5,
                        out_shardings=(groups, groups, sharding.replicated(self.mesh)))
      self._programs[(groups, cfg)] = program
    args = (rewards_PxG, entropy_PxGxT, logp_old_PxGxT, logp_ref_PxGxT, mask_PxGxT)
    return program(*(distributed.put(x, groups) for x in args))


@dataclasses.dataclass
class SampledRound:
  """One sampled batch on the host: P prompts and G completions of each."""

  examples: list  # [P] pipeline.Example
  prompt_ids: np.ndarray  # [P, Tp] left-padded
  prompt_mask: np.ndarray  # [P, Tp]
  tokens: np.ndarray  # [P, G, N]
  mask: np.ndarray  # [P, G, N]
  logp: np.ndarray  # [P, G, N]
  entropy: np.ndarray  # [P, G, N]


@dataclasses.dataclass
class Collected:
  """One step's rollout, rewards and token-level advantages (`Trainer.collect`)."""

  key: jax.Array  # the run's PRNG key after this step
  start: float  # perf_counter at the start of the step
  sample_time: float
  host: SampledRound
  texts: list[str]  # [B] decoded completions
  rewards: Any  # rewards.RewardResult
  rewards_PxG: np.ndarray
  rollout: Rollout
  completion_BxN: np.ndarray
  completion_mask_BxN: np.ndarray
  loss_mask_BxN: np.ndarray  # without truncated completions when they are masked
  truncated_B: np.ndarray
  logp_old: jax.Array
  logp_ref: jax.Array
  entropy: jax.Array
  advantage: jax.Array  # [P, G, N]
  components: Any  # advantages.Components
  adv_metrics: dict[str, Any]
  rounds: int  # sampling rounds (dynamic sampling)
  dynamic_metrics: dict[str, float]

  @property
  def examples(self) -> list[pipeline.Example]:
    return self.host.examples

  def record(self) -> dict[str, Any]:
    """What `sample_records` and the heat map read."""
    return {"examples": self.examples, "texts": self.texts, "rewards": self.rewards,
            "rollout": self.rollout, "advantage": self.advantage, "components": self.components,
            "entropy": self.entropy}


def truncated_rows(completion_BxN: np.ndarray, mask_BxN: np.ndarray, eos_ids) -> np.ndarray:
  """bool [B]: completions that did not end with a stop token (cut at max_new_tokens)."""
  lengths = mask_BxN.sum(axis=1)
  last = np.take_along_axis(completion_BxN, np.maximum(lengths - 1, 0)[:, None], axis=1)[:, 0]
  return ~((lengths > 0) & np.isin(last, list(eos_ids)))


def group_has_signal(rewards_PxG: np.ndarray, zero_std_tol: float) -> np.ndarray:
  """bool [P]: groups whose rewards are not all equal (ddof=1 std >= the advantage's tolerance)."""
  r = np.asarray(rewards_PxG, np.float64)
  if r.shape[1] < 2:
    return np.zeros(r.shape[0], bool)
  return r.std(axis=1, ddof=1) >= zero_std_tol


def select_groups(has_signal_R: np.ndarray, size: int) -> np.ndarray:
  """The `size` groups a dynamic-sampling step trains on, as sorted indices into the R drawn.

  The first `size` groups with a signal in draw order; when fewer were drawn,
  the batch is filled with the earliest zero-variance groups (their outcome
  advantage is 0; EP-GRPO's anchor can still use them), so its shape is static.
  """
  signal = np.flatnonzero(has_signal_R)[:size]
  fill = np.flatnonzero(~np.asarray(has_signal_R, bool))[:size - len(signal)]
  return np.sort(np.concatenate([signal, fill])).astype(np.int64)


def merge_rounds(rounds: list[SampledRound], keep: np.ndarray, pad_id: int) -> SampledRound:
  """The groups `keep` (indices into the rounds' groups, concatenated) as one round; prompts
  are left-padded to the widest round's prompt width."""
  width = max(r.prompt_ids.shape[1] for r in rounds)
  pad = lambda a, value: np.pad(a, ((0, 0), (width - a.shape[1], 0)), constant_values=value)
  cat = lambda get: np.concatenate([get(r) for r in rounds])[keep]
  examples = [e for r in rounds for e in r.examples]
  return SampledRound(examples=[examples[i] for i in keep],
                      prompt_ids=cat(lambda r: pad(r.prompt_ids, pad_id)),
                      prompt_mask=cat(lambda r: pad(r.prompt_mask, False)),
                      tokens=cat(lambda r: r.tokens), mask=cat(lambda r: r.mask),
                      logp=cat(lambda r: r.logp), entropy=cat(lambda r: r.entropy))


def merge_rewards(results: list, keep: np.ndarray, G: int):
  """The RewardResult of the groups `keep` of the rounds' results (counts summed over all)."""
  rows = (keep[:, None] * G + np.arange(G)[None, :]).reshape(-1)
  cat = lambda name: np.concatenate([np.asarray(getattr(r, name)) for r in results])[rows]
  pick = lambda name: [x for r in results for x in getattr(r, name)]
  answers, status = pick("answers"), pick("status")
  merged = dataclasses.replace(
      results[0], reward=cat("reward"), accuracy=cat("accuracy"), format=cat("format"),
      answers=[answers[i] for i in rows], status=[status[i] for i in rows],
      **{k: sum(getattr(r, k) for r in results)
         for k in ("timeouts", "errors", "fast", "checked", "seconds")})
  if results[0].overlong_penalty is not None:
    merged.overlong_penalty = cat("overlong_penalty")
  return merged


def step_metrics(*, rewards, rewards_PxG, mask_BxN, entropy, update_metrics, adv_metrics, eos_ids,
                 completion_BxN, entropy_mask_BxN=None) -> dict[str, float]:
  """Per-step metrics with TRL's names where TRL has the metric.

  `entropy_mask_BxN` (default `mask_BxN`): the tokens the entropy mean is over."""
  lengths = mask_BxN.sum(axis=1)
  ended = ~truncated_rows(completion_BxN, mask_BxN, eos_ids)
  group_std = rewards_PxG.std(axis=1, ddof=1) if rewards_PxG.shape[1] > 1 else np.zeros(len(rewards_PxG))
  entropy_mask_BxN = mask_BxN if entropy_mask_BxN is None else entropy_mask_BxN
  mean_update = {k: float(np.mean([m[k] for m in update_metrics])) for k in update_metrics[0]}
  out = {
      "reward": float(rewards_PxG.mean()),
      "reward_std": float(group_std.mean()),
      "frac_reward_zero_std": float((group_std < 1e-6).mean()),
      "accuracy": float(np.mean(rewards.accuracy)),
      "format": float(np.mean(rewards.format)),
      "completions/mean_length": float(lengths.mean()),
      "completions/min_length": float(lengths.min()),
      "completions/max_length": float(lengths.max()),
      "completions/clipped_ratio": float(1.0 - ended.mean()),
      "entropy": float(np.where(entropy_mask_BxN, entropy, 0.0).sum()
                       / max(entropy_mask_BxN.sum(), 1)),
      "kl": mean_update["kl"],
      "clip_ratio/low_mean": mean_update["clip_ratio/low_mean"],
      "clip_ratio/high_mean": mean_update["clip_ratio/high_mean"],
      "clip_ratio/region_mean": mean_update["clip_ratio/region_mean"],
      "grad_norm": mean_update["grad_norm"],
      "loss": mean_update["loss"],
  }
  if "entropy_mask/kept_frac" in mean_update:
    out["entropy_mask/kept_frac"] = mean_update["entropy_mask/kept_frac"]
  out.update({k: float(v) for k, v in adv_metrics.items()})
  return out


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
      import yaml
      write_text_atomic(trainer.out_dir / "config.yaml",
                        yaml.safe_dump(configlib.to_dict(cfg), sort_keys=False))
    trainer.writer.write(state.step, {f"data/skipped_{k}": v for k, v in trainer.skips.items()}
                         | {"data/train_problems": len(trainer.train_examples),
                            "data/heldout_problems": len(trainer.heldout)})
    eval_key = jax.random.key(t.seed + 1)
    if cfg.eval.before and trainer.heldout and state.step == 0:
      summary["heldout_before"] = trainer.evaluate(state.trainable, eval_key)
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
      summary["heldout_after"] = trainer.evaluate(state.trainable, eval_key)
      trainer.writer.write(state.step, summary["heldout_after"], prefix="heldout/")
      _say(trainer, f"held-out after RL:  {_fmt_eval(summary['heldout_after'])}")
    # Every process takes part (the weights may be sharded); only process 0 writes.
    summary["policy_dir"] = str(trainer.export(state.trainable, trainer.out_dir / "policy"))
    summary["steps"] = state.step
    trainer.writer.write_json("summary.json", summary)
    return summary
  finally:
    trainer.close()


def _fmt_eval(m: dict[str, float]) -> str:
  return " ".join(f"{k}={100 * v:.1f}%" for k, v in m.items() if k in ("accuracy", "format"))


def _say(trainer: Trainer, line: str) -> None:
  if trainer.is_main:
    print(line, flush=True)


def sample_records(step: int, record: dict, count: int, tokenizer=None) -> list[dict]:
  """One JSON record per group for the first `count` groups of a step (samples.jsonl).

  Each response has its text, reward and, per token (lists of rounded floats):
  entropy, gate W, outcome advantage W * A_i, anchored signal s~, progress
  advantage, final advantage, tau and bucket; `tokens` (display strings) when
  a tokenizer is given, else only `token_ids`. Read by `epgrpo_jax.tools.heatmap`.
  """
  examples, texts, rewards = record["examples"], record["texts"], record["rewards"]
  P = len(examples)
  G = len(texts) // P
  c = record["components"]
  per_token = {
      "entropy": np.asarray(record["entropy"]).reshape(P, G, -1),
      "gate": np.asarray(c.gate), "outcome": np.asarray(c.outcome_token),
      "signal": np.asarray(c.signal), "progress": np.asarray(c.progress),
      "advantage": np.asarray(record["advantage"]), "tau": np.asarray(c.tau)}
  bucket = np.asarray(c.bucket)
  token_ids = np.asarray(record["rollout"].completion).reshape(P, G, -1)
  mask = np.asarray(record["rollout"].completion_mask).reshape(P, G, -1)
  reward = np.asarray(rewards.reward, np.float64).reshape(P, G)
  outcome, anchor = np.asarray(c.outcome), np.asarray(c.anchor)
  zero_variance = np.asarray(c.zero_variance)
  answers = list(getattr(rewards, "answers", None) or [None] * (P * G))
  rnd = lambda x: (np.round(np.asarray(x, np.float64), 4) + 0.0).tolist()  # + 0.0: no -0.0
  out = []
  for p, e in enumerate(examples[:count]):
    responses = []
    for g in range(G):
      keep = mask[p, g].astype(bool)
      ids = token_ids[p, g][keep].tolist()
      r = {"sample": g, "completion": texts[p * G + g], "reward": float(reward[p, g]),
           "extracted": answers[p * G + g], "outcome_adv": round(float(outcome[p, g]), 5),
           "anchor": float(anchor[p, g]), "length": len(ids), "token_ids": ids}
      if tokenizer is not None:
        from epgrpo_jax.io.metrics import token_strings
        r["tokens"] = token_strings(tokenizer, ids)
      r.update({k: rnd(v[p, g][keep]) for k, v in per_token.items()})
      r["bucket"] = bucket[p, g][keep].astype(int).tolist()
      responses.append(r)
    out.append({"step": step, "group": p, "problem_id": e.id, "prompt": e.problem,
                "answer": e.answer, "zero_variance": bool(zero_variance[p]),
                "reward_mean": float(reward[p].mean()), "responses": responses})
  return out
