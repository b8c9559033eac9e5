"""The backend seam's interface: the operations a model calls that a backend may implement
its own way (`Kernels`), and their plain XLA implementations, the defaults.

A program chooses its `Kernels` once, from its backend, dtype, devices and config
(`epgrpo_jax.kernels.seam.choose`), and passes them to the model's `__call__` as
`kernels=`; the model holds no backend branch and reads no tracing-time context. Shape
suffixes as in `_decoder`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp


def concatenated(weights: Sequence[jax.Array]) -> jax.Array:
  """The arrays concatenated over their last axis (one array as it is)."""
  return weights[0] if len(weights) == 1 else jnp.concatenate(weights, axis=-1)


def xla_matmul(x: jax.Array, w_IxO: jax.Array) -> jax.Array:
  """x @ w over the last axis of x (XLA's dot, in x's dtype)."""
  return x @ w_IxO


def xla_rounded_product(x: jax.Array, w_IxO: jax.Array) -> jax.Array:
  """x @ w accumulated and returned in float32 by XLA's dot, then rounded to x's dtype once."""
  return jnp.matmul(x, w_IxO, preferred_element_type=jnp.float32).astype(x.dtype)


@functools.cache
def rounded_matmul(product: Callable = xla_rounded_product) -> Callable:
  """x @ w for 16-bit x and w whose every product, forward and backward, is accumulated in
  float32 and rounded once: `product(x, w)` (e.g. `xla_rounded_product`) forward, and the
  backward's products the same way (left to autodiff, the float32 products' cotangents would
  make the backward dots float32). The gradient of w is XLA's rounded product (a frozen
  base's is dropped)."""

  @jax.custom_vjp
  def multiply(x, w_IxO):
    return product(x, w_IxO)

  def fwd(x, w_IxO):
    return multiply(x, w_IxO), (x, w_IxO)

  def bwd(res, dy):
    x, w_IxO = res
    dy = dy.astype(x.dtype)
    dx = multiply(dy, w_IxO.T)
    x_NxI, dy_NxO = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    dw_IxO = jnp.matmul(x_NxI.T, dy_NxO, preferred_element_type=jnp.float32)
    return dx, dw_IxO.astype(w_IxO.dtype)

  multiply.defvjp(fwd, bwd)
  return multiply


def xla_swiglu(gate_up: jax.Array) -> jax.Array:
  """silu(gate) * up for the gate/up product as one array [..., 2F] (gate first)."""
  gate, up = jnp.split(gate_up, 2, axis=-1)
  return jax.nn.silu(gate) * up


def no_constraint(x: jax.Array, kind: str = "hidden") -> jax.Array:
  return x


def same(x):
  return x


def never_fold(dtype, rows: int, d_in: int, d_out: int) -> bool:
  return False


def ordered_remat(fn: Callable) -> Callable:
  """`fn` whose backward pass recomputes its activations from its inputs, the recomputation
  waiting for the incoming cotangent (one optimization barrier over both), so that it runs
  layer by layer during the backward pass. With `jax.checkpoint` alone, nothing orders the
  recomputation after the cotangent, and XLA:CPU scheduled every layer's recomputation up
  front: the compiled temporaries then grew with depth almost as without remat. Cotangents of
  inputs that are not differentiated (the frozen base) are dropped by XLA. XLA:CPU also drops
  the barrier before its last CSE pass, which would merge the recomputation with the forward's
  values; the trainer compiles such programs without CSE (`cpu_remat_options`)."""

  @jax.custom_vjp
  def wrapped(*args):
    return fn(*args)

  def fwd(*args):
    return fn(*args), args

  def bwd(args, cotangent):
    args, cotangent = jax.lax.optimization_barrier((args, cotangent))
    _, vjp = jax.vjp(fn, *args)
    return vjp(cotangent)

  wrapped.defvjp(fwd, bwd)
  return wrapped


def write_slots(cache: jax.Array, new: jax.Array, start: tuple) -> jax.Array:
  """`new` (cast to the cache's dtype) written into `cache` at `start`."""
  return jax.lax.dynamic_update_slice(cache, new.astype(cache.dtype), start)


def write_row_slots(cache: jax.Array, new: jax.Array, index_B: jax.Array, axis: int) -> jax.Array:
  """`new` [B, ...] (a slot of `cache` without its slot axis `axis`) written into row b of
  `cache` at slot `index_B[b]`, as a scatter; slots past the cache are dropped."""
  index = (jnp.arange(cache.shape[0]),) + (slice(None),) * (axis - 1) + (index_B,)
  return cache.at[index].set(new.astype(cache.dtype), mode="drop")  # row and slot lead


