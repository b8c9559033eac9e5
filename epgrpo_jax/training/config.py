"""The training configuration: one typed, self-validating dataclass per section.

The field defaults here are the one source of every default: they are the embedded default
run (`configs/default.yaml` is empty), and `python -m epgrpo_jax.train --print-config`
prints every key with its value.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from epgrpo_jax import estimators
from epgrpo_jax.io import catalog
from epgrpo_jax.io import configlib
from epgrpo_jax.core.advantages import AdvantageConfig
from epgrpo_jax.data.pipeline import DataConfig
from epgrpo_jax.io.errors import UserError
from epgrpo_jax.io.paths import UserPath
from epgrpo_jax.core.losses import LossConfig
from epgrpo_jax.models import LoraConfig, check_attention
from epgrpo_jax.rewards import RewardConfig
from epgrpo_jax.rollout.sampling import SamplingConfig
from epgrpo_jax.parallel.sharding import MeshConfig

EMBEDDED = "embedded"
CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


def _positive(section: str, obj, *names: str) -> None:
  for name in names:
    value = getattr(obj, name)
    if value <= 0:
      raise UserError(f"{section}.{name}: must be > 0, got {value}")


@dataclasses.dataclass(frozen=True)
class ModelRunConfig:
  path: UserPath = EMBEDDED  # a local HF directory, or "embedded" (the built-in tiny model)
  dtype: str = "float32"  # compute dtype: float32 or bfloat16
  param_dtype: str = "float32"  # frozen base weights; trainable weights are always float32
  # True: train every weight (the reference is a frozen copy); False: LoRA adapters only
  # (the reference is the model with the adapters off).
  full_finetune: bool = False
  remat: bool = False  # rematerialise decoder layers in the backward pass (long sequences)
  # auto | plain | blockwise | cudnn (auto: the C++ causal kernel on CPU in float32, plain on
  # CPU otherwise, cuDNN on GPU in bf16, blockwise elsewhere)
  attention: str = "auto"
  attention_block: int = 512  # keys per block of the blockwise attention
  # cuDNN attention over packed rows (train.packing): the most sequences one row may hold
  # (each row's sequences go to cuDNN as lengths and offsets, this many slots a row).
  attention_segments: int = 16

  def __post_init__(self):
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in ("float32", "bfloat16"):
        raise UserError(f"model.{name}: must be float32 or bfloat16, got {getattr(self, name)!r}")
    check_attention(self.attention)
    _positive("model", self, "attention_block")
    _positive("model", self, "attention_segments")
    if self.path != EMBEDDED:
      p = Path(self.path)
      if not p.is_dir():
        raise UserError(f"model.path: not a directory: {self.path}")
      if not (p / "config.json").is_file():
        raise UserError(f"model.path: no config.json in {self.path}")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  learning_rate: float = 3e-3  # the embedded default's LoRA rate; the paper's is 5e-6
  warmup_ratio: float = 0.1
  weight_decay: float = 0.001
  max_grad_norm: float = 1.0  # 0: no clipping
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8

  def __post_init__(self):
    _positive("optim", self, "learning_rate", "eps")
    if not 0 <= self.warmup_ratio < 1:
      raise UserError(f"optim.warmup_ratio: must be in [0, 1), got {self.warmup_ratio}")
    if self.weight_decay < 0 or self.max_grad_norm < 0:
      raise UserError("optim.weight_decay, optim.max_grad_norm: must be >= 0")
    for name in ("b1", "b2"):
      if not 0 <= getattr(self, name) < 1:
        raise UserError(f"optim.{name}: must be in [0, 1), got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class TrainLoopConfig:
  steps: int = 300  # RL steps (one generation batch each)
  prompts_per_step: int = 8  # P, global
  num_generations: int = 8  # G responses per prompt
  num_iterations: int = 1  # passes over each generation batch
  mini_batches: int = 1  # optimizer updates per pass (the batch split in equal parts)
  grad_accumulation: int = 1  # micro-batches summed into each update (memory; same update)
  seed: int = 42
  output_dir: UserPath = "runs/default"
  reuse_sampler_logprobs: bool = False  # skip the scoring pass; use the sampler's log-probs
  # On-policy steps (num_iterations = mini_batches = grad_accumulation = 1, no
  # reuse_sampler_logprobs): score, reference pass, advantage and update in one program, the
  # update's forward standing in for the scoring pass. Other settings keep separate programs.
  fused_update: bool = True
  # Padding-free scoring and update (training/packing.py): the prompt + completion sequences
  # of a batch run packed side by side in rows of `packing_length` tokens, attention kept
  # within each sequence, instead of each padded to the longest. The same log-probs and loss.
  # With grad_accumulation > 1, the update packs each micro-batch apart.
  # Off by default: docs/benchmarks.md ("Packing") has where it wins.
  packing: bool = False
  packing_length: int = 0  # tokens per packed row; 0: the longest prompt (training or held-out)
  # plus sampling.max_new_tokens
  max_consecutive_skips: int = 5  # non-finite updates in a row before the run stops
  max_samples: int = 0  # stop once this many completions were sampled (0: no limit)

  def __post_init__(self):
    _positive("train", self, "steps", "prompts_per_step", "num_generations", "num_iterations",
              "mini_batches", "grad_accumulation", "max_consecutive_skips")
    if not 0 <= self.seed < 2 ** 32:
      raise UserError(f"train.seed: must be in [0, 2**32), got {self.seed}")
    if not self.output_dir.strip():
      raise UserError("train.output_dir: empty (an unset shell variable?); name a directory")
    if self.max_samples < 0:
      raise UserError(f"train.max_samples: must be >= 0, got {self.max_samples}")
    if not isinstance(self.packing, bool):
      raise UserError(f"train.packing: must be a bool, got {self.packing!r}")
    if self.packing_length < 0:
      raise UserError(f"train.packing_length: must be >= 0, got {self.packing_length}")
    rows = self.prompts_per_step * self.num_generations
    if rows % self.mini_batches:
      raise UserError(f"train.mini_batches: {self.mini_batches} does not divide the "
                       f"{rows} sequences of a step")
    if (rows // self.mini_batches) % self.grad_accumulation:
      raise UserError(f"train.grad_accumulation: {self.grad_accumulation} does not divide the "
                       f"{rows // self.mini_batches} sequences of an update")


@dataclasses.dataclass(frozen=True)
class DynamicSamplingConfig:
  """DAPO's dynamic sampling: groups whose rewards are all equal leave the batch, and
  further batches of prompts are sampled to replace them (`rollouts.select_groups`); with
  `sampling.continuous`, one further prompt per such group is queued in the engine, at most
  `max_extra_rounds` x P of them (`rollouts.dynamic_refill_batch`)."""

  enabled: bool = False
  max_extra_rounds: int = 2  # extra sampling rounds (train.prompts_per_step prompts each)

  def __post_init__(self):
    if not isinstance(self.enabled, bool):
      raise UserError(f"dynamic_sampling.enabled: must be a bool, got {self.enabled!r}")
    if self.max_extra_rounds < 0:
      raise UserError(f"dynamic_sampling.max_extra_rounds: must be >= 0, got "
                       f"{self.max_extra_rounds}")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  """Rollouts generated ahead of the update (docs/async.md): with `max_staleness` k >= 1 the
  batches of the next k steps are sampled (and rewarded) while the current step scores and
  updates; a completion sampled by policy version v (v optimizer steps in) is trained on at
  step s only if s - v <= k, else dropped and sampled afresh. 0: today's synchronous step."""

  max_staleness: int = 0
  # Devices given to the sampler (a rollout mesh beside the training mesh, which keeps the
  # rest); 0: the sampler shares the training mesh. Needs max_staleness >= 1.
  devices: int = 0

  def __post_init__(self):
    for name in ("max_staleness", "devices"):
      if getattr(self, name) < 0:
        raise UserError(f"rollout.{name}: must be >= 0, got {getattr(self, name)}")
    if self.devices and not self.max_staleness:
      raise UserError(f"rollout.devices: a rollout mesh of {self.devices} device(s) needs "
                       f"rollout.max_staleness >= 1 (synchronous, one mesh would idle while the "
                       f"other works)")


