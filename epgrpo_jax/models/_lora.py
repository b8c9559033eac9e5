"""A dense layer with optional low-rank adapters, and LoRA parameter filters.

Unlike `nnx.LoRA`, the adapter output is scaled by alpha / rank, and the layer
can run with its adapters switched off (the reference policy) without a
second copy of the base weights.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from epgrpo_jax.models._kernels import XLA, Kernels, concatenated, same, xla_matmul

# Filters over model state: adapters only, and the frozen base.
LORA = nnx.LoRAParam
BASE = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))


@functools.cache
def low_rank_product(matmul: Callable = xla_matmul, barrier: Callable = same) -> Callable:
  """(x, a, b) -> (x @ a) @ b over the last axis of x, products by `matmul`, with a backward
  pass that transposes only rank-sized arrays (`rank_transposed_matmul`; XLA:CPU otherwise
  transposes the [tokens, features] activations and gradients to form the adapter gradients,
  the costliest part of the update)."""

  @jax.custom_vjp
  def low_rank(x_NxI, a_IxR, b_RxO):
    return matmul(matmul(x_NxI, a_IxR), b_RxO)

  def fwd(x, a, b):
    xa = matmul(x, a)
    return matmul(xa, b), (x, a, b, xa)

  def bwd(res, dy):
    x, a, b, xa = res
    lead = x.shape[:-1]
    x_NxI, xa_NxR = x.reshape(-1, x.shape[-1]), xa.reshape(-1, xa.shape[-1])
    dy_NxO = dy.reshape(-1, dy.shape[-1])
    dxa_NxR = matmul(dy_NxO, b.T)
    db_RxO = rank_transposed_matmul(xa_NxR, dy_NxO, matmul, barrier)
    da_IxR = rank_transposed_matmul(dxa_NxR, x_NxI, matmul, barrier).T
    dx = matmul(dxa_NxR, a.T).reshape(*lead, x.shape[-1])
    return dx.astype(x.dtype), da_IxR.astype(a.dtype), db_RxO.astype(b.dtype)

  low_rank.defvjp(fwd, bwd)
  return low_rank


def low_rank(x_NxI: jax.Array, a_IxR: jax.Array, b_RxO: jax.Array, kernels: Kernels = XLA) -> jax.Array:
  """(x @ a) @ b over the last axis of x by `low_rank_product` with the kernels' matmul."""
  return low_rank_product(kernels.matmul, kernels.rank_barrier)(x_NxI, a_IxR, b_RxO)


def rank_transposed_matmul(r_NxR: jax.Array, v_NxF: jax.Array, matmul: Callable = xla_matmul,
                           barrier: Callable = same) -> jax.Array:
  """r^T @ v [R, F], contracting over tokens with the rank-sized operand transposed, that
  transpose passed through `barrier` (`Kernels.rank_barrier`: on CPU an optimization barrier
  keeps XLA from folding the transpose back into the dot and transposing the [tokens,
  features] one instead)."""
  return matmul(barrier(r_NxR.T), v_NxF)


class Linear(nnx.Module):
  """y = x @ kernel (+ bias) (+ scale * (x @ lora_a) @ lora_b). Where the kernels fold adapters
  (`Kernels.folds_adapters`), the adapters are folded into the kernel for the product instead
  (`Kernels.merged_lora`: x @ (kernel + scale * lora_a @ lora_b), one product)."""

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

  def __call__(self, x, adapters: bool = True, kernels: Kernels = XLA,
               product: Callable | None = None):
    """The layer on x; `product` (a prepared `x -> x @ kernel`, `Kernels.products`) computes
    the base product instead of `kernels.matmul`."""
    x = x.astype(self.dtype)
    lora = self.has_lora and adapters != self.merged  # adapters to add (subtract if merged)
    if lora:
      a = self.lora_a[...].astype(self.dtype)
      b = self.lora_b[...].astype(self.dtype)
    fold = (lora and adapters and not product
            and kernels.folds_adapters(x.dtype, math.prod(x.shape[:-1]), *self.kernel.shape))
    if fold:
      y = kernels.merged_lora(x, self.kernel[...].astype(self.dtype), a, b, self.lora_scale)
    else:
      y = product(x) if product else kernels.matmul(x, self.kernel[...].astype(self.dtype))
    if self.bias is not None:
      y = y + self.bias[...].astype(self.dtype)
    if lora and not fold:
      sign = -1.0 if self.merged else 1.0
      y = y + (sign * self.lora_scale * low_rank(x, a, b, kernels)).astype(y.dtype)
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


def fused(layers: "list[Linear]", x, adapters: bool, kernels: Kernels = XLA,
          product: Callable | None = None) -> list[jax.Array]:
  """`[layer(x, adapters, kernels) for layer in layers]`, as one product where `fused_product`
  makes one (`product`: the group's prepared one, `Kernels.products`)."""
  y = fused_product(layers, x, adapters, kernels, product)
  if y is None:
    return [layer(x, adapters, kernels) for layer in layers]
  ends = list(itertools.accumulate(layer.kernel.shape[-1] for layer in layers))
  return jnp.split(y, ends[:-1], axis=-1)


def fused_product(layers: "list[Linear]", x, adapters: bool, kernels: Kernels = XLA,
                  product: Callable | None = None) -> jax.Array | None:
  """The layers' outputs concatenated, as one matmul over the concatenated kernels, when each
  layer's kernel alone is its output (no adapters, or adapters merged and wanted), or when
  every layer's unmerged adapters fold into its kernel (`Kernels.folds_adapters` for the group; with
  adapters off, the same product by the base kernels); one larger matmul is faster than
  several small ones. None where the layers must run one by one (other layers with unmerged
  adapters, with or without them). Either way the policy with zero adapters and the
  reference pass round identically: their log-prob difference (the progress signal) is then
  exactly zero, not rounding noise that the bucket z-scores would amplify. `product`: the
  group's prepared product (`Kernels.products`), used for the base product."""
  dtype = layers[0].dtype
  x = x.astype(dtype)
  rows, n = math.prod(x.shape[:-1]), sum(layer.kernel.shape[-1] for layer in layers)
  unmerged = [layer.has_lora and not layer.merged for layer in layers]
  folds = (all(unmerged) and len({layer.lora_scale for layer in layers}) == 1 and not product
           and kernels.folds_adapters(dtype, rows, layers[0].kernel.shape[0], n))
  if len(layers) == 1 or not folds and any(
      layer.has_lora and not (layer.merged and adapters) for layer in layers):
    return None
  weights = tuple(layer.kernel[...].astype(dtype) for layer in layers)
  if product:
    y = product(x)
  elif folds and adapters:
    y = kernels.merged_lora(x, weights, tuple(layer.lora_a[...].astype(dtype) for layer in layers),
                            tuple(layer.lora_b[...].astype(dtype) for layer in layers),
                            layers[0].lora_scale)
  else:
    y = kernels.matmul(x, concatenated(weights))
  if any(layer.bias is not None for layer in layers):
    y = y + jnp.concatenate([
        layer.bias[...].astype(dtype) if layer.bias is not None
        else jnp.zeros(layer.kernel.shape[-1:], dtype) for layer in layers])
  return y


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
