"""Pieces of a decode step that the static sampler (`rollout.sampling`) and the continuous
engine (`rollout.continuous`) share: per-request randomness, the weights prepared once per
call, the token choice, the amortised stop test, and the output record.

Shape suffixes as in `rollout.sampling`; R requests, S slots.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax import lax

from epgrpo_jax.kernels import seam
from epgrpo_jax.models import (CausalLM, Kernels, as_dtype, concatenated, dense, merge_adapters, param_rules,
                               plain_kernels)
from epgrpo_jax.parallel import sharding
from epgrpo_jax.rollout.strategies import largest_threshold, sample_step


@struct.dataclass
class SampleOutput:
  """G completions for each of P prompts.

  tokens [P, G, N] int32 (pad id after a stop token); mask [P, G, N] bool
  (stop token included); logp, entropy [P, G, N] float32 (0 where masked);
  lengths [P, G] int32; prompt_ids, prompt_mask [P, Tp]: the left-padded
  prompts the completions continue (prompt_ids ++ tokens is the sequence).
  """

  tokens: jax.Array
  mask: jax.Array
  logp: jax.Array
  entropy: jax.Array
  lengths: jax.Array
  prompt_ids: jax.Array
  prompt_mask: jax.Array


def bucket(n: int, buckets: Sequence[int]) -> int:
  """The smallest bucket >= n; past the largest, the next multiple of the largest."""
  for b in buckets:
    if b >= n:
      return b
  return -(-n // buckets[-1]) * buckets[-1]


def round_up(n: int, k: int) -> int:
  return -(-n // k) * k


def segment_ends(n: int, segments: int, multiple: int = 8) -> list[int]:
  """Ends of the decode segments over N steps: equal, multiples of `multiple` (and of 8), at
  least 8 long."""
  segments = max(1, min(segments, n // 8))
  unit = np.lcm(8, multiple)
  size = round_up(round_up(n, segments) // segments, unit)
  return sorted({min(n, size * (i + 1)) for i in range(segments)})


def left_pad(prompts: Sequence[Sequence[int]], length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
  """Right-aligns each prompt in a [P, length] array; returns (ids int32, mask bool)."""
  ids = np.full((len(prompts), length), pad_id, np.int32)
  mask = np.zeros((len(prompts), length), bool)
  for i, p in enumerate(prompts):
    if len(p):
      ids[i, length - len(p):] = np.asarray(p, np.int32)
      mask[i, length - len(p):] = True
  return ids, mask


# ---------------------------------------------------------------------------
# Randomness: each request (prompt p, sample g) has its own key; its token t is drawn with
# fold_in(request key, t), so its tokens depend neither on its row or slot nor on its
# neighbours.


def request_keys(key: jax.Array, p: int, g: int) -> jax.Array:
  """[P * G] keys, row p * G + g: fold_in(fold_in(key, p), g)."""
  per_prompt = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(p))
  return jax.vmap(lambda k: jax.vmap(lambda j: jax.random.fold_in(k, j))(jnp.arange(g)))(
      per_prompt).reshape(p * g)


def token_keys(keys_B: jax.Array, t) -> jax.Array:
  """[B] keys of the tokens at positions `t` (a scalar or [B]) of each row's completion."""
  t_B = jnp.broadcast_to(jnp.asarray(t, jnp.int32), keys_B.shape)
  return jax.vmap(jax.random.fold_in)(keys_B, t_B)


# ---------------------------------------------------------------------------
# Weights prepared once per call, outside the decode loop.


def scoped(name: str, fn: Callable) -> Callable:
  """`fn` traced under the name scope `name` (a profile's parts, benchmarks/_profile.py)."""
  def run(*args, **kwargs):
    with jax.named_scope(name):
      return fn(*args, **kwargs)
  return run


def _group_weights(model: CausalLM) -> list[list[jax.Array] | None]:
  """Each projection group's kernels in the compute dtype; None for a group with unmerged
  adapters (it runs its layers one by one)."""
  dtype = as_dtype(model.cfg.dtype)
  groups = [plain_kernels(group) for group in model.linear_groups()]
  return [None if ws is None else [w.astype(dtype) for w in ws] for ws in groups]


