"""Device mesh and partition rules: every array the project holds, declared here.

Parameters are named by their NNX path (e.g. `layers.3.attn.q.kernel`); a table
of path patterns (the model family's, passed in) gives each one logical axes, and
`LOGICAL_RULES` maps logical axes onto the mesh axes `data`, `fsdp`, `tensor`. A dimension that the mesh
axis does not divide is replicated instead.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from epgrpo_jax.io.errors import UserError

MESH_AXES = ("data", "fsdp", "tensor")

# Logical axis -> mesh axes.
LOGICAL_RULES: dict[str, Any] = {
    "batch": ("data", "fsdp"),
    "vocab": "tensor",
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "rank": None,
    "norm": None,
    "slots": None,
    "head_dim": None,
    "seq": None,
}

# A table of parameter rules: NNX path (regex, full match) -> logical axes of the array. The
# model family supplies it (`models.registry.param_rules`); the first matching row wins.
Rules = Sequence[tuple[str, tuple[str | None, ...]]]

# Cache leaves (models.init_cache): keys [B, K, Hd, S], values [B, K, S, Hd].
CACHE_AXES = {"k": ("batch", "kv_heads", "head_dim", "slots"),
              "v": ("batch", "kv_heads", "slots", "head_dim"), "valid": ("batch", "slots")}


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Mesh axis sizes; one of them may be -1 (all remaining devices)."""

  data: int = -1
  fsdp: int = 1
  tensor: int = 1

  def __post_init__(self):
    sizes = (self.data, self.fsdp, self.tensor)
    for name, size in zip(MESH_AXES, sizes):
      if size == 0 or size < -1:
        raise UserError(f"mesh.{name}: must be a positive size or -1, got {size}")
    if sizes.count(-1) > 1:
      raise UserError("mesh: at most one axis may be -1")

  def shape(self, num_devices: int) -> tuple[int, int, int]:
    sizes = [self.data, self.fsdp, self.tensor]
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
      if num_devices % known:
        raise UserError(f"mesh: fixed axes ({known} devices) do not divide the "
                         f"{num_devices} devices")
      sizes[sizes.index(-1)] = num_devices // known
    if math.prod(sizes) != num_devices:
      raise UserError(f"mesh: data*fsdp*tensor = {math.prod(sizes)} but there are "
                       f"{num_devices} devices")
    return tuple(sizes)


def make_mesh(cfg: MeshConfig | None = None, devices=None) -> Mesh:
  """A (data, fsdp, tensor) mesh over all devices of all processes."""
  cfg = cfg or MeshConfig()
  devices = jax.devices() if devices is None else devices
  shape = cfg.shape(len(devices))
  return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def spec_for(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh) -> P:
  """PartitionSpec for logical `axes`, replicating dimensions the mesh does not divide."""
  out = []
  for axis, dim in zip(axes, shape):
    mesh_axes = LOGICAL_RULES.get(axis) if axis else None
    if mesh_axes is None:
      out.append(None)
      continue
    names = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)
    names = tuple(n for n in names if mesh.shape[n] > 1)
    size = math.prod(mesh.shape[n] for n in names)
    if not names or dim % size:
      out.append(None)
    else:
      out.append(names[0] if len(names) == 1 else names)
  return P(*out)


def param_axes(path: str, rules: Rules) -> tuple[str | None, ...] | None:
  """The logical axes of the parameter at `path` by the first matching row of `rules`."""
  for pattern, axes in rules:
    if re.fullmatch(pattern, path):
      return axes
  return None


def param_sharding(path: str, shape: tuple[int, ...], mesh: Mesh, rules: Rules) -> NamedSharding:
  """The sharding of the parameter at NNX path `path` (replicated when unknown)."""
  axes = param_axes(path, rules)
  if axes is None or len(axes) != len(shape):
    return NamedSharding(mesh, P())
  return NamedSharding(mesh, spec_for(axes, shape, mesh))


def path_str(path) -> str:
  """'layers.0.attn.q.kernel' from an NNX/pytree key path."""
  parts = []
  for k in path:
    k = getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))
    parts.append(str(k))
  return ".".join(p for p in parts if p != "value")


def state_shardings(state, mesh: Mesh, rules: Rules):
  """A pytree of NamedShardings matching an NNX state (parameters or optimizer state), by the
  parameter `rules`.

  Optimizer moments mirror their parameter's path as a suffix, so they are
  matched by the longest parameter-pattern suffix of their path.
  """
  def one(path, leaf):
    shape = tuple(getattr(leaf, "shape", ()))
    name = path_str(path)
    parts = name.split(".")
    for i in range(len(parts)):
      axes = param_axes(".".join(parts[i:]), rules)
      if axes is not None and len(axes) == len(shape):
        return NamedSharding(mesh, spec_for(axes, shape, mesh))
    return NamedSharding(mesh, P())
  return jax.tree_util.tree_map_with_path(one, state)


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
  """Leading axis over data x fsdp, the rest replicated."""
  return NamedSharding(mesh, P(("data", "fsdp"), *([None] * (ndim - 1))))


