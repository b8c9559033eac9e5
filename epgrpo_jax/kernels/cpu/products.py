"""The CPU backend's products: its matmul (XLA's dots rounded once in 16-bit, the C++ panel and
packed products where they pay), and LoRA's adapters folded into the kernel (`merged_lora`).

Shape suffixes: N rows (tokens), I inputs, O outputs, R rank.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Callable

import jax
import jax.numpy as jnp

from epgrpo_jax.kernels import cpu
from epgrpo_jax.models import concatenated, rank_transposed_matmul, rounded_matmul, xla_rounded_product

PACKED_MIN_ROWS = 256  # below, packing w (once per product) is not small beside the product


def bf16_unit(x, w_IxO) -> str | None:
  """Where a single-device program's rounded bf16 product multiplies: `cpu.bf16_unit()` (AMX
  tiles or AVX512-BF16 pairs) for bf16 on a CPU with one of them, a `w` they take, and at
  least `PACKED_MIN_ROWS` rows of x (a decode step's product, or an adapter gradient's over
  rank-many rows, stays XLA's); None: XLA's dot. At the bf16 update's shapes (10,176 rows)
  the pairs, packing included, ran at 406-434 GFLOP/s where XLA's dots ran at 144-377."""
  if (x.dtype == w_IxO.dtype == jnp.bfloat16 and cpu.can_pack(w_IxO)
      and math.prod(x.shape[:-1]) >= PACKED_MIN_ROWS):
    return cpu.bf16_unit()
  return None


def packed_rounded_product(x, w_IxO):
  """x @ w rounded once (`xla_rounded_product`), on the CPU's bf16 units where `bf16_unit`
  says so (w packed per product)."""
  unit = bf16_unit(x, w_IxO)
  if unit:
    return cpu.packed_matmul(x, cpu.pack_bf16(w_IxO), unit=unit)
  return xla_rounded_product(x, w_IxO)


def on_panels(x, w_IxO) -> bool:
  """Whether a single-device program multiplies float32 `x` by `w` on AVX-512 panels
  (`cpu.panel_matmul`, w packed per product, its transpose for the backward): on a CPU with
  AVX-512, at least `PACKED_MIN_ROWS` rows of x, and a `w` that `pack_panels` takes both ways.
  At the update's shapes (10,176 rows) the panels ran at 209-220 GFLOP/s where XLA's dots ran
  at 189-210."""
  return (math.prod(x.shape[:-1]) >= PACKED_MIN_ROWS and cpu.can_pack_panels([w_IxO])
          and cpu.can_pack_panels([w_IxO.T]) and cpu.panels_available())


@jax.custom_vjp
def panel_matmul(x, w_IxO):
  """x @ w in float32 on AVX-512 panels (w packed per product), forward and backward."""
  return cpu.panel_matmul(x, cpu.pack_panels([w_IxO]))


def _panel_matmul_fwd(x, w_IxO):
  return panel_matmul(x, w_IxO), (x, w_IxO)


def _panel_matmul_bwd(res, dy):
  x, w_IxO = res
  dx = cpu.panel_matmul(dy, cpu.pack_panels([w_IxO.T]))
  dw_IxO = x.reshape(-1, x.shape[-1]).T @ dy.reshape(-1, dy.shape[-1])  # dropped if frozen
  return dx, dw_IxO


panel_matmul.defvjp(_panel_matmul_fwd, _panel_matmul_bwd)


def matmul(x: jax.Array, w_IxO: jax.Array, *, one_device: bool) -> jax.Array:
  """x @ w over the last axis of x, in x's dtype, as the CPU computes it best. In bf16 or
  fp16, each product (forward and backward) is accumulated and returned in float32, then
  rounded once (`models.rounded_matmul`): XLA:CPU computes bf16 x bf16 -> bf16 dots through
  float32, several times slower than bf16 x bf16 -> float32 ones, which run on the CPU's bf16
  units; in a `one_device` program on the C++ packed products where they pay
  (`bf16_unit`). In float32, products of many rows in a `one_device` program run on AVX-512
  panels where they can (`on_panels`). The C++ products cannot be sharded over a mesh."""
  if x.dtype == w_IxO.dtype == jnp.float32:
    return panel_matmul(x, w_IxO) if one_device and on_panels(x, w_IxO) else x @ w_IxO
  if x.dtype not in (jnp.bfloat16, jnp.float16):
    return x @ w_IxO
  return rounded_matmul(packed_rounded_product if one_device else xla_rounded_product)(x, w_IxO)


def folds_adapters(dtype, rows: int, d_in: int, d_out: int) -> bool:
  """Whether a LoRA layer multiplies by the kernel with its adapters folded in (`merged_lora`)
  rather than adding the rank products: in float32 only (a 16-bit W + delta, or the TF32 /
  bf16 passes of accelerators' default float32 dots, would round the small delta away), and
  only when the merge (d_in * d_out * rank multiply-adds) costs less than the rank products
  (rows * rank * (d_in + d_out))."""
  return jnp.dtype(dtype) == jnp.float32 and rows * (d_in + d_out) > d_in * d_out


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
  return concatenated([_merged_kernel(*layer, scale) for layer in zip(*_as_group(w, a, b))])


@functools.cache
def merged_lora_product(matmul: Callable, barrier: Callable) -> Callable:
  """`merged_lora` with products by `matmul` and `barrier` before the adapter gradients'
  rank-sized transposes (`models.rank_transposed_matmul`)."""

  @functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
  def merged_lora(x_NxI: jax.Array, w_IxO, a_IxR, b_RxO, scale: float) -> jax.Array:
    return matmul(x_NxI, _merged_kernels(w_IxO, a_IxR, b_RxO, scale))

  def fwd(x, w, a, b, scale):
    return merged_lora(x, w, a, b, scale), (x, w, a, b)

  def bwd(scale, res, dy):
    x, w, a, b = res
    ws, as_, bs = _as_group(w, a, b)
    x_NxI, dy_NxO = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    dx = matmul(dy, _merged_kernels(w, a, b, scale).T)
    rank_ends = list(itertools.accumulate(a_i.shape[1] for a_i in as_))
    xa_NxR = jnp.split(matmul(x_NxI, concatenated(as_)), rank_ends[:-1], axis=-1)
    ends = list(itertools.accumulate(w_i.shape[1] for w_i in ws))
    dy_NxO = jnp.split(dy_NxO, ends[:-1], axis=-1) if len(ws) > 1 else [dy_NxO]
    dw, da, db = [], [], []
    for w_i, a_i, b_i, xa_i, dy_i in zip(ws, as_, bs, xa_NxR, dy_NxO):
      g_NxR = matmul(dy_i, b_i.T)
      da.append((scale * rank_transposed_matmul(g_NxR, x_NxI, matmul, barrier).T).astype(a_i.dtype))
      db.append((scale * rank_transposed_matmul(xa_i, dy_i, matmul, barrier)).astype(b_i.dtype))
      dw.append(matmul(x_NxI.T, dy_i).astype(w_i.dtype))  # the base is frozen: dropped by XLA
    if not isinstance(w, tuple):
      dw, da, db = dw[0], da[0], db[0]
    else:
      dw, da, db = tuple(dw), tuple(da), tuple(db)
    return dx.astype(x.dtype), dw, da, db

  merged_lora.defvjp(fwd, bwd)
  return merged_lora