@struct.dataclass
class DecodeWeights:
  """What a sampling call's programs multiply by, made once per call (`weights_of`) and passed
  to them ready: `state`, the model's parameters (adapters merged under `merge_lora`) less the
  kernels of the prepared groups; `groups`, each projection group's kernels prepared
  (q/k/v and gate/up concatenated in the compute dtype, or packed for the backend's products),
  None for a group the model multiplies itself; `head`, the head packed where the packing
  takes it (else None: the model's own). Static: the merged model's `graphdef`, the prepared
  kernels' paths and shapes (`absent`: stand-ins that nothing reads), each group's form
  (`packed`) and the path of its first kernel (`paths`, for its sharding rule). The programs
  that take them never see the kernels as they were: one copy of the weights."""

  state: Any
  groups: list
  head: Any
  graphdef: Any = struct.field(pytree_node=False)
  absent: tuple = struct.field(pytree_node=False)
  packed: tuple = struct.field(pytree_node=False)
  paths: tuple = struct.field(pytree_node=False)

  def model(self) -> CausalLM:
    """The merged model over `state`; a prepared kernel is a shape only (reading it fails)."""
    stand_ins = nnx.from_flat_state([(path, kind(shape)) for path, kind, shape in self.absent])
    return nnx.merge(self.graphdef, self.state, stand_ins)


def _merged(graphdef, state, cfg) -> CausalLM:
  """The model, adapters merged when `cfg.merge_lora`."""
  model: CausalLM = nnx.merge(graphdef, state)
  return merge_adapters(model) if cfg.merge_lora else model


def weights_of(graphdef, state, cfg, packed: bool, prepare: bool = True, mesh=None) -> DecodeWeights:
  """The `DecodeWeights` of the model (adapters merged when `cfg.merge_lora`): with `prepare`,
  each group's kernels concatenated in the compute dtype, or packed by the seam's
  `Kernels.packing` for `mesh` (with `packed`, where the packing takes them); without, none
  (no second copy: the model multiplies its own kernels). The head packed where the packing
  takes it."""
  model = _merged(graphdef, state, cfg)
  packing = seam.choose(model.cfg, mesh, packed=packed).packing
  layer_groups = model.linear_groups()
  groups = _group_weights(model) if prepare else [None] * len(layer_groups)
  can_pack = tuple(bool(ws is not None and packing and packing.can_pack(ws)) for ws in groups)
  ready = [None if ws is None else packing.pack(ws) if pack else concatenated(ws)
           for ws, pack in zip(groups, can_pack)]
  module_paths = {id(node): path for path, node in nnx.iter_graph(model)}
  firsts = [None if ws is None else module_paths[id(dense(group[0]))] + ("kernel",)
            for ws, group in zip(groups, layer_groups)]
  kernels = {id(dense(layer).kernel) for ws, group in zip(groups, layer_groups) if ws is not None
             for layer in group}
  merged_graphdef, prepared, rest = nnx.split(model, lambda _, v: id(v) in kernels, ...)
  absent = tuple((path, type(v), jax.ShapeDtypeStruct(v.shape, v.dtype))
                 for path, v in nnx.to_flat_state(prepared))
  head_DxV = model.head_DxV()
  head = packing.pack([head_DxV]) if packing and packing.can_pack([head_DxV]) else None
  return DecodeWeights(rest, ready, head, merged_graphdef, absent, can_pack, tuple(firsts))


def mesh_of(tree):
  """The mesh the first leaf of `tree` (arrays or shape structs) is laid out on, else None."""
  placed = getattr(jax.tree.leaves(tree)[0], "sharding", None)
  return placed.mesh if isinstance(placed, jax.sharding.NamedSharding) else None


