"""Batched sampling with a KV cache: greedy, temperature, top-k and exact top-p.

Shape suffixes: P prompts, G samples per prompt, B = P * G rows, Tp prompt
slots (bucketed), N generated tokens (bucketed), S = Tp + N cache slots,
V vocabulary, D hidden.

Per-step token choice (temperature, top-k, exact top-p, the draw) is in
`rollout.strategies`.

`Sampler.sample` prefills each prompt once, copies its cache to its G rows,
and decodes in blocks of `stop_check_every` fixed-trip steps inside a
`lax.while_loop` (one per cache-size segment) that tests "all done" once per
block, in one program compiled once per (P, Tp, N, G) and reused across calls
with new weights. With `continuous` the requests run through a fixed number of
slots instead (`rollout.continuous`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax import lax

from epgrpo_jax.models import CausalLM, Kernels, as_dtype, grown, init_cache, rope_table, split_cache
from epgrpo_jax.kernels import seam
from epgrpo_jax.parallel import sharding
from epgrpo_jax.parallel.distributed import put  # global arrays, also across processes
from epgrpo_jax.rollout import continuous
from epgrpo_jax.rollout.sampling_config import SamplingConfig
from epgrpo_jax.rollout.decode import (DecodeWeights, SampleOutput, block, bucket, chooser, in_blocks, laid_out,
                                       left_pad, mesh_of, placements, prepared_model, request_keys, round_up, segment_ends,
                                       stops, token_keys, weights_of)

__all__ = ["SampleOutput", "Sampler", "SamplingConfig", "bucket", "left_pad", "segment_ends", "shared_programs"]

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


# ---------------------------------------------------------------------------
# The sampler.


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


class Sampler:
  """Samples G completions per prompt from a causal LM (`models.CausalLM`), one compilation per shape.

  The model comes in as a `CausalLM` or `(graphdef, state)`; the state is an
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
             max_new_tokens: int | None = None, eos_ids: Sequence[int] | None = None,
             stop_after=None) -> SampleOutput:
    """G = `num_samples` completions of up to `max_new_tokens` for each prompt.

    `prompts`: a list of token-id lists, or (ids [P, T], mask [P, T]).
    `eos_ids` overrides the sampler's stop ids for this call (the same number
    of ids reuses the compiled program; `config.ignore_eos` ignores both). Same
    inputs and key give the same output. `stop_after` [P, G] ends each completion after
    that many tokens as if a stop token came (benchmarks impose lengths with it).
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
      batch = self.prompt_sharding(ids_PxTp.shape)
      ids, mask = put(ids_PxTp, batch), put(mask_PxTp, batch)
      key = put(key, sharding.replicated(self.mesh))
    else:
      ids, mask = jnp.asarray(ids_PxTp), jnp.asarray(mask_PxTp)
    eos = self.stop_ids(eos_ids)
    if self.config.continuous:
      return continuous.generate(self, graphdef, state, ids_PxTp, mask_PxTp, num_samples,
                                 request_keys(key, p, num_samples), max_new, eos, stop_after)
    native = self.uses_cpu_kernels()
    weights = self.prepared(graphdef, state)
    caps_B = np.full(p * num_samples, max_new, np.int32)
    if stop_after is not None:
      caps_B = np.minimum(caps_B, np.asarray(stop_after, np.int32).reshape(-1))
    caps_B = caps_B if self.mesh is None else put(caps_B, sharding.replicated(self.mesh))
    args = (weights, ids, mask, key, jnp.asarray(caps_B), eos)
    fn = functools.partial(self._generate, part="sample", num_samples=num_samples,
                           gen_len=n, prompt_len=tp, native=native)
    program = self.compiled(graphdef, f"prompts={p} prompt_len={tp} gen_len={n} samples={num_samples}",
                            fn, args)
    out = program(*args)
    if max_new < n:
      out = out.replace(tokens=out.tokens[..., :max_new], mask=out.mask[..., :max_new],
                        logp=out.logp[..., :max_new], entropy=out.entropy[..., :max_new])
    return out

  def prepared(self, graphdef, state) -> DecodeWeights:
    """The call's weights prepared once, in a program of their own (`decode.weights_of`, laid
    out by `decode.laid_out`): the programs that decode take them ready, never the weights as
    they were. Weights on another mesh than the sampler's are prepared where they lie (each
    device its shard) and then moved onto the sampler's leaf by leaf: a program that moved them
    all at once would hold a second whole copy in its temporaries (on TPU)."""
    source = mesh_of(state)
    moved = source is not None and self.mesh is not None and source != self.mesh
    program = self.compiled(graphdef, "prepare weights", self.prepare_fn(graphdef, source if moved else self.mesh),
                            (state,))
    weights = program(state)
    if moved:
      weights = jax.tree.map(jax.device_put, weights, placements(weights, self.mesh))
    return weights

  def prepare_fn(self, graphdef, mesh) -> Callable:
    """state -> the sampler's `DecodeWeights` laid out on `mesh` (with the C++ kernels, packed
    for them)."""
    cfg = self.config
    return lambda state: laid_out(weights_of(
        graphdef, state, cfg, self.uses_cpu_kernels() and cfg.packed_weights, prepare=cfg.packed_weights,
        mesh=self.mesh), mesh)

  def stop_ids(self, eos_ids: Sequence[int] | None = None) -> jax.Array:
    """The stop ids [E] a call tests (`eos_ids`, else the sampler's; none with `ignore_eos`)."""
    eos = () if self.config.ignore_eos else tuple(self.eos_ids if eos_ids is None else eos_ids)
    return jnp.asarray(eos or (-1,), jnp.int32)  # -1: never matches

  def compiled(self, graphdef, tag: str, fn: Callable, args, donate: tuple[int, ...] = (),
               lower: Callable | None = None):
    """`fn` jitted and compiled for `args` once per (model structure, `tag`, argument
    signature), the arguments `donate` donated
    (updated in place); shared within `shared_programs`; each compilation counted and logged.
    `lower(fn, args, donate)`: how to compile it (default: plain `jax.jit`)."""
    leaves, treedef = jax.tree.flatten(args)
    signature = (graphdef, tag, treedef,
                 tuple((x.shape, x.dtype, sharding.placement(x)) for x in leaves))
    program = self._programs.get(signature)
    shared_key = (self.config, self.eos_ids, self.pad_id, self.mesh, signature)
    if program is None and _SHARED_PROGRAMS is not None:
      program = _SHARED_PROGRAMS.get(shared_key)
      if program is not None:
        self._programs[signature] = program
    if program is None:
      start = time.perf_counter()
      program = (lower or self._lower)(fn, args, donate)
      self._programs[signature] = program
      if _SHARED_PROGRAMS is not None:
        _SHARED_PROGRAMS[shared_key] = program
      self.num_compilations += 1
      logger.info("compiled sampler program %d: %s (%.1fs)", self.num_compilations, tag,
                  time.perf_counter() - start)
    return program

  @staticmethod
  def _lower(fn: Callable, args, donate: tuple[int, ...] = ()):
    """`fn` jitted and compiled for `args`."""
    return jax.jit(fn, donate_argnums=donate).lower(*args).compile()

  def prompt_sharding(self, shape: tuple[int, ...]) -> jax.sharding.NamedSharding:
    """Where the prompts [P, Tp] live on the sampler's mesh: P over data x fsdp."""
    return sharding.NamedSharding(self.mesh, sharding.spec_for(("batch", None), shape, self.mesh))

  def compile(self, graphdef, args, *, num_samples: int, gen_len: int, prompt_len: int,
              part: str = "sample"):
    """A part of the static sampler's program compiled for `args` (arrays, or
    `jax.ShapeDtypeStruct`s with shardings: `tools/compile_check.py` compiles for a TPU
    topology from a CPU host), uncached and uncounted.

    `part` "prepare": the weights prepared once a call (`prepared`), args (state,), returning
    `DecodeWeights` laid out on the mesh the state lies on; "sample": the whole program
    `sample` runs after it, args (weights, ids [P, Tp], mask, key, caps [B], eos ids); its parts
    alone, for their costs: "prefill", the same args, returning (loop state, keys [B]);
    "block", one block of `config.stop_check_every` decode steps (the decode loop's body, no
    stop test inside), args (weights, loop state, keys [B], caps [B], eos ids, rope table), the
    loop state donated (updated in place, as the decode loop carries it).
    `gen_len`: N; `prompt_len`: Tp. Choices per backend (the C++ CPU kernels) follow the mesh's
    devices."""
    if part == "prepare":
      return self._lower(self.prepare_fn(graphdef, mesh_of(args[0]) or self.mesh), args)
    fn = functools.partial(self._generate, part=part, num_samples=num_samples,
                           gen_len=gen_len, prompt_len=prompt_len, native=self.uses_cpu_kernels())
    return self._lower(fn, args, donate=(1,) if part == "block" else ())  # the loop state, as the loop

  def uses_cpu_kernels(self) -> bool:
    """Whether the sampler's C++ kernels apply (`seam.sampler_native`: `config.cpu_kernels`, one
    CPU device, and they could be built)."""
    return seam.sampler_native(self.mesh, self.config.cpu_kernels)

  # -- the compiled program -------------------------------------------------

  def _constrain_cache(self, cache):
    if self.mesh is None:
      return cache
    return lax.with_sharding_constraint(cache, sharding.cache_shardings(cache, self.mesh))

  def _generate(self, weights: DecodeWeights, *args, native: bool, num_samples: int, gen_len: int,
                prompt_len: int, part: str = "sample"):
    """`part` (`compile`) of the model's decode, `_decode`, `_prefill` or `_block`, over the
    weights prepared once a call (`prepared`; `decode.prepared_model`: with `native`, packed
    for the CPU's products, and the decode attention in C++: a prompt's `prompt_len` slots
    read once for its `num_samples` rows, which hold identical copies of them), or a prompt's
    cache kept once for its rows (`seam.shared_prompt_cache`)."""
    cfg = self.config
    shared = seam.shared_prompt_cache(cfg.shared_prompt_cache, seam.backend_of(self.mesh))
    with prepared_model(weights, native and cfg.packed_weights, mesh=self.mesh,
                        decode_rows=(num_samples, prompt_len) if native else None
                        ) as (model, logits_of, kernels):
      choose = chooser(cfg, native)
      if part == "block":
        return self._block(model, logits_of, *args, choose=choose, kernels=kernels)
      run = self._prefill if part == "prefill" else self._decode
      return run(model, logits_of, *args, num_samples=num_samples, gen_len=gen_len, choose=choose,
                 kernels=kernels, shared=shared)

  def _emit(self, loop: _Loop, tokens_B, logp_B, entropy_B, caps_B, eos_E) -> _Loop:
    """`loop` with this step's tokens, log-probs and entropies written (pad / 0 for done rows
    and rows at their cap: a block may run past the cap, masked)."""
    live_B = ~loop.done_B & (loop.step < caps_B)
    tokens_B = jnp.where(live_B, tokens_B, self.pad_id)
    zero = jnp.float32(0)
    return loop.replace(
        step=loop.step + 1,
        tokens_BxN=lax.dynamic_update_slice(loop.tokens_BxN, tokens_B[:, None], (0, loop.step)),
        logp_BxN=lax.dynamic_update_slice(
            loop.logp_BxN, jnp.where(live_B, logp_B, zero)[:, None], (0, loop.step)),
        entropy_BxN=lax.dynamic_update_slice(
            loop.entropy_BxN, jnp.where(live_B, entropy_B, zero)[:, None], (0, loop.step)),
        done_B=loop.done_B | (live_B & stops(tokens_B, eos_E)),
        lengths_B=jnp.where(live_B, loop.step + 1, loop.lengths_B),
        last_B=tokens_B,
        positions_B=loop.positions_B + 1)

  def _prefill(self, model: CausalLM, logits_of, ids_PxTp, mask_PxTp, key, caps_B, eos_E, *,
               num_samples: int, gen_len: int, choose: Callable, kernels: Kernels,
               shared: bool = False) -> tuple[_Loop, jax.Array]:
    """Prefills each prompt once into a cache with room for the first decode segment, gives
    each of its G rows a copy (with `shared`: its slots kept once, `models.split_cache`) and
    draws the first token. Returns (loop state, the rows' request keys [B])."""
    cfg, g, k = self.config, num_samples, self.config.stop_check_every
    p, tp = ids_PxTp.shape
    b, n = p * g, round_up(gen_len, k)  # blocks of k steps end on the last segment's end
    cache_dtype = as_dtype(cfg.cache_dtype) if cfg.cache_dtype else None
    ends = segment_ends(n, cfg.decode_segments, k)
    positions_PxTp = jnp.maximum(jnp.cumsum(mask_PxTp, axis=-1) - 1, 0).astype(jnp.int32)
    hidden_PxTpxD, cache = model(ids_PxTp, positions_PxTp, mask_PxTp,
                                 init_cache(model.cfg, p, tp + ends[0], cache_dtype),
                                 rope_table=rope_table(model.cfg, tp + n), kernels=kernels)
    logits_BxV = jnp.repeat(logits_of(hidden_PxTpxD[:, -1]), g, axis=0)
    cache = split_cache(cache, g, init_cache(model.cfg, b, ends[0], cache_dtype), tp) if shared else \
        jax.tree.map(lambda x: jnp.repeat(x, g, axis=0) if x.ndim else x, cache)
    keys_B = request_keys(key, p, g)
    prompt_len_B = jnp.repeat(jnp.sum(mask_PxTp, axis=-1, dtype=jnp.int32), g)
    loop = _Loop(
        step=jnp.zeros((), jnp.int32),
        tokens_BxN=jnp.full((b, n + k), self.pad_id, jnp.int32),  # + k: a block's masked tail
        logp_BxN=jnp.zeros((b, n + k), jnp.float32),
        entropy_BxN=jnp.zeros((b, n + k), jnp.float32),
        done_B=jnp.zeros((b,), bool),
        lengths_B=jnp.zeros((b,), jnp.int32),
        last_B=jnp.zeros((b,), jnp.int32),
        positions_B=prompt_len_B - 1,
        cache=self._constrain_cache(cache))
    return self._emit(loop, *choose(token_keys(keys_B, 0), logits_BxV), caps_B, eos_E), keys_B

  def _step(self, model: CausalLM, logits_of, loop: _Loop, keys_B, caps_B, eos_E, rope_SxHd, *,
            choose: Callable, kernels: Kernels) -> _Loop:
    """One decode step of every row: the model over its last token with the cache, then the
    next token (row b's key `fold_in(keys_B[b], step)`). `rope_SxHd`: the `rope_table` of the
    Tp + N positions, computed once outside the decode loop."""
    b = loop.last_B.shape[0]
    hidden_Bx1xD, cache = model(loop.last_B[:, None], loop.positions_B[:, None],
                                jnp.ones((b, 1), bool), loop.cache, rope_table=rope_SxHd,
                                kernels=kernels)
    loop = loop.replace(cache=self._constrain_cache(cache))
    return self._emit(loop, *choose(token_keys(keys_B, loop.step), logits_of(hidden_Bx1xD[:, 0])),
                      caps_B, eos_E)

  def _block(self, model: CausalLM, logits_of, loop: _Loop, keys_B, caps_B, eos_E, rope_SxHd, *,
             choose: Callable, kernels: Kernels) -> _Loop:
    """One block of `stop_check_every` decode steps (`decode.block`), the decode loop's body."""
    step = functools.partial(self._step, model, logits_of, keys_B=keys_B, caps_B=caps_B, eos_E=eos_E,
                             rope_SxHd=rope_SxHd, choose=choose, kernels=kernels)
    return block(step, self.config.stop_check_every, loop)

  def _decode(self, model: CausalLM, logits_of, ids_PxTp, mask_PxTp, key, caps_B, eos_E, *,
              num_samples: int, gen_len: int, choose: Callable, kernels: Kernels,
              shared: bool = False) -> SampleOutput:
    cfg, g, k = self.config, num_samples, self.config.stop_check_every
    p, tp = ids_PxTp.shape
    b, n = p * g, round_up(gen_len, k)
    cache_dtype = as_dtype(cfg.cache_dtype) if cfg.cache_dtype else None
    loop, keys_B = self._prefill(model, logits_of, ids_PxTp, mask_PxTp, key, caps_B, eos_E,
                                 num_samples=g, gen_len=gen_len, choose=choose, kernels=kernels,
                                 shared=shared)
    step = functools.partial(self._step, model, logits_of, keys_B=keys_B, caps_B=caps_B, eos_E=eos_E,
                             rope_SxHd=rope_table(model.cfg, tp + n), choose=choose,
                             kernels=kernels)
    max_new = jnp.max(caps_B)

    def cond(end: int, loop: _Loop):
      return (loop.step < jnp.minimum(max_new, end)) & ~jnp.all(loop.done_B | (loop.step >= caps_B))

    # Segment j writes slots < Tp + ends[j] - 1; a new segment copies the cache into a larger
    # one (more slots; `grown`), so attention never reads more than it needs.
    # The segments end on multiples of k, and a block starts at a step = 1 (mod k) below its
    # segment's end, so its last step still writes a slot of the segment's cache.
    for j, end in enumerate(segment_ends(n, cfg.decode_segments, k)):
      if j:
        larger = init_cache(model.cfg, b, end if shared else tp + end, cache_dtype)
        loop = loop.replace(cache=self._constrain_cache(grown(loop.cache, larger)))
      loop = in_blocks(functools.partial(cond, end), step, k, loop)
    mask_BxN = jnp.arange(gen_len)[None, :] < loop.lengths_B[:, None]
    shape = (p, g, gen_len)
    return SampleOutput(
        tokens=loop.tokens_BxN[:, :gen_len].reshape(shape), mask=mask_BxN.reshape(shape),
        logp=loop.logp_BxN[:, :gen_len].reshape(shape),
        entropy=loop.entropy_BxN[:, :gen_len].reshape(shape),
        lengths=loop.lengths_B.reshape(p, g), prompt_ids=ids_PxTp, prompt_mask=mask_PxTp)