@dataclasses.dataclass(frozen=True)
class HeldoutEvalConfig:
  every: int = 0  # RL steps between held-out evaluations (0: only before and after)
  before: bool = True  # evaluate the starting policy
  after: bool = True  # evaluate the final policy
  samples: int = 8  # samples per held-out problem
  temperature: float = 1.0
  top_p: float = 1.0
  max_new_tokens: int = 0  # 0: sampling.max_new_tokens
  prompts_per_batch: int = 64

  def __post_init__(self):
    _positive("eval", self, "samples", "prompts_per_batch")
    if self.every < 0 or self.max_new_tokens < 0 or self.temperature < 0:
      raise UserError("eval.every, eval.max_new_tokens, eval.temperature: must be >= 0")
    if not 0 < self.top_p <= 1:
      raise UserError(f"eval.top_p: must be in (0, 1], got {self.top_p}")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  every: int = 25  # RL steps between checkpoints (0: only at the end)
  keep: int = 3
  resume: bool = True  # continue from the latest checkpoint in output_dir if there is one

  def __post_init__(self):
    if self.every < 0:
      raise UserError(f"checkpoint.every: must be >= 0, got {self.every}")
    _positive("checkpoint", self, "keep")


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
  progress: bool = True
  tensorboard: bool = True
  wandb_project: str = ""  # set to log to W&B as well (when installed)
  samples_every: int = 10  # RL steps between dumps of sampled completions (0: never)
  samples_count: int = 4  # groups per dump
  # Peak TFLOP/s per chip behind `perf/mfu` (0: the dense bf16 peak of a known device kind,
  # models/flops.py; no `perf/mfu` on an unknown one, e.g. a CPU).
  peak_tflops: float = 0.0

  def __post_init__(self):
    if self.samples_every < 0 or self.samples_count < 0:
      raise UserError("logging.samples_every, logging.samples_count: must be >= 0")
    if self.peak_tflops < 0:
      raise UserError(f"logging.peak_tflops: must be >= 0, got {self.peak_tflops}")


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  """Multi-process runs; empty values fall back to JAX's cluster auto-detection."""

  coordinator_address: str = ""  # host:port of process 0
  num_processes: int = 0  # 0: auto / single process
  process_id: int = -1  # -1: auto
  initialize: bool = False  # call jax.distributed.initialize

  def __post_init__(self):
    if self.num_processes < 0:
      raise UserError(f"distributed.num_processes: must be >= 0, got {self.num_processes}")
    if self.num_processes and not -1 <= self.process_id < self.num_processes:
      raise UserError(f"distributed.process_id: must be in [0, {self.num_processes}), "
                       f"got {self.process_id}")