def placements(weights: DecodeWeights, mesh) -> DecodeWeights:
  """Where `weights` (arrays or shape structs) lie on `mesh`: by the model family's parameter
  rules (`sharding.state_shardings`), a prepared group as its first kernel."""
  rules = param_rules(weights.model().cfg)
  groups = [None if x is None else sharding.param_sharding(sharding.path_str(path), x.shape, mesh, rules)
            for x, path in zip(weights.groups, weights.paths)]
  head = None if weights.head is None else sharding.replicated(mesh)
  return weights.replace(state=sharding.state_shardings(weights.state, mesh, rules), groups=groups, head=head)


def laid_out(weights: DecodeWeights, mesh) -> DecodeWeights:
  """`weights` constrained to their `placements` on `mesh` inside a program (as they are
  without one)."""
  return weights if mesh is None else lax.with_sharding_constraint(weights, placements(weights, mesh))


def products(model: CausalLM, weights: DecodeWeights, kernels: Kernels) -> tuple[tuple, Callable]:
  """(`Kernels.products`, hidden [B, D] -> float32 logits) over `weights` (packed by
  `kernels.packing` where they were), so the loop body multiplies by ready weights instead
  of preparing them at every step."""
  packing = kernels.packing
  table = []
  for ready, pack in zip(weights.groups, weights.packed):
    if ready is None:
      table.append(None)
      continue
    multiply = packing.matmul if pack else (lambda x, packed: kernels.matmul(x, packed))
    table.append(functools.partial(multiply, packed=ready))
  if weights.head is not None:
    return tuple(table), functools.partial(packing.logits, packed=weights.head)
  return tuple(table), functools.partial(jnp.dot, b=model.head_DxV(),
                                         preferred_element_type=jnp.float32)


@contextlib.contextmanager
def prepared_model(weights: DecodeWeights, packed: bool, *, mesh=None,
                   decode_rows: tuple[int, int] | None = None):
  """Yields (model, logits_of, kernels) over `weights` (`weights_of`): the merged model;
  hidden [B, D] -> float32 logits; and the program's `Kernels` (`seam.choose` for the mesh,
  with the C++ decode attention given `decode_rows`; with `packed`, the packing's products),
  whose `products` multiply the projections by the prepared groups."""
  model = weights.model()
  kernels = seam.choose(model.cfg, mesh, decode_rows=decode_rows, packed=packed)
  table, logits_of = products(model, weights, kernels)
  if any(ready is not None for ready in weights.groups):
    kernels = dataclasses.replace(kernels, products=table)
  yield model, scoped("lm_head", logits_of), kernels


def chooser(cfg, native: bool) -> Callable:
  """(keys_B, logits_BxV) -> (tokens_B, logp_B, entropy_B): `sample_step`, with the backend's
  threshold and, with top-k off, its whole draw where the seam gives them
  (`seam.sampler_draw`: the C++ ones with `native`)."""
  threshold, draw = seam.sampler_draw(native)
  if draw is not None and not cfg.is_greedy and cfg.top_k == 0:
    return scoped("sampling", functools.partial(draw, temperature=cfg.temperature, top_p=cfg.top_p))
  return scoped("sampling", functools.partial(sample_step, cfg=cfg,
                                              threshold=threshold or largest_threshold))


def stops(tokens_B: jax.Array, eos_E: jax.Array) -> jax.Array:
  """Whether each token is one of the stop ids."""
  return jnp.any(tokens_B[:, None] == eos_E[None, :], axis=-1)


def block(step: Callable, k: int, carry):
  """`k` steps of `step` on `carry`, a fixed-trip loop (`lax.fori_loop`)."""
  return lax.fori_loop(0, k, lambda _, x: step(x), carry)


def in_blocks(cond: Callable, step: Callable, k: int, carry):
  """`while cond(carry): carry = step(carry)`, with the test made once per `k` steps: a while
  loop over fixed-trip blocks of `k` steps (`block`), so a block never waits on a
  data-dependent predicate. `step` must leave a carry that is past its end unchanged in
  what matters (masked), since up to k - 1 steps run after `cond` turns false."""
  return lax.while_loop(cond, functools.partial(block, step, k), carry)
