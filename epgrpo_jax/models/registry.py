"""Model families keyed by the Hugging Face `model_type`, and the functions that dispatch on it.

A family is one package under `models/` (e.g. `models/qwen2/`) that builds a `Family` and
calls `register` when imported (`models/__init__` imports every family). It owns its module
class, its config.json mapping, its HF weight table, the logical sharding axes of its base
weights and its LoRA targets; the rest of the package asks this registry.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

from flax import nnx

from epgrpo_jax.io.errors import UserError
from epgrpo_jax.models import _lora
from epgrpo_jax.models._config import LoraConfig, ModelConfig
from epgrpo_jax.models.interface import Cache, CausalLM

# One row of a weight table: HF tensor name (regex, full match) -> NNX path template (the
# groups fill `{0}`, `{1}`, ...) and whether HF stores it transposed ([out, in] vs our [in, out]).
WeightRow = tuple[str, str, bool]
# One row of a sharding table: NNX parameter path (regex, full match) -> logical axes.
AxesRow = _lora.AxesRow


@dataclasses.dataclass(frozen=True)
class Family:
  """Everything the package needs to know about one model family."""

  model_type: str  # config.json's `model_type`
  module: Callable[..., CausalLM]  # module(cfg, *, lora=..., rngs=...)
  config_from_hf: Callable[[dict[str, Any]], dict[str, Any]]  # config.json -> ModelConfig kwargs
  config_to_hf: Callable[[ModelConfig], dict[str, Any]]  # ModelConfig -> config.json
  weights: tuple[WeightRow, ...]  # HF name -> NNX path
  hf_names: Callable[[ModelConfig], list[str]]  # every HF tensor name a config has
  param_axes: tuple[AxesRow, ...]  # base weights (LoRA factors follow their kernel's)
  lora_targets: tuple[str, ...]  # the projections that may carry adapters
  init_cache: Callable[..., Cache]  # (cfg, batch, slots, dtype=None) -> an empty cache
  ignored: tuple[str, ...] = ()  # HF names (regex) some exporters add that carry nothing we need

  def hf_to_nnx(self, name: str) -> tuple[str, bool] | None:
    """The NNX path of an HF tensor name and whether it is transposed; None if unknown."""
    for pattern, template, transpose in self.weights:
      m = re.fullmatch(pattern, name)
      if m:
        return template.format(*m.groups()), transpose
    return None

  def nnx_to_hf(self, cfg: ModelConfig) -> dict[str, tuple[str, bool]]:
    """Every HF tensor name this config has -> (NNX path, transposed)."""
    return {name: self.hf_to_nnx(name) for name in self.hf_names(cfg)}

  def param_rules(self) -> tuple[AxesRow, ...]:
    """`param_axes` and the rows of the projections that adapters wrap (`_lora.param_rules`:
    the base's as the plain layer's, the factors' from the kernel's). The table
    `parallel.sharding` takes."""
    return _lora.param_rules(self.param_axes)

  def check_lora(self, lora: LoraConfig | None) -> None:
    """UserError unless every LoRA target is a projection of this family."""
    bad = [t for t in (lora.targets if lora else ()) if t not in self.lora_targets]
    if bad:
      raise UserError(f"lora.targets: {bad} are not projections of model_type "
                      f"{self.model_type!r}; choose from {list(self.lora_targets)}")


_FAMILIES: dict[str, Family] = {}


def register(fam: Family) -> Family:
  """Adds a family (a second registration of the same `model_type` is a bug)."""
  if fam.model_type in _FAMILIES and _FAMILIES[fam.model_type] is not fam:
    raise ValueError(f"model_type {fam.model_type!r} is already registered")
  _FAMILIES[fam.model_type] = fam
  return fam


def known() -> tuple[str, ...]:
  return tuple(sorted(_FAMILIES))


def family(model_type: str) -> Family:
  """The registered family of `model_type` (UserError naming the known ones)."""
  if model_type not in _FAMILIES:
    raise UserError(f"model_type: unsupported {model_type!r}; known: {', '.join(known())}")
  return _FAMILIES[model_type]


def build(cfg: ModelConfig, lora: LoraConfig | None, rngs: nnx.Rngs) -> CausalLM:
  """The module of `cfg.model_type` with adapters on `lora.targets` (None: none)."""
  fam = family(cfg.model_type)
  fam.check_lora(lora)
  return fam.module(cfg, lora=lora, rngs=rngs)


def init_cache(cfg: ModelConfig, batch: int, slots: int, dtype=None) -> Cache:
  """An empty KV cache of `cfg`'s family for `batch` rows and `slots` positions."""
  return family(cfg.model_type).init_cache(cfg, batch, slots, dtype)


def param_rules(cfg: ModelConfig) -> tuple[AxesRow, ...]:
  """The sharding table of `cfg`'s family (`Family.param_rules`)."""
  return family(cfg.model_type).param_rules()


def config_from_hf(hf: dict[str, Any], **overrides) -> ModelConfig:
  """The `ModelConfig` of an HF config.json dict; its `model_type` picks the family (absent:
  "qwen2", as older exports omit it)."""
  model_type = hf.get("model_type") or "qwen2"
  if not isinstance(model_type, str):
    raise UserError(f"model_type: expected a string, got {model_type!r}")
  kw = family(model_type).config_from_hf(hf) | {"model_type": model_type}
  return ModelConfig(**(kw | overrides))


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
  """The HF config.json dict of `cfg` (its family's)."""
  return family(cfg.model_type).config_to_hf(cfg)


def abstract_model(cfg: ModelConfig, lora: LoraConfig | None, seed: int = 0) -> CausalLM:
  """`build` without allocating: every array a `jax.ShapeDtypeStruct`."""
  return nnx.eval_shape(lambda: build(cfg, lora, nnx.Rngs(seed)))

