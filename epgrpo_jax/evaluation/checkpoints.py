"""A training run's checkpoint as a policy: `--checkpoint` resolved to a step directory, the
run's LoRA settings, and the base model with the trained weights restored onto it."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping

import yaml
from flax import nnx

from epgrpo_jax.io import commandline
from epgrpo_jax.io.checkpointing import (restore_trainable, saved_trainable_shapes,
                                         shape_difference, tree_shapes)
from epgrpo_jax.io.errors import MissingFileError, UserError
from epgrpo_jax.io.paths import expand_home
from epgrpo_jax.models import LORA_TARGETS, LoraConfig, from_pretrained, merge_adapters, saved_adapters


@dataclasses.dataclass(frozen=True)
class CheckpointRef:
  """A resolved `--checkpoint`: the step directory and what the run says about it."""

  step_dir: Path
  step: int
  run_dir: Path
  run_config: dict[str, Any] | None  # RUN_DIR/config.yaml, when the trainer wrote one
  trainable: dict[str, tuple[int, ...]]  # saved trainable parameter path -> shape

  @property
  def full_finetune(self) -> bool:
    return not saved_adapters(self.trainable)

  @property
  def lora_rank(self) -> int | None:
    ranks = set(saved_adapters(self.trainable).values())
    return ranks.pop() if len(ranks) == 1 else None

  @property
  def lora_targets(self) -> tuple[str, ...]:
    names = {path.rsplit(".", 1)[-1] for path in saved_adapters(self.trainable)}
    return tuple(t for t in LORA_TARGETS if t in names)


def _step_dirs(root: Path) -> dict[int, Path]:
  """Finished Orbax step directories (temporary ones have non-numeric names)."""
  return {int(p.name): p for p in root.iterdir() if p.is_dir() and p.name.isdigit()}


def resolve_checkpoint(path: str | Path) -> CheckpointRef:
  """`RUN_DIR`, `RUN_DIR/checkpoints` (latest step) or `RUN_DIR/checkpoints/<step>`."""
  p = Path(expand_home(str(path)))
  flag = f"--checkpoint {path}"
  if not p.exists():
    raise MissingFileError(f"{flag}: not found")
  if not p.is_dir():
    raise UserError(f"{flag}: not a directory (expected RUN_DIR, RUN_DIR/checkpoints "
                             "or RUN_DIR/checkpoints/<step>)")
  if p.name.isdigit() and (p / "state").is_dir():
    step_dir = p
  else:
    root = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    steps = _step_dirs(root)
    if not steps and (p / "config.json").is_file():
      raise UserError(f"{flag}: a Hugging Face model directory (e.g. RUN_DIR/policy, with the "
                       "adapters merged); pass it as --model instead")
    if not steps:
      raise MissingFileError(f"{flag}: no checkpoint step directory in {root} (expected "
                              "RUN_DIR, RUN_DIR/checkpoints or RUN_DIR/checkpoints/<step>)")
    step_dir = steps[max(steps)]
  if not (step_dir / "state").is_dir():
    raise MissingFileError(f"{flag}: {step_dir} has no 'state' item (not an epgrpo_jax "
                            "training checkpoint, or an unfinished save)")
  root = step_dir.parent
  run_dir = root.parent if root.name == "checkpoints" else root
  run_config = None
  for cand in (run_dir / "config.yaml", root / "config.yaml"):
    if cand.is_file():
      try:
        run_config = yaml.safe_load(cand.read_text()) or {}
      except yaml.YAMLError:
        raise UserError(f"{cand}: invalid YAML") from None
      if not isinstance(run_config, dict):
        raise UserError(f"{cand}: expected a mapping of config sections")
      break
  try:
    shapes = saved_trainable_shapes(step_dir)
  except Exception as e:  # Orbax raises several types on a damaged checkpoint
    raise UserError(f"{flag}: cannot read {step_dir / 'state'} "
                     f"({type(e).__name__}: {commandline.one_line(e)})") from None
  if not shapes:
    raise UserError(f"{flag}: {step_dir / 'state'} holds no 'trainable' parameters")
  return CheckpointRef(step_dir, int(step_dir.name), run_dir, run_config, shapes)


def config_section(cfg: Mapping[str, Any] | None, name: str) -> dict[str, Any]:
  """The mapping `cfg[name]` of a run's config.yaml ({} when absent or not a mapping)."""
  value = (cfg or {}).get(name)
  return value if isinstance(value, dict) else {}


def checkpoint_lora(ref: CheckpointRef, rank: int | None,
                    alpha: float | None) -> LoraConfig | None:
  """The `LoraConfig` of the run (or None for full fine-tuning): flags, then
  RUN_DIR/config.yaml, then the saved shapes; alpha has no safe default."""
  model_cfg, lora_cfg = config_section(ref.run_config, "model"), config_section(ref.run_config, "lora")
  full = ref.full_finetune
  if "full_finetune" in model_cfg and bool(model_cfg["full_finetune"]) != full:
    raise UserError(f"--checkpoint {ref.step_dir}: config.yaml says model.full_finetune="
                     f"{model_cfg['full_finetune']} but the checkpoint holds "
                     f"{'all weights' if full else 'LoRA adapters'}")
  if full:
    return None
  rank = rank or lora_cfg.get("rank") or ref.lora_rank
  alpha = alpha or lora_cfg.get("alpha")
  targets = tuple(lora_cfg.get("targets") or ref.lora_targets)
  if alpha is None:
    raise UserError(f"--checkpoint {ref.step_dir}: no config.yaml in the run directory to "
                     "read lora.alpha from; pass --lora-alpha (and --lora-rank) as trained")
  lora = LoraConfig(rank=int(rank), alpha=float(alpha), targets=targets)
  if ref.lora_rank is not None and lora.rank != ref.lora_rank:
    raise UserError(f"--checkpoint {ref.step_dir}: adapters of rank {ref.lora_rank}, "
                     f"but rank {lora.rank} was given")
  if set(lora.targets) != set(ref.lora_targets):
    raise UserError(f"--checkpoint {ref.step_dir}: adapters on {list(ref.lora_targets)}, "
                     f"but lora.targets is {list(lora.targets)}")
  return lora


def load_policy(model_dir: str | Path, *, dtype: str = "float32",
                checkpoint: CheckpointRef | None = None, lora=None, seed: int = 0):
  """The model of `model_dir`, with a training checkpoint's weights restored onto it
  (LoRA adapters folded into the kernels). Returns the NNX model."""
  model = from_pretrained(model_dir, dtype=dtype, param_dtype=dtype, lora=lora, seed=seed)
  if checkpoint is None:
    return model
  what = nnx.LoRAParam if lora is not None else nnx.Param
  graphdef, trainable, rest = nnx.split(model, what, ...)
  difference = shape_difference(checkpoint.trainable, tree_shapes(trainable))
  if difference:
    raise UserError(f"--checkpoint {checkpoint.step_dir}: does not fit the model in "
                     f"{model_dir} ({difference}); is --model the run's base model?")
  try:
    restored = restore_trainable(checkpoint.step_dir.parent, checkpoint.step, trainable)
  except Exception as e:  # Orbax raises several types
    raise UserError(f"--checkpoint {checkpoint.step_dir}: cannot restore "
                     f"({type(e).__name__}: {commandline.one_line(e)})") from None
  model = nnx.merge(graphdef, restored, rest)
  return merge_adapters(model) if lora is not None else model
