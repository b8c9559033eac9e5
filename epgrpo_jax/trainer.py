"""The EP-GRPO training loop: sample -> score -> advantage -> update, with checkpoints.

`train(cfg)` is the whole run; `Trainer.step` is one RL step and reads top to
bottom. Host work (decoding text, rewards) overlaps the scoring pass on the
device; everything on the device is a jitted function of `steps`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import signal
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from epgrpo_jax import advantages, configlib, data, distributed, evaluate, sharding, steps
from epgrpo_jax.checkpointing import Checkpointer, committed_steps
from epgrpo_jax.config import EMBEDDED, TrainConfig
from epgrpo_jax.metrics import MetricsWriter, Progress
from epgrpo_jax.models import (from_pretrained, load_config, load_tokenizer, save_pretrained,
                               stop_token_ids)
from epgrpo_jax.sharding import make_mesh
from epgrpo_jax.rewards import RewardScorer, parse_gold
from epgrpo_jax.sampling import Sampler, bucket
from epgrpo_jax.steps import Policy, Rollout, StepFunctions, StepShardings, UpdateBatch, split_rows

log = logging.getLogger("epgrpo_jax.trainer")


class TrainingError(RuntimeError):
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

  def tree(self) -> dict:
    return {"trainable": self.trainable, "opt_state": self.opt_state,
            "key": jax.random.key_data(self.key)}

  def meta(self) -> dict:
    return {"step": self.step, "consecutive_skips": self.consecutive_skips,
            "skipped_updates": self.skipped_updates, "num_tokens": self.num_tokens}


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
    template = (arithmetic.PROMPT_TEMPLATE if data_cfg.prompt_template == data.MATH_TEMPLATE
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
      raise ValueError(f"train.prompts_per_step: {t.prompts_per_step} is not divisible by the "
                       f"{jax.process_count()} processes")
    model_cfg = load_config(model_dir)
    self.tokenizer = load_tokenizer(model_dir)
    self.renderer = data.PromptRenderer(self.tokenizer, cfg.data)
    self.train_examples, self.skips = data.load_examples(cfg.data.train_files, self.renderer,
                                                         cfg.data, answer_ok=_answer_parses)
    self.heldout: list[data.Example] = []
    if cfg.data.heldout_file:
      self.heldout, heldout_skips = data.load_examples([cfg.data.heldout_file], self.renderer,
                                                       cfg.data, answer_ok=_answer_parses)
      if cfg.data.heldout_limit:
        self.heldout = self.heldout[:cfg.data.heldout_limit]
      self.skips.update({f"heldout_{k}": v for k, v in heldout_skips.items()})
    if self.is_main:
      log.info("data: %d training problems, %d held-out; skipped rows: %s",
               len(self.train_examples), len(self.heldout), self.skips.summary())

    longest = max(len(e.prompt_ids) for e in self.train_examples + self.heldout)
    if longest + cfg.sampling.max_new_tokens > model_cfg.max_position_embeddings:
      raise ValueError(f"sampling.max_new_tokens: the longest prompt ({longest} tokens) plus "
                       f"{cfg.sampling.max_new_tokens} new tokens exceeds the model's context of "
                       f"{model_cfg.max_position_embeddings} tokens")
    self.eos_ids = stop_token_ids(self.tokenizer, model_cfg)
    if not self.eos_ids:
      raise ValueError(f"{model_dir / 'tokenizer_config.json'}: the tokenizer defines no EOS token "
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
    self.tx, self.schedule = steps.make_optimizer(
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
    self.data_iter = data.batch_iterator(
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
    state = self.initial_state()
    latest = self.checkpointer.latest_step() if self.cfg.checkpoint.resume else None
    if latest is None:
      return state
    tree, meta = self.checkpointer.restore(latest, state.tree(), self.data_iter)
    state = RunState(trainable=tree["trainable"], opt_state=tree["opt_state"],
                     key=jax.random.wrap_key_data(tree["key"]), **meta)
    if self.is_main:
      log.info("resumed from %s at step %d", self.checkpointer.directory, state.step)
    return state

  def save(self, state: RunState) -> None:
    self.checkpointer.save(state.step, state.tree(), self.data_iter, state.meta())

  def params(self, trainable: nnx.State) -> tuple[Any, nnx.State]:
    """(graphdef, full state) of the current policy, for the sampler."""
    return self.policy.graphdef, nnx.merge_state(self.policy.frozen, trainable)

  # -- one RL step ------------------------------------------------------------------------

  def step(self, state: RunState) -> tuple[RunState, dict[str, float], dict[str, Any]]:
    """sample -> reward (host, overlapping the scoring pass) -> advantage -> update."""
    cfg, t = self.cfg, self.cfg.train
    P, G = t.prompts_per_step, t.num_generations
    start = time.perf_counter()
    # Each process reads its slice of the global batch; all processes see the whole batch.
    examples = [self.train_examples[i] for i in distributed.allgather_rows(next(self.data_iter))]
    key, sample_key = jax.random.split(state.key)

    # 1. Sample G completions per prompt with the current policy.
    out = self.sampler.sample(self.params(state.trainable), [e.prompt_ids for e in examples],
                              num_samples=G, key=sample_key)
    host = distributed.to_host(out)  # every row on every process
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
    rollout = distributed.place(Rollout(
        prompt_ids=np.repeat(host.prompt_ids, G, axis=0),
        prompt_mask=np.repeat(host.prompt_mask, G, axis=0),
        completion=completion_BxN, completion_mask=completion_mask_BxN), self.shardings.rollout())

    # 2. Dispatch the scoring and reference passes, then score rewards on the host meanwhile.
    if t.reuse_sampler_logprobs:
      logp_old, entropy = (distributed.put(x, self.shardings.rows)
                           for x in (sample_logp_BxN, sample_entropy_BxN))
      logp_ref = self.fns.reference(state.trainable, self.policy.frozen, self.policy.reference,
                                    rollout)
    else:
      logp_old, entropy, logp_ref = self.fns.score(state.trainable, self.policy.frozen,
                                                   self.policy.reference, rollout)
    texts = self.decode(completion_BxN, completion_mask_BxN)
    golds = [self.gold(e) for e in examples for _ in range(G)]
    rewards = self.scorer.score(texts, golds)
    # Process 0's rewards feed the advantage (a check timing out on one host only cannot split).
    rewards_PxG = distributed.broadcast_from_main(np.asarray(rewards.reward, np.float32).reshape(P, G))

    # 3. Token-level advantages.
    shape = (P, G, -1)
    adv, comps, adv_metrics = self.advantage_fn(
        rewards_PxG, entropy.reshape(shape), logp_old.reshape(shape), logp_ref.reshape(shape),
        rollout.completion_mask.reshape(shape), cfg=cfg.advantage)

    # 4. num_iterations x mini_batches clipped-surrogate updates.
    update_start = time.perf_counter()
    batch = UpdateBatch(rollout=rollout, logp_old=logp_old, logp_ref=logp_ref,
                        advantage=adv.reshape(P * G, -1))
    trainable, opt_state = state.trainable, state.opt_state
    update_metrics = []
    for _ in range(t.num_iterations):
      for mb in split_rows(batch, t.mini_batches):
        trainable, opt_state, m = self.fns.update(trainable, opt_state, self.policy.frozen, mb,
                                                  micro_batches=t.grad_accumulation)
        update_metrics.append(m)
    update_metrics = distributed.to_host(update_metrics)
    update_time = time.perf_counter() - update_start

    # 5. Bookkeeping and metrics.
    skipped = int(sum(m["skipped"] for m in update_metrics))
    num_completion_tokens = int(completion_mask_BxN.sum())
    num_prompt_tokens = int(host.prompt_mask.sum()) * G
    new_state = RunState(
        trainable=trainable, opt_state=opt_state, key=key, step=state.step + 1,
        consecutive_skips=state.consecutive_skips + 1 if skipped else 0,
        skipped_updates=state.skipped_updates + skipped,
        num_tokens=state.num_tokens + num_completion_tokens + num_prompt_tokens)
    step_time = time.perf_counter() - start
    metrics = step_metrics(
        rewards=rewards, rewards_PxG=np.asarray(rewards_PxG), mask_BxN=completion_mask_BxN,
        entropy=distributed.to_host(entropy), update_metrics=update_metrics,
        adv_metrics=distributed.to_host(adv_metrics), eos_ids=self.eos_ids,
        completion_BxN=completion_BxN)
    optimizer_updates = new_state.step * t.num_iterations * t.mini_batches
    metrics.update({
        "learning_rate": float(self.schedule(max(optimizer_updates - 1, 0))),
        "step_time": step_time,
        "sample_time": sample_time,
        "update_time": update_time,
        "num_tokens": new_state.num_tokens,
        "tokens_per_second": num_completion_tokens / step_time,
        "sampling/tokens_per_second": num_completion_tokens / max(sample_time, 1e-9),
        "train/tokens_per_second": (t.num_iterations * (num_completion_tokens + num_prompt_tokens)
                                    / max(update_time, 1e-9)),
        "skipped_updates": new_state.skipped_updates,
        "reward_timeouts": float(rewards.timeouts),
        "reward_errors": float(rewards.errors),
    })
    record = {"examples": examples, "texts": texts, "rewards": rewards, "rollout": rollout,
              "advantage": adv, "components": comps, "entropy": entropy}
    return new_state, metrics, record

  # -- helpers ----------------------------------------------------------------------------

  def gold(self, example: data.Example):
    if example.id not in self.golds:
      self.golds[example.id] = parse_gold(example.answer)
    return self.golds[example.id]

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
  check_writable(Path(cfg.train.output_dir))
  ckpt_dir = Path(cfg.train.output_dir) / "checkpoints"
  if not cfg.checkpoint.resume and (found := committed_steps(ckpt_dir)):
    raise ValueError(f"checkpoint.resume: false, but {ckpt_dir} holds checkpoints (latest step "
                     f"{found[-1]}); remove them or choose another train.output_dir")
  if cfg.train.prompts_per_step % jax.process_count():
    raise ValueError(f"train.prompts_per_step: {cfg.train.prompts_per_step} is not divisible by "
                     f"the {jax.process_count()} processes")


def check_writable(directory: Path) -> None:
  """Raises a one-line error unless `directory` can be created and written."""
  try:
    directory.mkdir(parents=True, exist_ok=True)
    probe = directory / f".write-test-{os.getpid()}"
    probe.write_text("")
    probe.unlink()
  except OSError as e:
    raise ValueError(f"train.output_dir: not writable: {directory} ({e.strerror})") from None


def _answer_parses(answer: str) -> bool:
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


def step_metrics(*, rewards, rewards_PxG, mask_BxN, entropy, update_metrics, adv_metrics, eos_ids,
                 completion_BxN) -> dict[str, float]:
  """Per-step metrics with TRL's names where TRL has the metric."""
  lengths = mask_BxN.sum(axis=1)
  last = np.take_along_axis(completion_BxN, np.maximum(lengths - 1, 0)[:, None], axis=1)[:, 0]
  ended = (lengths > 0) & np.isin(last, list(eos_ids))
  group_std = rewards_PxG.std(axis=1, ddof=1) if rewards_PxG.shape[1] > 1 else np.zeros(len(rewards_PxG))
  n_tok = max(mask_BxN.sum(), 1)
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
      "entropy": float(np.where(mask_BxN, entropy, 0.0).sum() / n_tok),
      "kl": mean_update["kl"],
      "clip_ratio/low_mean": mean_update["clip_ratio/low_mean"],
      "clip_ratio/high_mean": mean_update["clip_ratio/high_mean"],
      "clip_ratio/region_mean": mean_update["clip_ratio/region_mean"],
      "grad_norm": mean_update["grad_norm"],
      "loss": mean_update["loss"],
  }
  out.update({k: float(v) for k, v in adv_metrics.items()})
  return out


