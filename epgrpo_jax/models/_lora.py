"""Low-rank adapters as a wrapper around a plain dense layer (`LoRA` over `_dense.Dense`), the
transforms over a model's state that fold them into the kernels and back, and everything else
that knows where adapters sit in a model or its saved state.

Unlike `nnx.LoRA`, the adapter output is scaled by alpha / rank, and the layer can run with
its adapters switched off (the reference policy) without a second copy of the base weights.
The adapters' parameter names (`A`, `B`) are this module's: no other module of the package
spells them (`tests/test_lora_wrapper.py`); it asks the functions here instead.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Callable, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from epgrpo_jax.models._dense import Dense
from epgrpo_jax.models._kernels import XLA, Kernels, concatenated, same, xla_matmul

# Filters over model state: adapters only, and the frozen base.
LORA = nnx.LoRAParam
BASE = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))
# The path segments below a wrapper in a model's state and its checkpoints: its factors' (as
# PEFT's lora_A / lora_B), and its base layer's (the attribute `LoRA.base`).
A, B, WRAPPED = "lora_a", "lora_b", "base"


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



class LoRA(nnx.Module):
  """A dense layer with a low-rank adapter: y = base(x) + scale * (x @ A) @ B, A [in, rank]
  kaiming-uniform (as PEFT initialises it), B [rank, out] zero, both float32 and trainable
  (`LORA`). `merged`: the adapter is folded into the base's kernel (`merge_adapters`); it then
  runs as the base alone with adapters on, and subtracts the adapter with them off. Where the
  kernels fold adapters (`Kernels.folds_adapters`), the product runs as one by the folded
  kernel instead (`Kernels.merged_lora`: x @ (kernel + scale * A @ B))."""

  def __init__(self, base: Dense, rank: int, scale: float, *, rngs: nnx.Rngs):
    d_in, d_out = base.kernel.shape
    self.base = base
    a_init = jax.nn.initializers.he_uniform()  # kaiming-uniform, as PEFT initialises A
    setattr(self, A, nnx.LoRAParam(a_init(rngs.params(), (d_in, rank), jnp.float32)))
    setattr(self, B, nnx.LoRAParam(jnp.zeros((rank, d_out), jnp.float32)))
    self.scale = scale
    self.merged = False

  @property
  def dtype(self):
    return self.base.dtype

  def factors(self) -> tuple[nnx.Variable, nnx.Variable]:
    """The adapter's (A, B) variables."""
    return getattr(self, A), getattr(self, B)

  def __call__(self, x, adapters: bool = True, kernels: Kernels = XLA,
               product: Callable | None = None):
    """The layer on x (`Dense.__call__`; `product` computes the base product), with the
    adapter added where `adapters`, subtracted where merged and not `adapters`."""
    base = self.base
    x = x.astype(base.dtype)
    if adapters == self.merged:  # the base's kernel alone is the layer
      return base(x, adapters, kernels, product)
    a, b = (v[...].astype(base.dtype) for v in self.factors())
    if adapters and not product and kernels.folds_adapters(
        x.dtype, math.prod(x.shape[:-1]), *base.kernel.shape):
      return base.biased(kernels.merged_lora(x, base.kernel[...].astype(base.dtype), a, b,
                                             self.scale))
    y = base(x, adapters, kernels, product)
    sign = -1.0 if self.merged else 1.0
    return y + (sign * self.scale * low_rank(x, a, b, kernels)).astype(y.dtype)

  def delta(self) -> jax.Array:
    """scale * A @ B, float32."""
    a, b = self.factors()
    return self.scale * (a[...] @ b[...])


Projection = Dense | LoRA


def dense(layer: Projection) -> Dense:
  """The plain dense layer of a projection: itself, or the one an adapter wraps."""
  return layer.base if isinstance(layer, LoRA) else layer


def adapted(layer: Projection) -> bool:
  """Whether the projection adds an adapter to its base product (a LoRA not merged)."""
  return isinstance(layer, LoRA) and not layer.merged