def leading_sharding(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
  """Leading axis over data x fsdp when they divide it (else replicated); any rank."""
  return NamedSharding(mesh, spec_for(("batch",), tuple(shape)[:1], mesh))


def gathered_once(x: jax.Array, sharding: NamedSharding) -> jax.Array:
  """`x` laid out by `sharding` (a gather), fenced by an optimization barrier so that the
  compiler keeps the gather where it stands: without the barrier the TPU compiler sank a
  gathered LM head into the chunk loops that read it, gathering the whole head every chunk.
  The constraint after the barrier pins the layout its readers see. Differentiable: the
  cotangent goes back through the barrier and the constraints (to the argument's layout)."""
  x = jax.lax.with_sharding_constraint(x, sharding)
  x = jax.lax.optimization_barrier(x)
  return jax.lax.with_sharding_constraint(x, sharding)


def activation_constraints(mesh: Mesh):
  """`(x, kind) -> x` for `models.Kernels.constrain`: hidden states [B, ...] split over
  data x fsdp; the embedding table gathered over fsdp before the lookup (as FSDP gathers
  every weight before use; the vocabulary stays split over tensor); the LM head [D, V]
  gathered over fsdp once before the chunked log-probs loop over it (`gathered_once`; the
  identity where fsdp does not split it)."""
  def constrain(x, kind: str = "hidden"):
    if kind == "embedding":
      return jax.lax.with_sharding_constraint(
          x, NamedSharding(mesh, spec_for(("vocab", None), x.shape, mesh)))
    if kind == "head":
      if mesh.shape["fsdp"] == 1:
        return x
      return gathered_once(x, NamedSharding(mesh, spec_for((None, "vocab"), x.shape, mesh)))
    if x.ndim == 0:
      return x
    return jax.lax.with_sharding_constraint(x, leading_sharding(mesh, x.shape))
  return constrain


def check_batch(mesh: Mesh, rows: int, what: str) -> None:
  """Raises a config error unless data x fsdp divides the `rows` of a per-token batch."""
  shards = mesh.shape["data"] * mesh.shape["fsdp"]
  if rows % shards:
    raise UserError(f"{what} = {rows} sequences is not divisible by mesh.data x mesh.fsdp = "
                     f"{mesh.shape['data']} x {mesh.shape['fsdp']} = {shards} batch shards")


def cache_shardings(cache, mesh: Mesh):
  """Shardings for a KV cache pytree from `models.init_cache` (and its `"prompt"` part, kept once
per group by `models.split_cache`: its prompts split as the rows are)."""
  def one(name, x):
    return NamedSharding(mesh, spec_for(CACHE_AXES[name], x.shape, mesh))
  out = {
      "k": [one("k", x) for x in cache["k"]],
      "v": [one("v", x) for x in cache["v"]],
      "valid": one("valid", cache["valid"]),
      "index": NamedSharding(mesh, P()),
  }
  if "prompt" in cache:
    prompt = cache["prompt"]
    out["prompt"] = {"k": [one("k", x) for x in prompt["k"]], "v": [one("v", x) for x in prompt["v"]],
                     "valid": one("valid", prompt["valid"])}
  return out


def placement(x):
  """An argument's sharding as a program's signature holds it: a named sharding's spec without
  trailing None (XLA returns P('data') for a P('data', None) input)."""
  placed = getattr(x, "sharding", None)
  if not isinstance(placed, NamedSharding):
    return placed
  spec = tuple(placed.spec)
  while spec and spec[-1] is None:
    spec = spec[:-1]
  return placed.mesh, spec, placed.memory_kind


def fitted(tree, formats):
  """`tree`'s arrays copied into `formats` (a compiled program's input formats for them) where
  their layout differs, the others as they are. A program compiled for a picked layout
  (`Layout.AUTO`) refuses a committed argument in any other, and a program's outputs leave in
  the default layout unless it says otherwise."""
  def fit(x, want):
    have = getattr(x, "format", None)
    if want is None or want.layout is None or have is None or have.layout == want.layout:
      return x
    return jax.device_put(x, want)
  return jax.tree.map(fit, tree, formats)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def global_batch(local: np.ndarray, mesh: Mesh) -> jax.Array:
  """Assembles a global array from each process's shard of the batch (leading axis)."""
  return jax.make_array_from_process_local_data(batch_sharding(mesh, np.ndim(local)), local)
