"""Batched sampling with a KV cache: greedy, temperature, top-k and exact top-p.

Shape suffixes: P prompts, G samples per prompt, B = P * G rows, Tp prompt
slots (bucketed), N generated tokens (bucketed), S = Tp + N cache slots,
V vocabulary, D hidden.

Per-step token choice (temperature, top-k, exact top-p, the draw) is in
`rollout.strategies`.

`Sampler.sample` prefills each prompt once, copies its cache to its G rows,
and decodes with `lax.while_loop`s (one per cache-size segment) in one
program, compiled once per (P, Tp, N, G) and reused across calls with new
weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax import lax

from epgrpo_jax.io.errors import UserError
from epgrpo_jax.models import (Qwen2, as_dtype, decode_kernel, dense_products, init_cache, merge_lora,
                               rope_table)
from epgrpo_jax.kernels import cpu as cpu_kernels
from epgrpo_jax.parallel import sharding
from epgrpo_jax.parallel.distributed import put  # global arrays, also across processes
from epgrpo_jax.rollout.strategies import largest_threshold, sample_step

logger = logging.getLogger("epgrpo_jax.rollout.sampling")

_SHARED_PROGRAMS: dict | None = None  # set by `shared_programs`


@contextlib.contextmanager
def shared_programs():
  """Samplers share their compiled programs within this context: one with the same config,
  stop ids, mesh and argument signature reuses another's instead of tracing its own
  (`experiments.compare`, which builds a trainer per run in one process)."""
  global _SHARED_PROGRAMS
  previous = _SHARED_PROGRAMS
  _SHARED_PROGRAMS = {} if previous is None else previous
  try:
    yield
  finally:
    _SHARED_PROGRAMS = previous


def _powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
  return tuple(2 ** i for i in range(lo.bit_length() - 1, hi.bit_length()))


def packed_products(model: Qwen2, packing: cpu_kernels.Packing) -> dict:
  """`dense_products` table of the model's projection groups whose layers are their kernels
  alone (no adapters, or merged ones) and whose concatenated kernel `packing` takes: each
  kernel packed once, multiplied by `packing.matmul`."""
  table, dtype = {}, as_dtype(model.cfg.dtype)
  for group in model.linear_groups():
    if any(layer.has_lora and not layer.merged for layer in group):
      continue
    weights = [layer.kernel[...].astype(dtype) for layer in group]
    if packing.can_pack(weights):
      table[tuple(map(id, group))] = functools.partial(packing.matmul, packed=packing.pack(weights))
  return table


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """How to pick tokens and how to bucket shapes.

  temperature 0 or `greedy` picks the argmax; `top_k` 0 and `top_p` 1.0 are
  off. Prompt lengths round up to the next of `prompt_buckets` and
  `max_new_tokens` to the next of `length_buckets` (beyond the largest: a
  multiple of it). `cache_dtype` None uses the model's compute dtype. The
  decode loop runs in up to `decode_segments` segments whose caches grow, so
  early steps attend over fewer slots (each segment is one more loop body to
  compile). `ignore_eos` never stops at a stop token: every completion gets
  exactly `max_new_tokens` (benchmarks). `merge_lora` folds LoRA adapters into
  the kernels once per call instead of applying them at every decode step
  (the same policy up to rounding in the compute dtype). `cpu_kernels` runs
  the decode steps' attention (float32 or bfloat16 cache) and the top-k / top-p
  thresholds (with top-k off, the whole draw) in C++ kernels on a single CPU
  device, and, with `packed_weights`, the projections and head as C++ products
  over weights packed once per call: a bfloat16 model's on AMX tiles, a float32
  model's on AVX-512, where the CPU has them (built on first use; XLA where they
  cannot be built, on accelerators, and over a mesh of several devices). The
  packed weights are a second copy for the duration of a call;
  `packed_weights=false` saves that memory.
  """

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  greedy: bool = False
  max_new_tokens: int = 256
  prompt_buckets: tuple[int, ...] = _powers_of_two(32, 8192)
  length_buckets: tuple[int, ...] = _powers_of_two(16, 8192)
  cache_dtype: str | None = None
  decode_segments: int = 2
  ignore_eos: bool = False
  merge_lora: bool = True
  cpu_kernels: bool = True
  packed_weights: bool = True

  def __post_init__(self):
    if not self.temperature >= 0:  # also rejects NaN
      raise UserError(f"sampling.temperature: must be >= 0, got {self.temperature}")
    if self.top_k < 0:
      raise UserError(f"sampling.top_k: must be >= 0 (0 = off), got {self.top_k}")
    if not 0 < self.top_p <= 1:
      raise UserError(f"sampling.top_p: must be in (0, 1], got {self.top_p}")
    if self.max_new_tokens < 1:
      raise UserError(f"sampling.max_new_tokens: must be >= 1, got {self.max_new_tokens}")
    for name in ("prompt_buckets", "length_buckets"):
      buckets = tuple(getattr(self, name))
      object.__setattr__(self, name, buckets)
      if not buckets or any(int(b) != b or b < 1 for b in buckets) or list(buckets) != sorted(set(buckets)):
        raise UserError(f"sampling.{name}: must be increasing positive integers, got {buckets}")
    if self.decode_segments < 1:
      raise UserError(f"sampling.decode_segments: must be >= 1, got {self.decode_segments}")
    if self.cache_dtype is not None:
      try:
        as_dtype(self.cache_dtype)
      except ValueError as e:
        raise UserError(f"sampling.cache_dtype: {e}") from None

  @property
  def is_greedy(self) -> bool:
    return self.greedy or self.temperature == 0

  def replace(self, **kw) -> "SamplingConfig":
    return dataclasses.replace(self, **kw)


def segment_ends(n: int, segments: int) -> list[int]:
  """Ends of the decode segments over N steps: equal, multiples of 8, at least 8 long."""
  segments = max(1, min(segments, n // 8))
  size = -(-n // segments)
  size = -(-size // 8) * 8
  return sorted({min(n, size * (i + 1)) for i in range(segments)})


def bucket(n: int, buckets: Sequence[int]) -> int:
  """The smallest bucket >= n; past the largest, the next multiple of the largest."""
  for b in buckets:
    if b >= n:
      return b
  return -(-n // buckets[-1]) * buckets[-1]


# ---------------------------------------------------------------------------
# The sampler.


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


@struct.dataclass
class _Loop:
  step: jax.Array  # tokens written so far
  tokens_BxN: jax.Array
  logp_BxN: jax.Array
  entropy_BxN: jax.Array
  done_B: jax.Array
  lengths_B: jax.Array
  last_B: jax.Array
  positions_B: jax.Array  # position of `last_B`
  cache: dict


def left_pad(prompts: Sequence[Sequence[int]], length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
  """Right-aligns each prompt in a [P, length] array; returns (ids int32, mask bool)."""
  ids = np.full((len(prompts), length), pad_id, np.int32)
  mask = np.zeros((len(prompts), length), bool)
  for i, p in enumerate(prompts):
    if len(p):
      ids[i, length - len(p):] = np.asarray(p, np.int32)
      mask[i, length - len(p):] = True
  return ids, mask


class Sampler:
  """Samples G completions per prompt from a Qwen2 model, one compilation per shape.

  The model comes in as a `Qwen2` or `(graphdef, state)`; the state is an
  argument of the compiled program, so new weights (a LoRA update) do not
  recompile. `num_compilations` counts compiled programs; each is logged.
  """

  def __init__(self, config: SamplingConfig, *, eos_ids: Sequence[int] = (), pad_id: int = 0,
               mesh: jax.sharding.Mesh | None = None):
    self.config = config
    self.eos_ids = tuple(int(e) for e in eos_ids)
    self.pad_id = int(pad_id)
    self.mesh = mesh
    self.num_compilations = 0
    self._programs: dict[Any, Any] = {}

  # -- host side ------------------------------------------------------------

  def prepare_prompts(self, prompts) -> tuple[np.ndarray, np.ndarray]:
    """Token lists, or (ids [P, T], mask [P, T]) in any padding: left-padded to the bucket."""
    if isinstance(prompts, tuple) and len(prompts) == 2 and hasattr(prompts[0], "shape"):
      ids, mask = (np.asarray(a) for a in prompts)
      if ids.ndim != 2 or ids.shape != mask.shape:
        raise ValueError(f"prompts: ids {ids.shape} and mask {mask.shape} must both be [P, T]")
      prompts = [row[m.astype(bool)].tolist() for row, m in zip(ids, mask)]
    prompts = [list(p) for p in prompts]
    if not prompts:
      raise ValueError("prompts: empty batch")
    for i, p in enumerate(prompts):
      if not p:
        raise ValueError(f"prompts[{i}]: empty prompt")
    length = bucket(max(len(p) for p in prompts), self.config.prompt_buckets)
    return left_pad(prompts, length, self.pad_id)

  def sample(self, model, prompts, num_samples: int, key: jax.Array,
             max_new_tokens: int | None = None, eos_ids: Sequence[int] | None = None) -> SampleOutput:
    """G = `num_samples` completions of up to `max_new_tokens` for each prompt.

    `prompts`: a list of token-id lists, or (ids [P, T], mask [P, T]).
    `eos_ids` overrides the sampler's stop ids for this call (the same number
    of ids reuses the compiled program; `config.ignore_eos` ignores both). Same
    inputs and key give the same output.
    """
    if num_samples < 1:
      raise ValueError(f"num_samples: must be >= 1, got {num_samples}")
    max_new = self.config.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
    if max_new < 1:
      raise ValueError(f"max_new_tokens: must be >= 1, got {max_new}")
    graphdef, state = model if isinstance(model, tuple) else nnx.split(model)
    ids_PxTp, mask_PxTp = self.prepare_prompts(prompts)
    p, tp = ids_PxTp.shape
    n = bucket(max_new, self.config.length_buckets)
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
      key = jax.random.wrap_key_data(key)

    if self.mesh is not None:
      batch = sharding.NamedSharding(self.mesh, sharding.spec_for(("batch", None), ids_PxTp.shape, self.mesh))
      ids, mask = put(ids_PxTp, batch), put(mask_PxTp, batch)
      key = put(key, sharding.replicated(self.mesh))
    else:
      ids, mask = jnp.asarray(ids_PxTp), jnp.asarray(mask_PxTp)
    eos = () if self.config.ignore_eos else tuple(self.eos_ids if eos_ids is None else eos_ids)
    eos = eos or (-1,)  # -1: never matches
    args = (state, ids, mask, key, jnp.asarray(max_new, jnp.int32), jnp.asarray(eos, jnp.int32))
    program = self._program(graphdef, args, p, tp, n, num_samples)
    out = program(*args)
    if max_new < n:
      out = out.replace(tokens=out.tokens[..., :max_new], mask=out.mask[..., :max_new],
                        logp=out.logp[..., :max_new], entropy=out.entropy[..., :max_new])
    return out

  def _program(self, graphdef, args, p: int, tp: int, n: int, g: int):
    leaves, treedef = jax.tree.flatten(args)
    signature = (graphdef, treedef, p, tp, n, g,
                 tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in leaves))
    program = self._programs.get(signature)
    shared_key = (self.config, self.eos_ids, self.pad_id, self.mesh, signature)
    if program is None and _SHARED_PROGRAMS is not None:
      program = _SHARED_PROGRAMS.get(shared_key)
      if program is not None:
        self._programs[signature] = program
    if program is None:
      start = time.perf_counter()
      kernels = self._use_cpu_kernels()
      fn = jax.jit(functools.partial(
          self._generate, graphdef, num_samples=g, gen_len=n,
          packed=kernels and self.config.packed_weights,
          choose=self._chooser(kernels)))
      attention = (functools.partial(cpu_kernels.decode_attention, share_rows=g, shared_slots=tp)
                   if kernels else None)
      with decode_kernel(attention):  # read while tracing
        program = fn.lower(*args).compile()
      self._programs[signature] = program
      if _SHARED_PROGRAMS is not None:
        _SHARED_PROGRAMS[shared_key] = program
      self.num_compilations += 1
      logger.info("compiled sampler program %d: prompts=%d prompt_len=%d gen_len=%d samples=%d "
                  "(%.1fs)", self.num_compilations, p, tp, n, g, time.perf_counter() - start)
    return program

  def _chooser(self, kernels: bool) -> Callable:
    """(key, logits_BxV) -> (tokens_B, logp_B, entropy_B): `sample_step`, its thresholds in
    C++ with `kernels`, and with top-k off the whole draw in C++ (`cpu_kernels.nucleus_draw`)."""
    cfg = self.config
    if kernels and not cfg.is_greedy and cfg.top_k == 0:
      return functools.partial(cpu_kernels.nucleus_draw, temperature=cfg.temperature,
                               top_p=cfg.top_p)
    threshold = cpu_kernels.largest_threshold if kernels else largest_threshold
    return functools.partial(sample_step, cfg=cfg, threshold=threshold)

  def _use_cpu_kernels(self) -> bool:
    """Whether the C++ kernels apply: one CPU device, and they could be built.

    The attention kernel reads a prompt's Tp slots once for its G rows, which hold
    identical copies of them.
    """
    one_device = self.mesh is None or self.mesh.size == 1
    return (self.config.cpu_kernels and one_device and jax.default_backend() == "cpu"
            and cpu_kernels.available())

  # -- the compiled program -------------------------------------------------

  def _constrain_cache(self, cache):
    if self.mesh is None:
      return cache
    return lax.with_sharding_constraint(cache, sharding.cache_shardings(cache, self.mesh))

  def _generate(self, graphdef, state, *args, packed: bool, **kwargs) -> SampleOutput:
    """`_decode` of the model (adapters merged unless `merge_lora` is off). With `packed` (the
    CPU kernels are available) the projections and head run as the packed products of the
    model's dtype where this CPU has them, over weights packed once here, outside the
    decode loop."""
    model: Qwen2 = nnx.merge(graphdef, state)
    if self.config.merge_lora:
      merge_lora(model)  # in this trace only: the caller's state is untouched
    head_DxV = model.head_DxV()
    logits_of = functools.partial(jnp.dot, b=head_DxV, preferred_element_type=jnp.float32)
    products = {}
    packing = cpu_kernels.packing_for(as_dtype(model.cfg.dtype)) if packed else None
    if packing:
      products = packed_products(model, packing)
      if packing.can_pack([head_DxV]):
        logits_of = functools.partial(packing.logits, packed=packing.pack([head_DxV]))
    with dense_products(products):
      return self._decode(model, logits_of, *args, **kwargs)

  def _decode(self, model: Qwen2, logits_of, ids_PxTp, mask_PxTp, key, max_new, eos_E, *,
              num_samples: int, gen_len: int, choose: Callable) -> SampleOutput:
    cfg, g, n = self.config, num_samples, gen_len
    p, tp = ids_PxTp.shape
    b = p * g
    cache_dtype = as_dtype(cfg.cache_dtype) if cfg.cache_dtype else None

    # Prefill each prompt once into a cache with room for the first segment, then give
    # each of its G rows a copy (every cache leaf but the scalar index has batch first).
    ends = segment_ends(n, cfg.decode_segments)
    positions_PxTp = jnp.maximum(jnp.cumsum(mask_PxTp, axis=-1) - 1, 0).astype(jnp.int32)
    rope_SxHd = rope_table(model.cfg, tp + n)  # positions stay below Tp + N
    hidden_PxTpxD, cache = model(ids_PxTp, positions_PxTp, mask_PxTp,
                                 init_cache(model.cfg, p, tp + ends[0], cache_dtype),
                                 rope_table=rope_SxHd)
    logits_BxV = jnp.repeat(logits_of(hidden_PxTpxD[:, -1]), g, axis=0)
    cache = jax.tree.map(lambda x: jnp.repeat(x, g, axis=0) if x.ndim else x, cache)
    cache = self._constrain_cache(cache)

    def emit(loop: _Loop, tokens_B, logp_B, entropy_B) -> _Loop:
      live_B = ~loop.done_B
      tokens_B = jnp.where(live_B, tokens_B, self.pad_id)
      zero = jnp.float32(0)
      return loop.replace(
          step=loop.step + 1,
          tokens_BxN=lax.dynamic_update_slice(loop.tokens_BxN, tokens_B[:, None], (0, loop.step)),
          logp_BxN=lax.dynamic_update_slice(
              loop.logp_BxN, jnp.where(live_B, logp_B, zero)[:, None], (0, loop.step)),
          entropy_BxN=lax.dynamic_update_slice(
              loop.entropy_BxN, jnp.where(live_B, entropy_B, zero)[:, None], (0, loop.step)),
          done_B=loop.done_B | (live_B & jnp.any(tokens_B[:, None] == eos_E[None, :], axis=-1)),
          lengths_B=jnp.where(live_B, loop.step + 1, loop.lengths_B),
          last_B=tokens_B,
          positions_B=loop.positions_B + 1)

    def step_key(step):
      return jax.random.fold_in(key, step)

    prompt_len_B = jnp.repeat(jnp.sum(mask_PxTp, axis=-1, dtype=jnp.int32), g)
    loop = _Loop(
        step=jnp.zeros((), jnp.int32),
        tokens_BxN=jnp.full((b, n), self.pad_id, jnp.int32),
        logp_BxN=jnp.zeros((b, n), jnp.float32),
        entropy_BxN=jnp.zeros((b, n), jnp.float32),
        done_B=jnp.zeros((b,), bool),
        lengths_B=jnp.zeros((b,), jnp.int32),
        last_B=jnp.zeros((b,), jnp.int32),
        positions_B=prompt_len_B - 1,
        cache=cache)
    loop = emit(loop, *choose(step_key(0), logits_BxV))

    def cond(end: int, loop: _Loop):
      return (loop.step < jnp.minimum(max_new, end)) & ~jnp.all(loop.done_B)

    def body(loop: _Loop):
      hidden_Bx1xD, cache = model(loop.last_B[:, None], loop.positions_B[:, None],
                                  jnp.ones((b, 1), bool), loop.cache, rope_table=rope_SxHd)
      loop = loop.replace(cache=self._constrain_cache(cache))
      return emit(loop, *choose(step_key(loop.step), logits_of(hidden_Bx1xD[:, 0])))

    # Segment j writes slots < Tp + ends[j] - 1; a new segment copies the cache into a
    # larger one (the same layout, more slots), so attention never reads more than it needs.
    for j, end in enumerate(ends):
      if j:
        larger = init_cache(model.cfg, b, tp + end, cache_dtype)
        cache = jax.tree.map(
            lambda new, old: lax.dynamic_update_slice(new, old, (0,) * old.ndim) if old.ndim else old,
            larger, loop.cache)
        loop = loop.replace(cache=self._constrain_cache(cache))
      loop = lax.while_loop(functools.partial(cond, end), body, loop)
    mask_BxN = jnp.arange(n)[None, :] < loop.lengths_B[:, None]
    shape = (p, g, n)
    return SampleOutput(
        tokens=loop.tokens_BxN.reshape(shape), mask=mask_BxN.reshape(shape),
        logp=loop.logp_BxN.reshape(shape), entropy=loop.entropy_BxN.reshape(shape),
        lengths=loop.lengths_B.reshape(p, g), prompt_ids=ids_PxTp, prompt_mask=mask_PxTp)