def folded_kernel(layer: Projection) -> jax.Array:
  """The projection's kernel with its adapter folded in (float32), merged or not."""
  w = dense(layer).kernel[...].astype(jnp.float32)
  return w + layer.delta() if adapted(layer) else w


def plain_kernels(group: "list[Projection]") -> list[jax.Array] | None:
  """The group's kernels where each layer with adapters on is its kernel's product alone (no
  adapter, or a merged one); None where a layer adds an unmerged adapter."""
  if any(adapted(layer) for layer in group):
    return None
  return [dense(layer).kernel[...] for layer in group]


def fused(layers: "list[Projection]", x, adapters: bool, kernels: Kernels = XLA,
          product: Callable | None = None) -> list[jax.Array]:
  """`[layer(x, adapters, kernels) for layer in layers]`, as one product where `fused_product`
  makes one (`product`: the group's prepared one, `Kernels.products`)."""
  y = fused_product(layers, x, adapters, kernels, product)
  if y is None:
    return [layer(x, adapters, kernels) for layer in layers]
  ends = list(itertools.accumulate(dense(layer).kernel.shape[-1] for layer in layers))
  return jnp.split(y, ends[:-1], axis=-1)


def fused_product(layers: "list[Projection]", x, adapters: bool, kernels: Kernels = XLA,
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
  bases = [dense(layer) for layer in layers]
  dtype = bases[0].dtype
  x = x.astype(dtype)
  rows, n = math.prod(x.shape[:-1]), sum(base.kernel.shape[-1] for base in bases)
  folds = (all(adapted(layer) for layer in layers) and len({layer.scale for layer in layers}) == 1
           and not product and kernels.folds_adapters(dtype, rows, bases[0].kernel.shape[0], n))
  if len(layers) == 1 or not folds and any(
      isinstance(layer, LoRA) and not (layer.merged and adapters) for layer in layers):
    return None
  weights = lambda: tuple(base.kernel[...].astype(dtype) for base in bases)  # unread with a product
  if product:
    y = product(x)
  elif folds and adapters:
    a, b = zip(*(tuple(v[...].astype(dtype) for v in layer.factors()) for layer in layers))
    y = kernels.merged_lora(x, weights(), a, b, layers[0].scale)
  else:
    y = kernels.matmul(x, concatenated(weights()))
  if any(base.bias is not None for base in bases):
    y = y + jnp.concatenate([
        base.bias[...].astype(dtype) if base.bias is not None
        else jnp.zeros(base.kernel.shape[-1:], dtype) for base in bases])
  return y


# ---------------------------------------------------------------------------
# Adapters in a model, found by their module type.


def _dotted(path) -> str:
  return ".".join(map(str, path))


def wrappers(model: nnx.Module) -> dict[str, LoRA]:
  """Every adapter wrapper of the model by its module path ('layers.0.attn.q'), in graph order."""
  return {_dotted(path): node for path, node in nnx.iter_graph(model) if isinstance(node, LoRA)}


def lora_layers(model: nnx.Module) -> Iterator[LoRA]:
  """Yields every adapter wrapper of the model."""
  yield from wrappers(model).values()


def projections(model: nnx.Module) -> dict[str, Projection]:
  """Every projection of the model by its module path: the wrappers, and the dense layers
  that no wrapper holds."""
  lora = wrappers(model)
  out = {}
  for path, node in nnx.iter_graph(model):
    name = _dotted(path)
    if isinstance(node, LoRA) or isinstance(node, Dense) and not (
        path and path[-1] == WRAPPED and _dotted(path[:-1]) in lora):
      out[name] = node
  return out


def adapters_are_zero(model: nnx.Module) -> jax.Array:
  """bool []: every adapter's B is zero (the model is its base)."""
  return jnp.all(jnp.stack([jnp.all(layer.factors()[1][...] == 0) for layer in lora_layers(model)]))


def plain_params(model: nnx.Module) -> dict[str, nnx.Variable]:
  """The model's base parameters (its variables, to read or set) by the path each would have
  in the model without adapters: a wrapper's base kernel at 'layers.0.attn.q.kernel'; the
  adapters left out. The paths of the family's weight table (`registry.Family.weights`)."""
  lora = set(wrappers(model))
  out = {}
  for path, var in nnx.to_flat_state(nnx.state(model)):
    names = [str(p) for p in path]
    owner = next((i for i in range(len(names)) if ".".join(names[:i]) in lora), None)
    if owner is None:
      out[".".join(names)] = var
    elif names[owner] == WRAPPED:
      out[".".join(names[:owner] + names[owner + 1:])] = var
  return out


def init_adapters(model: nnx.Module, seed: int, place: Callable[[np.ndarray, str], jax.Array]) -> None:
  """Fresh adapters in place: A kaiming-uniform (as `LoRA` and PEFT), B = 0, drawn on the host
  with numpy (the arrays are small, and per-shape jax RNG kernels would each need a compile)
  from `seed`, one A after another in the order of their parameter paths. `place(array,
  path)` puts a factor's array where its parameter lives."""
  rng = np.random.default_rng(seed)
  for path, layer in sorted(wrappers(model).items(), key=lambda item: f"{item[0]}.{A}"):
    a, b = layer.factors()
    bound = np.sqrt(6.0 / a.shape[0])
    a.set_value(place(rng.uniform(-bound, bound, a.shape).astype(np.float32), f"{path}.{A}"))
    b.set_value(place(np.zeros(b.shape, np.float32), f"{path}.{B}"))


def _transformed(model: nnx.Module, merged: bool) -> nnx.Module:
  out = nnx.clone(model)  # new variables over the same arrays: `model` stays as it was
  sign = 1.0 if merged else -1.0
  for layer in lora_layers(out):
    if layer.merged != merged:
      kernel = layer.base.kernel
      kernel[...] = (kernel[...].astype(jnp.float32) + sign * layer.delta()).astype(kernel[...].dtype)
      layer.merged = merged
  return out


def merge_adapters(model: nnx.Module) -> nnx.Module:
  """The model with every adapter folded into its base's kernel (faster inference), a new
  model: `model` is left as it was. Reversible (`unmerge_adapters`)."""
  return _transformed(model, True)


def unmerge_adapters(model: nnx.Module) -> nnx.Module:
  """Undoes `merge_adapters` (exact in float32 up to rounding), a new model."""
  return _transformed(model, False)


# ---------------------------------------------------------------------------
# Adapters in parameter paths: sharding tables and saved checkpoints.

AxesRow = tuple[str, tuple[str | None, ...]]  # NNX path regex -> logical axes (`registry.AxesRow`)


def param_rules(rows: "tuple[AxesRow, ...]") -> "tuple[AxesRow, ...]":
  """A family's sharding table of a plain model (`rows`: NNX path regex -> logical axes), with
  rows for the wrapped layers: the base's kernel and bias as the plain ones, and for each
  two-axis kernel its factors: A (in, "rank"), B ("rank", out)."""
  extra = []
  for pattern, axes in rows:
    for leaf in (r"\.kernel", r"\.bias"):
      if pattern.endswith(leaf):
        stem = pattern[:-len(leaf)]
        extra.append((stem + rf"\.{WRAPPED}" + leaf, axes))
        if leaf == r"\.kernel" and len(axes) == 2:
          extra += [(stem + rf"\.{A}", (axes[0], "rank")), (stem + rf"\.{B}", ("rank", axes[1]))]
  return tuple(rows) + tuple(extra)


def factor(path: str) -> str | None:
  """"A" or "B" for the parameter path of an adapter's factor, else None."""
  last = path.rsplit(".", 1)[-1]
  return {A: "A", B: "B"}.get(last)


def saved_adapters(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, int]:
  """The adapted projections among saved parameters (path -> shape): each one's module path
  -> its adapter's rank (A's last axis)."""
  return {path.rsplit(".", 1)[0]: shape[-1] for path, shape in shapes.items()
          if factor(path) == "A"}