@dataclasses.dataclass(frozen=True)
class EmbeddedConfig:
  """The built-in tiny model and arithmetic task (used when model.path is 'embedded')."""

  data_dir: UserPath = ""  # "" : $EPGRPO_DATA_DIR or ~/.cache/epgrpo_jax
  seed: int = 0
  sft_steps: int = 800  # the supervised warm start (cached after the first run)
  sft_learning_rate: float = 3e-3
  sft_batch_size: int = 16
  # Share of demonstration steps with a near-miss result: the warm start then slips at about
  # that rate per step at T 1: headroom that RL removes (docs/results.md, "The default run").
  sft_slip: float = 0.1
  heldout_problems: int = 0  # held-out problems evaluated (a prefix mixing levels); 0: all (257 at seed 0)

  def __post_init__(self):
    _positive("embedded", self, "sft_steps", "sft_learning_rate", "sft_batch_size")
    if self.heldout_problems < 0:
      raise UserError(f"embedded.heldout_problems: must be >= 0 (0: all), got {self.heldout_problems}")
    if not 0 <= self.sft_slip < 1:
      raise UserError(f"embedded.sft_slip: must be in [0, 1), got {self.sft_slip}")

  def resolved_data_dir(self) -> Path:
    return Path(self.data_dir) if self.data_dir else catalog.cache_dir()


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  model: ModelRunConfig = ModelRunConfig()
  lora: LoraConfig = LoraConfig()
  data: DataConfig = DataConfig()
  sampling: SamplingConfig = SamplingConfig(max_new_tokens=64)  # the embedded task's answers are short
  reward: RewardConfig = RewardConfig()
  advantage: AdvantageConfig = AdvantageConfig()  # EP-GRPO with the paper's values (Section VII)
  loss: LossConfig = LossConfig()
  optim: OptimConfig = OptimConfig()
  train: TrainLoopConfig = TrainLoopConfig()
  dynamic_sampling: DynamicSamplingConfig = DynamicSamplingConfig()
  rollout: RolloutConfig = RolloutConfig()
  eval: HeldoutEvalConfig = HeldoutEvalConfig()
  checkpoint: CheckpointConfig = CheckpointConfig()
  logging: LoggingConfig = LoggingConfig()
  mesh: MeshConfig = MeshConfig()
  distributed: DistributedConfig = DistributedConfig()
  embedded: EmbeddedConfig = EmbeddedConfig()

  def __post_init__(self):
    estimators.lookup(self.advantage.estimator)  # a known name, else exit 2 naming the key
    if self.train.num_generations < 2:
      raise UserError(f"train.num_generations: GRPO-family advantages need G >= 2 responses per "
                       f"prompt, got {self.train.num_generations}")
    if self.sampling.max_new_tokens < 1:
      raise UserError("sampling.max_new_tokens: must be >= 1")
    k = self.rollout.max_staleness
    if k and self.sampling.is_greedy and (self.loss.rollout_correction != "none"
                                           or self.train.reuse_sampler_logprobs):
      raise UserError(f"rollout.max_staleness: {k} with loss.rollout_correction or "
                       f"train.reuse_sampler_logprobs weighs or clips against the sampler's "
                       f"log-probs, and greedy sampling (sampling.temperature=0 or "
                       f"sampling.greedy) gives none; sample, or set the correction to 'none'")
    if k and self.dynamic_sampling.enabled:
      raise UserError(f"rollout.max_staleness: {k} cannot be combined with "
                       f"dynamic_sampling.enabled (its extra rounds sample with the current "
                       f"policy); use one or the other")
    if self.loss.rollout_correction != "none" and self.sampling.is_greedy:
      raise UserError(f"loss.rollout_correction: {self.loss.rollout_correction!r} needs the "
                       f"sampler's log-probs of the distribution it drew from, and greedy sampling "
                       f"(sampling.temperature=0 or sampling.greedy) has none; use 'none'")
    if self.reward.overlong_buffer > self.sampling.max_new_tokens:
      raise UserError(f"reward.overlong_buffer: {self.reward.overlong_buffer} exceeds "
                       f"sampling.max_new_tokens ({self.sampling.max_new_tokens})")

  def replace(self, **sections) -> "TrainConfig":
    return dataclasses.replace(self, **sections)

  def override(self, *items: str) -> "TrainConfig":
    """A copy with dotted `key=value` overrides applied (validated)."""
    data = configlib.deep_merge(configlib.to_dict(self), configlib.parse_overrides(list(items)))
    return configlib.build(TrainConfig, data)


def load_config(config_file: str | Path | None = None, overrides: list[str] = ()) -> TrainConfig:
  """TrainConfig from a YAML file (default: configs/default.yaml, which sets nothing) and overrides."""
  default = CONFIG_DIR / "default.yaml"
  return configlib.load(TrainConfig, config_file, overrides,
                        defaults_file=default if default.is_file() else None)
