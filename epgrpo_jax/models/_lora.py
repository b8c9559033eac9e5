"""A dense layer with optional low-rank adapters, and LoRA parameter filters.

Unlike `nnx.LoRA`, the adapter output is scaled by alpha / rank, and the layer
can run with its adapters switched off (the reference policy) without a
second copy of the base weights.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from epgrpo_jax.kernels import cpu as cpu_kernels
from epgrpo_jax.parallel.platform import backend

# Filters over model state: adapters only, and the frozen base.
LORA = nnx.LoRAParam
BASE = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))


def matmul(x: jax.Array, w_IxO: jax.Array) -> jax.Array:
  """x @ w over the last axis of x, in x's dtype. On CPU in bf16 or fp16, each product
  (forward and backward) is accumulated and returned in float32, then rounded once: XLA:CPU
  computes bf16 x bf16 -> bf16 dots through float32, several times slower than bf16 x bf16
  -> float32 ones, which run on the CPU's bf16 units. Accelerators accumulate in float32
  inside their bf16 dots already. On CPU in float32, products of many rows run on AVX-512
  panels where they can (`_on_panels`)."""
  if backend() != "cpu":
    return x @ w_IxO
  if x.dtype == w_IxO.dtype == jnp.float32:
    return _panel_matmul(x, w_IxO) if _on_panels(x, w_IxO) else x @ w_IxO
  if x.dtype not in (jnp.bfloat16, jnp.float16):
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


PACKED_MIN_ROWS = 256  # below, packing w (once per product) is not small beside the product


def one_device() -> bool:
  """Whether the program being traced runs on a single device (`one_device_program`; outside
  one: whether the process has one device). Only then may it call the C++ kernels, which
  XLA cannot shard over a mesh."""
  flag = _ONE_DEVICE.get()
  return jax.device_count() == 1 if flag is None else flag


def runs_cpu_kernels() -> bool:
  """Whether the program being traced may call the C++ CPU kernels: on the CPU backend, on a
  single device (`one_device`), with the kernels built here (`cpu.available()`)."""
  return backend() == "cpu" and one_device() and cpu_kernels.available()


def _bf16_unit(x, w_IxO) -> str | None:
  """Where `_rounded_matmul` multiplies: `cpu.bf16_unit()` (AMX tiles or AVX512-BF16 pairs)
  for bf16 in a single-device program on a CPU with one of them, a `w` they take, and at
  least `PACKED_MIN_ROWS` rows of x (a decode step's product, or an adapter gradient's over
  rank-many rows, stays XLA's); None: XLA's dot. At the bf16 update's shapes (10,176 rows)
  the pairs, packing included, ran at 406-434 GFLOP/s where XLA's dots ran at 144-377."""
  if (one_device() and x.dtype == w_IxO.dtype == jnp.bfloat16 and cpu_kernels.can_pack(w_IxO)
      and math.prod(x.shape[:-1]) >= PACKED_MIN_ROWS):
    return cpu_kernels.bf16_unit()
  return None


@jax.custom_vjp
def _rounded_matmul(x, w_IxO):
  unit = _bf16_unit(x, w_IxO)
  if unit:
    return cpu_kernels.packed_matmul(x, cpu_kernels.pack_bf16(w_IxO), unit=unit)
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


def _on_panels(x, w_IxO) -> bool:
  """Whether `matmul` multiplies float32 `x` by `w` on AVX-512 panels (`cpu.panel_matmul`, w
  packed per product, its transpose for the backward): in a single-device program on a CPU
  with AVX-512, at least `PACKED_MIN_ROWS` rows of x, and a `w` that `pack_panels` takes both
  ways. At the update's shapes (10,176 rows) the panels ran at 209-220 GFLOP/s where XLA's
  dots ran at 189-210."""
  return (math.prod(x.shape[:-1]) >= PACKED_MIN_ROWS and cpu_kernels.can_pack_panels([w_IxO])
          and cpu_kernels.can_pack_panels([w_IxO.T]) and one_device()
          and cpu_kernels.panels_available())


@jax.custom_vjp
def _panel_matmul(x, w_IxO):
  return cpu_kernels.panel_matmul(x, cpu_kernels.pack_panels([w_IxO]))


def _panel_matmul_fwd(x, w_IxO):
  return _panel_matmul(x, w_IxO), (x, w_IxO)


def _panel_matmul_bwd(res, dy):
  x, w_IxO = res
  dx = cpu_kernels.panel_matmul(dy, cpu_kernels.pack_panels([w_IxO.T]))
  dw_IxO = x.reshape(-1, x.shape[-1]).T @ dy.reshape(-1, dy.shape[-1])  # dropped if frozen
  return dx, dw_IxO


_panel_matmul.defvjp(_panel_matmul_fwd, _panel_matmul_bwd)


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
  db_RxO = _rank_transposed_matmul(xa_NxR, dy_NxO)
  da_IxR = _rank_transposed_matmul(dxa_NxR, x_NxI).T
  dx = matmul(dxa_NxR, a.T).reshape(*lead, x.shape[-1])
  return dx.astype(x.dtype), da_IxR.astype(a.dtype), db_RxO.astype(b.dtype)


low_rank.defvjp(_low_rank_fwd, _low_rank_bwd)


def _rank_transposed_matmul(r_NxR: jax.Array, v_NxF: jax.Array) -> jax.Array:
  """r^T @ v [R, F], contracting over tokens with the rank-sized operand transposed (on CPU a
  barrier keeps XLA from folding the transpose back into the dot and transposing the
  [tokens, features] one instead; other backends pick their own dot layouts)."""
  barrier = jax.lax.optimization_barrier if backend() == "cpu" else lambda v: v
  return matmul(barrier(r_NxR.T), v_NxF)


def folds_adapters(dtype, rows: int, d_in: int, d_out: int) -> bool:
  """Whether `Linear` multiplies by the kernel with its adapters folded in (`merged_lora`)
  rather than adding the rank products: in float32 on CPU only (a 16-bit W + delta, or the
  TF32 / bf16 passes of accelerators' default float32 dots, would round the small delta away),
  and only when the merge (d_in * d_out * rank multiply-adds) costs less than the rank
  products (rows * rank * (d_in + d_out))."""
  return (jnp.dtype(dtype) == jnp.float32 and backend() == "cpu"
          and rows * (d_in + d_out) > d_in * d_out)


def _merged_kernel(w_IxO, a_IxR, b_RxO, scale: float):
  """w + scale * a @ b, equal to w bit for bit where the delta is zero (b = 0 at the first
  step), signed zeros included: the policy's forward is then the reference's exactly."""
  delta_IxO = scale * (a_IxR @ b_RxO)
  return jnp.where(delta_IxO == 0, w_IxO, w_IxO + delta_IxO)


def _as_group(w, a, b):
  """One layer's (w, a, b) as a group of one; a group's tuples as they are."""
  return (w, a, b) if isinstance(w, tuple) else ((w,), (a,), (b,))


def _merged_kernels(w, a, b, scale: float):
  """The group's merged kernels concatenated over columns [I, sum O_i]."""
  return cpu_kernels.concatenated([_merged_kernel(*layer, scale) for layer in zip(*_as_group(w, a, b))])


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def merged_lora(x_NxI: jax.Array, w_IxO, a_IxR, b_RxO, scale: float) -> jax.Array:
  """x @ (w + scale * a @ b) over the last axis of x: one product instead of x @ w plus the
  two rank products. `w`, `a`, `b` are one layer's arrays, or tuples over a group of layers
  that share x (q/k/v, gate/up), whose outputs come concatenated from one product. The
  backward recomputes the merged kernels (no second copy of the weights is kept) and forms
  the adapter gradients as `low_rank`'s does."""
  return matmul(x_NxI, _merged_kernels(w_IxO, a_IxR, b_RxO, scale))


def _merged_lora_fwd(x, w, a, b, scale):
  return merged_lora(x, w, a, b, scale), (x, w, a, b)


def _merged_lora_bwd(scale, res, dy):
  x, w, a, b = res
  ws, as_, bs = _as_group(w, a, b)
  x_NxI, dy_NxO = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
  dx = matmul(dy, _merged_kernels(w, a, b, scale).T)
  rank_ends = list(itertools.accumulate(a_i.shape[1] for a_i in as_))
  xa_NxR = jnp.split(matmul(x_NxI, cpu_kernels.concatenated(as_)), rank_ends[:-1], axis=-1)
  ends = list(itertools.accumulate(w_i.shape[1] for w_i in ws))
  dy_NxO = jnp.split(dy_NxO, ends[:-1], axis=-1) if len(ws) > 1 else [dy_NxO]
  dw, da, db = [], [], []
  for w_i, a_i, b_i, xa_i, dy_i in zip(ws, as_, bs, xa_NxR, dy_NxO):
    g_NxR = matmul(dy_i, b_i.T)
    da.append((scale * _rank_transposed_matmul(g_NxR, x_NxI).T).astype(a_i.dtype))
    db.append((scale * _rank_transposed_matmul(xa_i, dy_i)).astype(b_i.dtype))
    dw.append(matmul(x_NxI.T, dy_i).astype(w_i.dtype))  # the base is frozen: dropped by XLA
  if not isinstance(w, tuple):
    dw, da, db = dw[0], da[0], db[0]
  else:
    dw, da, db = tuple(dw), tuple(da), tuple(db)
  return dx.astype(x.dtype), dw, da, db


merged_lora.defvjp(_merged_lora_fwd, _merged_lora_bwd)


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
  """y = x @ kernel (+ bias) (+ scale * (x @ lora_a) @ lora_b). In float32 on CPU with many
  rows (`folds_adapters`), the adapters are folded into the kernel for the product instead
  (`merged_lora`: x @ (kernel + scale * lora_a @ lora_b), one dot)."""

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
    lora = self.has_lora and adapters != self.merged  # adapters to add (subtract if merged)
    if lora:
      a = self.lora_a[...].astype(self.dtype)
      b = self.lora_b[...].astype(self.dtype)
    fold = (lora and adapters and not product
            and folds_adapters(x.dtype, math.prod(x.shape[:-1]), *self.kernel.shape))
    if fold:
      y = merged_lora(x, self.kernel[...].astype(self.dtype), a, b, self.lora_scale)
    else:
      y = product(x) if product else matmul(x, self.kernel[...].astype(self.dtype))
    if self.bias is not None:
      y = y + self.bias[...].astype(self.dtype)
    if lora and not fold:
      sign = -1.0 if self.merged else 1.0
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
  """`[layer(x, adapters) for layer in layers]`, as one product where `fused_product` makes
  one."""
  y = fused_product(layers, x, adapters)
  if y is None:
    return [layer(x, adapters) for layer in layers]
  ends = list(itertools.accumulate(layer.kernel.shape[-1] for layer in layers))
  return jnp.split(y, ends[:-1], axis=-1)


def fused_product(layers: "list[Linear]", x, adapters: bool) -> jax.Array | None:
  """The layers' outputs concatenated, as one matmul over the concatenated kernels, when each
  layer's kernel alone is its output (no adapters, or adapters merged and wanted), or when
  every layer's unmerged adapters fold into its kernel (`folds_adapters` for the group; with
  adapters off, the same product by the base kernels); one larger matmul is faster than
  several small ones. None where the layers must run one by one (other layers with unmerged
  adapters, with or without them). Either way the policy with zero adapters and the
  reference pass round identically: their log-prob difference (the progress signal) is then
  exactly zero, not rounding noise that the bucket z-scores would amplify."""
  dtype = layers[0].dtype
  product = _PRODUCTS.get().get(tuple(map(id, layers)))
  x = x.astype(dtype)
  rows, n = math.prod(x.shape[:-1]), sum(layer.kernel.shape[-1] for layer in layers)
  unmerged = [layer.has_lora and not layer.merged for layer in layers]
  folds = (all(unmerged) and len({layer.lora_scale for layer in layers}) == 1 and not product
           and folds_adapters(dtype, rows, layers[0].kernel.shape[0], n))
  if len(layers) == 1 or not folds and any(
      layer.has_lora and not (layer.merged and adapters) for layer in layers):
    return None
  kernels = tuple(layer.kernel[...].astype(dtype) for layer in layers)
  if product:
    y = product(x)
  elif folds and adapters:
    y = merged_lora(x, kernels, tuple(layer.lora_a[...].astype(dtype) for layer in layers),
                    tuple(layer.lora_b[...].astype(dtype) for layer in layers),
                    layers[0].lora_scale)
  else:
    y = matmul(x, cpu_kernels.concatenated(kernels))
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
