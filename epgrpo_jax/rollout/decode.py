"""Pieces of a decode step that the static sampler (`rollout.sampling`) and the continuous
engine (`rollout.continuous`) share: per-request randomness, the weights prepared once per
call, the token choice, the amortised stop test, and the output record.

Shape suffixes as in `rollout.sampling`; R requests, S slots.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax import lax

from epgrpo_jax.kernels import seam
from epgrpo_jax.models import CausalLM, Kernels, as_dtype, concatenated, merge_adapters, plain_kernels
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


def prepared_weights(model: CausalLM, packing) -> dict:
  """The weights the decode steps multiply by, made once: each projection group's kernels
  concatenated (q/k/v, gate/up) in the compute dtype, or packed by `packing`
  (`Kernels.packing`) where it takes them; the head packed where it takes it (else None)."""
  def prepare(weights):
    if weights is None:
      return None
    return packing.pack(weights) if packing and packing.can_pack(weights) else \
        concatenated(weights)
  head_DxV = model.head_DxV()
  return {"groups": [prepare(w) for w in _group_weights(model)],
          "head": packing.pack([head_DxV]) if packing and packing.can_pack([head_DxV]) else None}


def products(model: CausalLM, weights: dict, kernels: Kernels) -> tuple[tuple, Callable]:
  """(`Kernels.products`, hidden [B, D] -> float32 logits) over `prepared_weights` (packed by
  `kernels.packing` where it took them), so the loop body multiplies by ready weights instead
  of preparing them at every step."""
  packing = kernels.packing
  table = []
  for kernels_i, ready in zip(_group_weights(model), weights["groups"]):
    if ready is None:
      table.append(None)
      continue
    multiply = packing.matmul if packing and packing.can_pack(kernels_i) else \
        (lambda x, packed: kernels.matmul(x, packed))
    table.append(functools.partial(multiply, packed=ready))
  if weights["head"] is not None:
    return tuple(table), functools.partial(packing.logits, packed=weights["head"])
  return tuple(table), functools.partial(jnp.dot, b=model.head_DxV(),
                                         preferred_element_type=jnp.float32)


def _merged(graphdef, state, cfg) -> CausalLM:
  """The model, adapters merged when `cfg.merge_lora`."""
  model: CausalLM = nnx.merge(graphdef, state)
  return merge_adapters(model) if cfg.merge_lora else model


def weights_of(graphdef, state, cfg, packed: bool, mesh=None) -> dict:
  """`prepared_weights` of the model as `prepared_model` sees it (a program of its own, so that
  several programs share the weights prepared once)."""
  model = _merged(graphdef, state, cfg)
  return prepared_weights(model, seam.choose(model.cfg, mesh, packed=packed).packing)


@contextlib.contextmanager
def prepared_model(graphdef, state, cfg, packed: bool, prepare: bool = True, weights: dict | None = None,
                   *, mesh=None, decode_rows: tuple[int, int] | None = None):
  """Yields (model, logits_of, kernels): the model (adapters merged when `cfg.merge_lora`);
  hidden [B, D] -> float32 logits; and the program's `Kernels` (`seam.choose` for the mesh,
  with the C++ decode attention given `decode_rows`), whose `products` multiply the
  projections by weights prepared once (`prepared_weights`, here or given as `weights`; with
  `packed`, packed by the seam's `Kernels.packing` where the backend has one). `prepare`
  false keeps the model's own products (no second copy of the weights; the head is still
  packed)."""
  model = _merged(graphdef, state, cfg)
  kernels = seam.choose(model.cfg, mesh, decode_rows=decode_rows, packed=packed)
  if weights is None:
    weights = prepared_weights(model, kernels.packing)
  table, logits_of = products(model, weights, kernels)
  yield model, scoped("lm_head", logits_of), (dataclasses.replace(kernels, products=table) if prepare
                                               else kernels)


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
