"""A dense layer with optional low-rank adapters, and LoRA parameter filters.

Unlike `nnx.LoRA`, the adapter output is scaled by alpha / rank, and the layer
can run with its adapters switched off (the reference policy) without a
second copy of the base weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

# Filters over model state: adapters only, and the frozen base.
LORA = nnx.LoRAParam
BASE = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))


class Linear(nnx.Module):
  """y = x @ kernel (+ bias) (+ scale * (x @ lora_a) @ lora_b)."""

  def __init__(self, d_in: int, d_out: int, *, use_bias: bool, param_dtype, dtype,
               rngs: nnx.Rngs, lora_rank: int = 0, lora_scale: float = 1.0):
    init = jax.nn.initializers.normal(0.02)
    self.kernel = nnx.Param(init(rngs.params(), (d_in, d_out), param_dtype))
    self.bias = nnx.Param(jnp.zeros((d_out,), param_dtype)) if use_bias else None
    self.dtype = dtype
    self.lora_scale = lora_scale
    self.merged = False  # adapters folded into `kernel` (see merge_lora)
    if lora_rank:
      a_init = jax.nn.initializers.he_uniform()  # kaiming-uniform, as PEFT initialises A
      self.lora_a = nnx.LoRAParam(a_init(rngs.params(), (d_in, lora_rank), jnp.float32))
      self.lora_b = nnx.LoRAParam(jnp.zeros((lora_rank, d_out), jnp.float32))
    else:
      self.lora_a = self.lora_b = None

  @property
  def has_lora(self) -> bool:
    return self.lora_a is not None

  def __call__(self, x, adapters: bool = True):
    x = x.astype(self.dtype)
    y = x @ self.kernel[...].astype(self.dtype)
    if self.bias is not None:
      y = y + self.bias[...].astype(self.dtype)
    if self.has_lora and adapters != self.merged:
      sign = -1.0 if self.merged else 1.0
      a = self.lora_a[...].astype(self.dtype)
      b = self.lora_b[...].astype(self.dtype)
      y = y + (sign * self.lora_scale * ((x @ a) @ b)).astype(y.dtype)
    return y

  def delta(self) -> jax.Array:
    """scale * A @ B, float32."""
    return self.lora_scale * (self.lora_a[...] @ self.lora_b[...])

  def merged_kernel(self) -> jax.Array:
    """The kernel with the adapters folded in (float32), whether or not merged."""
    w = self.kernel[...].astype(jnp.float32)
    if self.has_lora and not self.merged:
      w = w + self.delta()
    return w


def lora_layers(model: nnx.Module):
  """Yields every `Linear` of the model that carries adapters."""
  for _, node in nnx.iter_graph(model):
    if isinstance(node, Linear) and node.has_lora:
      yield node


def merge_lora(model: nnx.Module) -> None:
  """Folds every adapter into its kernel in place (faster inference); reversible."""
  for layer in lora_layers(model):
    if not layer.merged:
      layer.kernel[...] = (layer.kernel[...].astype(jnp.float32) + layer.delta()).astype(
          layer.kernel[...].dtype)
      layer.merged = True


def unmerge_lora(model: nnx.Module) -> None:
  """Undoes `merge_lora` (exact in float32 up to rounding)."""
  for layer in lora_layers(model):
    if layer.merged:
      layer.kernel[...] = (layer.kernel[...].astype(jnp.float32) - layer.delta()).astype(
          layer.kernel[...].dtype)
      layer.merged = False