def train(cfg: TrainConfig) -> dict[str, Any]:
  """Runs a whole training job; returns a summary (held-out accuracy before and after, paths)."""
  distributed.initialize(cfg.distributed)  # before any JAX computation
  preflight(cfg)
  cfg = resolve_embedded(cfg, progress=cfg.logging.progress)
  trainer = Trainer(cfg)
  t = cfg.train
  if trainer.is_main:
    import yaml
    (trainer.out_dir / "config.yaml").write_text(yaml.safe_dump(configlib.to_dict(cfg), sort_keys=False))
  summary: dict[str, Any] = {"output_dir": str(trainer.out_dir)}
  try:
    state = trainer.restore_or_init()
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
      while state.step < t.steps:
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
          trainer.writer.append_jsonl("samples.jsonl", _sample_records(
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


def _sample_records(step: int, record: dict, count: int, tokenizer=None) -> list[dict]:
  """One JSON record per group for the first `count` groups of a step (samples.jsonl).

  Each response has its text, reward and, per token (lists of rounded floats):
  entropy, gate W, outcome advantage W * A_i, anchored signal s~, progress
  advantage, final advantage, tau and bucket; `tokens` (display strings) when
  a tokenizer is given, else only `token_ids`. Read by `epgrpo_jax.heatmap`.
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
        from epgrpo_jax.metrics import token_strings
        r["tokens"] = token_strings(tokenizer, ids)
      r.update({k: rnd(v[p, g][keep]) for k, v in per_token.items()})
      r["bucket"] = bucket[p, g][keep].astype(int).tolist()
      responses.append(r)
    out.append({"step": step, "group": p, "problem_id": e.id, "prompt": e.problem,
                "answer": e.answer, "zero_variance": bool(zero_variance[p]),
                "reward_mean": float(reward[p].mean()), "responses": responses})
  return out
