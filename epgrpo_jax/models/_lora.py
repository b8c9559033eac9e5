"""A dense layer with optional low-rank adapters, and LoRA parameter filters.

Unlike `nnx.LoRA`, the adapter output is scaled by alpha / rank, and the layer
can run with its adapters switched off (the reference policy) without a
second copy of the base weights.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from epgrpo_jax.kernels import cpu as cpu_kernels

# Filters over model state: adapters only, and the frozen base.
LORA = nnx.LoRAParam
BASE = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))


def matmul(x: jax.Array, w_IxO: jax.Array) -> jax.Array:
  """x @ w over the last axis of x, in x's dtype. On CPU in bf16 or fp16, each product
  (forward and backward) is accumulated and returned in float32, then rounded once: XLA:CPU
  computes bf16 x bf16 -> bf16 dots through float32, several times slower than bf16 x bf16
  -> float32 ones, which run on the CPU's bf16 units. Accelerators accumulate in float32
  inside their bf16 dots already."""
  if x.dtype not in (jnp.bfloat16, jnp.float16) or jax.default_backend() != "cpu":
    return x @ w_IxO
  return _rounded_matmul(x, w_IxO)


_ONE_DEVICE: contextvars.ContextVar[bool | None] = contextvars.ContextVar("one_device", default=None)


@contextlib.contextmanager
def one_device_program(flag: bool):
  """While tracing inside, whether the program runs on a single device (outside: whether
  the process has one). Only then may `matmul` call the CPU's AMX kernel, which XLA cannot
  shard over a mesh."""
  token = _ONE_DEVICE.set(flag)
  try:
    yield
  finally:
    _ONE_DEVICE.reset(token)


AMX_MIN_ROWS = 256  # below, packing w (once per product) is not small beside the product


def _on_amx(x, w_IxO) -> bool:
  """Whether `_rounded_matmul` multiplies on AMX tiles: bf16 in a single-device program on a
  CPU with AMX-BF16, a `w` the tiles take, and at least `AMX_MIN_ROWS` rows of x (a decode
  step's product, or an adapter gradient's over rank-many rows, stays XLA's)."""
  one_device = _ONE_DEVICE.get()
  if one_device is None:
    one_device = jax.device_count() == 1
  return (one_device and x.dtype == w_IxO.dtype == jnp.bfloat16 and cpu_kernels.can_pack(w_IxO)
          and math.prod(x.shape[:-1]) >= AMX_MIN_ROWS and cpu_kernels.amx_available())


@jax.custom_vjp
def _rounded_matmul(x, w_IxO):
  if _on_amx(x, w_IxO):
    return cpu_kernels.packed_matmul(x, cpu_kernels.pack_bf16(w_IxO))
  return jnp.matmul(x, w_IxO, preferred_element_type=jnp.float32).astype(x.dtype)


def _rounded_matmul_fwd(x, w_IxO):
  return _rounded_matmul(x, w_IxO), (x, w_IxO)


def _rounded_matmul_bwd(res, dy):
  # Left to autodiff, the float32 products' cotangents would make the backward dots float32.
  x, w_IxO = res
  dy = dy.astype(x.dtype)
  dx = _rounded_matmul(dy, w_IxO.T)
  x_NxI, dy_NxO = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
  dw_IxO = jnp.matmul(x_NxI.T, dy_NxO, preferred_element_type=jnp.float32)
  return dx, dw_IxO.astype(w_IxO.dtype)


_rounded_matmul.defvjp(_rounded_matmul_fwd, _rounded_matmul_bwd)


@jax.custom_vjp
def low_rank(x_NxI: jax.Array, a_IxR: jax.Array, b_RxO: jax.Array) -> jax.Array:
  """(x @ a) @ b over the last axis of x, with a backward pass that transposes only
  rank-sized arrays (XLA:CPU otherwise transposes the [tokens, features] activations
  and gradients to form the adapter gradients, the costliest part of the update)."""
  return matmul(matmul(x_NxI, a_IxR), b_RxO)


def _low_rank_fwd(x, a, b):
  xa = matmul(x, a)
  return matmul(xa, b), (x, a, b, xa)


def _low_rank_bwd(res, dy):
  x, a, b, xa = res
  lead = x.shape[:-1]
  x_NxI, xa_NxR = x.reshape(-1, x.shape[-1]), xa.reshape(-1, xa.shape[-1])
  dy_NxO = dy.reshape(-1, dy.shape[-1])
  dxa_NxR = matmul(dy_NxO, b.T)
  # Contract over tokens with the rank-sized operand transposed (on CPU a barrier keeps XLA
  # from folding the transpose back into the dot and transposing the large one; other
  # backends pick their own dot layouts).
  barrier = jax.lax.optimization_barrier if jax.default_backend() == "cpu" else lambda v: v
  db_RxO = matmul(barrier(xa_NxR.T), dy_NxO)
  da_IxR = matmul(barrier(dxa_NxR.T), x_NxI).T
  dx = matmul(dxa_NxR, a.T).reshape(*lead, x.shape[-1])
  return dx.astype(x.dtype), da_IxR.astype(a.dtype), db_RxO.astype(b.dtype)


low_rank.defvjp(_low_rank_fwd, _low_rank_bwd)


_PRODUCTS: contextvars.ContextVar[dict] = contextvars.ContextVar("dense_products", default={})


@contextlib.contextmanager
def dense_products(table: dict[tuple[int, ...], Callable[[jax.Array], jax.Array]]):
  """While tracing inside, a `Linear` (key `(id(layer),)`) or a group run by `fused` (the
  ids of its layers in order) computes its base product `x @ kernel` (kernels concatenated)
  as `table[key](x)`, in the layers' dtype; e.g. the sampler's AMX products over weights
  packed once per call. Biases and unmerged adapters are added as usual."""
  token = _PRODUCTS.set(table)
  try:
    yield
  finally:
    _PRODUCTS.reset(token)


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
    product = _PRODUCTS.get().get((id(self),))
    y = product(x) if product else matmul(x, self.kernel[...].astype(self.dtype))
    if self.bias is not None:
      y = y + self.bias[...].astype(self.dtype)
    if self.has_lora and adapters != self.merged:
      sign = -1.0 if self.merged else 1.0
      a = self.lora_a[...].astype(self.dtype)
      b = self.lora_b[...].astype(self.dtype)
      y = y + (sign * self.lora_scale * low_rank(x, a, b)).astype(y.dtype)
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


def fused(layers: "list[Linear]", x, adapters: bool) -> list[jax.Array]:
  """`[layer(x, adapters) for layer in layers]` as one matmul over the concatenated kernels
  when each layer's kernel alone is its output (no adapters, or adapters merged and wanted);
  one larger matmul is faster than several small ones. Layers with unmerged adapters always
  run one by one, with or without them,
  so that the policy with zero adapters and the reference pass round identically: their
  log-prob difference (the progress signal) is then exactly zero, not rounding noise that
  the bucket z-scores would amplify."""
  if len(layers) == 1 or any(layer.has_lora and not (layer.merged and adapters) for layer in layers):
    return [layer(x, adapters) for layer in layers]
  dtype = layers[0].dtype
  product = _PRODUCTS.get().get(tuple(map(id, layers)))
  if product:
    y = product(x.astype(dtype))
  else:
    kernel = jnp.concatenate([layer.kernel[...].astype(dtype) for layer in layers], axis=-1)
    y = matmul(x.astype(dtype), kernel)
  if any(layer.bias is not None for layer in layers):
    y = y + jnp.concatenate([
        layer.bias[...].astype(dtype) if layer.bias is not None
        else jnp.zeros(layer.kernel.shape[-1:], dtype) for layer in layers])
  ends = list(itertools.accumulate(layer.kernel.shape[-1] for layer in layers))
  return jnp.split(y, ends[:-1], axis=-1)


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