def _16bit(cache) -> bool:
  return cache.dtype in (jnp.bfloat16, jnp.float16)


def through_bits(write: Callable) -> Callable:
  """`write(cache, new, ...)` over a 16-bit float cache's bit pattern (uint16), other caches as
  they are: XLA:CPU widens a bf16 dynamic-update-slice or scatter to float32, which converts
  the whole cache there and back at every decode step."""

  @functools.wraps(write)
  def written(cache, new, *args):
    if not _16bit(cache):
      return write(cache, new, *args)
    bits = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.uint16)
    out = write(bits(cache), bits(new.astype(cache.dtype)), *args)
    return jax.lax.bitcast_convert_type(out, cache.dtype)
  return written


@dataclasses.dataclass(frozen=True)
class Kernels:
  """What a model calls where backends differ; every default is plain XLA.

  attention: the implementation of attention over the cache or without the causal kernel
  ("plain", "blockwise", "cudnn"; None: the model config's, its "auto" read as "plain").
  causal_attention: passes without a cache, q [B, T, K, G, Hd], k and v [B, T, K, Hd] in the
  projections' layout, valid and segments [B, T] -> [B, T, K, G, Hd] (None: `attention`).
  decode_attention: one-token steps over a float32 or bfloat16 cache, (q [B, K, G, Hd], keys
  [B, K, Hd, S], values [B, K, S, Hd], allowed [B, S], limit: slots < limit are read) ->
  [B, K, G, Hd] (None: `attention`).
  shared_decode_attention: the same over a cache whose prompt part is kept once per group
  (`models.split_cache`), its layer's prompt keys [P, K, Hd, Tp], values [P, K, Tp, Hd] and
  valid [P, Tp] as three more arguments (None: `models.attend_shared`).
  matmul: x @ w over x's last axis, in x's dtype (a projection's base product).
  folds_adapters(dtype, rows, d_in, d_out): whether a LoRA layer multiplies by its kernel with
  the adapters folded in, by `merged_lora(x, w, a, b, scale)` (w, a, b: one layer's arrays or
  tuples over a group sharing x), rather than adding the rank products.
  swiglu: silu(gate) * up of the gate/up product as one array [..., 2F].
  constrain(x, kind): sharding constraints on activations ("embedding": the table before the
  lookup; "hidden": the hidden states after the lookup and after each block; "head": the LM
  head before the chunked log-probs, gathered once outside their loops).
  remat: a block's function whose backward pass recomputes its activations.
  write_slots, write_row_slots: cache writes (`write_slots`, `write_row_slots`).
  rank_barrier: applied to a rank-sized operand transposed for an adapter gradient.
  products: the projection groups' base products `x -> x @ kernels` over weights prepared once
  (e.g. the sampler's packed ones), in the order of the model's `linear_groups()` (None: the
  group's own); empty: none.
  packing: how a program that prepares its weights once (the sampler's) packs them for its
  products: an object with `can_pack(weights)`, `pack(weights)`, `matmul(x, packed)` and
  `logits(x, packed)` (`kernels.cpu.Packing`); None: the weights concatenated as they are.

  batch_shards: how many devices split the batch axis under `constrain` (the mesh's data x
  fsdp; 1: unsplit): the LM head's chunked log-probs take their token chunks within each
  device's rows (`core.token_stats`, `row_blocks`).
  """

  attention: str | None = None
  causal_attention: Callable | None = None
  decode_attention: Callable | None = None
  shared_decode_attention: Callable | None = None
  matmul: Callable = xla_matmul
  folds_adapters: Callable = never_fold
  merged_lora: Callable | None = None
  swiglu: Callable = xla_swiglu
  constrain: Callable = no_constraint
  remat: Callable = jax.checkpoint
  write_slots: Callable = write_slots
  write_row_slots: Callable = write_row_slots
  rank_barrier: Callable = same
  products: tuple = ()
  packing: Any = None
  batch_shards: int = 1

  def product(self, group: int) -> Callable | None:
    """The prepared product of projection group `group` (see `products`), or None."""
    return self.products[group] if self.products else None

  def groups(self, start: int, count: int) -> "Kernels":
    """These kernels with `products` cut to groups [start, start + count) (a block's)."""
    if not self.products:
      return self
    return dataclasses.replace(self, products=self.products[start:start + count])


XLA = Kernels()
