"""Continuous batching: more requests than decode rows, finished rows refilled between blocks.

R requests (prompt p, sample g, key) run through S slots (rows of one cache). One compiled
program per block inserts the newcomers into free slots (their prompt's cache, prefilled
once per prompt, copied in; their first token drawn from the prompt's last logits), then
decodes `refill_every` = k tokens in every slot (a fixed-trip loop, finished slots masked).
Between blocks the host reads the block's tokens (one small transfer per k tokens), frees
the slots whose request stopped and assigns queued requests to them. Once the queue is
empty and at most half the slots are busy, the busy ones move into a state of half as many
rows (one program per row count), so the tail of long completions does not drag idle rows.

A request's token t is drawn with fold_in(its key, t) (`decode.token_keys`), so its tokens
depend neither on its slot nor on its neighbours: with the keys `decode.request_keys`
gives, a request's completion is the static sampler's for the same prompt and sample.

The queue can grow while it runs (`run`'s `on_group`): when the G requests of a prompt are
done, the caller may queue the next prompt, taken from further batches of P prompts that
are prefilled into a store of fixed size as they are needed (DAPO dynamic sampling,
`training.rollouts.dynamic_refill_batch`). On a mesh the slots' rows are split over its
batch axes (data x fsdp), the prompt store is replicated, and the weights are prepared once a
call (`Sampler.prepared`): the prefill and the blocks take them ready.
See docs/sampling.md ("Continuous batching").

Shape suffixes: S slots, C = each slot's cache capacity, Tp prompt slots, P prompts,
Q prompts the store holds, R requests, k tokens per block (K stays the models' kv heads).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax import lax
from jax.experimental.layout import Format, Layout
from jax.sharding import NamedSharding, PartitionSpec as P

from epgrpo_jax.io.errors import UserError
from epgrpo_jax.models import XLA, Kernels, as_dtype, init_cache, rope_table
from epgrpo_jax.parallel import sharding
from epgrpo_jax.parallel.distributed import put
from epgrpo_jax.rollout.decode import (DecodeWeights, SampleOutput, bucket, chooser, left_pad, prepared_model,
                                       request_keys, stops, token_keys)


@struct.dataclass
class Slots:
  """The decode state of S slots. A slot is live while its request has not stopped; a free or
  finished slot is `done` and its steps are masked (its index and position stand still)."""

  cache: dict  # k, v per layer; valid [S, C]; index [S]: the slot its next token is written to
  last_S: jax.Array  # the last token
  positions_S: jax.Array  # its position
  t_S: jax.Array  # tokens of the request emitted so far
  done_S: jax.Array
  keys_S: jax.Array  # the request's key
  cap_S: jax.Array  # the request's length cap: min(max_new_tokens, its stop_after)


@struct.dataclass
class Block:
  """What one block emitted: column 0 the first tokens of the slots filled at its start,
  columns 1..k its decode steps; `live` marks the real tokens."""

  tokens_Sxk: jax.Array
  logp_Sxk: jax.Array
  entropy_Sxk: jax.Array
  live_Sxk: jax.Array


def slot_capacity(config, prompt_slots: int, max_new: int) -> int:
  """Cache slots per row: `slot_tokens`, or the prompt bucket + max_new's length bucket."""
  need = prompt_slots + max_new
  if config.slot_tokens and need > config.slot_tokens:
    raise UserError(f"sampling.slot_tokens: {config.slot_tokens} cannot hold a request of "
                    f"{prompt_slots} prompt slots + {max_new} new tokens")
  return config.slot_tokens or prompt_slots + bucket(max_new, config.length_buckets)


def empty_slots(model_cfg, s: int, capacity: int, cache_dtype, keys_R) -> Slots:
  cache = init_cache(model_cfg, s, capacity, cache_dtype)
  cache["index"] = jnp.zeros((s,), jnp.int32)
  def zeros():  # distinct buffers: the block program donates them
    return jnp.zeros((s,), jnp.int32)
  return Slots(cache=cache, last_S=zeros(), positions_S=zeros(), t_S=zeros(),
               done_S=jnp.ones((s,), bool), keys_S=jnp.repeat(keys_R[:1], s), cap_S=zeros())


def prefill(model, logits_of, ids_PxTp, mask_PxTp, cache_dtype, kernels: Kernels = XLA):
  """Each prompt once: (its cache over Tp slots, the logits after its last token [P, V])."""
  p, tp = ids_PxTp.shape
  positions_PxTp = jnp.maximum(jnp.cumsum(mask_PxTp, axis=-1) - 1, 0).astype(jnp.int32)
  hidden_PxTpxD, cache = model(ids_PxTp, positions_PxTp, mask_PxTp,
                               init_cache(model.cfg, p, tp, cache_dtype),
                               rope_table=rope_table(model.cfg, tp), kernels=kernels)
  return cache, logits_of(hidden_PxTpxD[:, -1])


def insert(slots: Slots, store, first_logits_PxV, prompt_len_P, fill_S, prompt_S, keys_S, cap_S,
           eos_E, choose: Callable, pad_id: int, mesh=None) -> tuple[Slots, tuple]:
  """Slots marked `fill_S` take a new request: prompt `prompt_S`'s cache (its Tp slots, written
  into the filled rows only: `write_prompts`; the rest of the row marked invalid), its key and
  cap, and its first token. Returns the slots and that token's (tokens, logp, entropy, live)
  column."""
  tp = store["valid"].shape[1]
  cache = dict(slots.cache)
  cache["k"], cache["v"] = write_prompts(cache, store, fill_S, prompt_S, mesh)
  valid_SxC = jnp.zeros_like(cache["valid"]).at[:, :tp].set(store["valid"][prompt_S])
  cache["valid"] = jnp.where(fill_S[:, None], valid_SxC, cache["valid"])
  cache["index"] = jnp.where(fill_S, tp, cache["index"])
  tokens_S, logp_S, entropy_S = choose(token_keys(keys_S, 0), first_logits_PxV[prompt_S])
  tokens_S = jnp.where(fill_S, tokens_S, pad_id)
  slots = slots.replace(
      cache=cache, last_S=jnp.where(fill_S, tokens_S, slots.last_S),
      positions_S=jnp.where(fill_S, prompt_len_P[prompt_S], slots.positions_S),
      t_S=jnp.where(fill_S, 1, slots.t_S),
      done_S=jnp.where(fill_S, stops(tokens_S, eos_E) | (cap_S <= 1), slots.done_S),
      keys_S=jnp.where(fill_S, keys_S, slots.keys_S), cap_S=jnp.where(fill_S, cap_S, slots.cap_S))
  zero = jnp.float32(0)
  return slots, (tokens_S, jnp.where(fill_S, logp_S, zero), jnp.where(fill_S, entropy_S, zero), fill_S)


def copy_rows(k_layers, v_layers, store_k, store_v, fill_S, prompt_S):
  """The store's prompt `prompt_S[r]` keys and values (its Tp slots) written into slots [0, Tp)
  of each row r that `fill_S` marks: a loop over those rows only (as many trips as rows
  filled), each an in-place update of one row per layer; the other rows are neither read nor
  written. Returns the layers' (keys, values)."""
  fill_S, prompt_S = jnp.asarray(fill_S), jnp.asarray(prompt_S)
  rows_S = jnp.argsort(~fill_S, stable=True)  # the filled rows first

  def one(i, layers):
    r = rows_S[i]
    def put(c, new):
      return lax.dynamic_update_slice(c, lax.dynamic_slice_in_dim(new, prompt_S[r], 1).astype(c.dtype),
                                      (r,) + (0,) * (c.ndim - 1))
    return [put(c, new) for c, new in zip(layers[0], store_k)], [put(c, new) for c, new in zip(layers[1], store_v)]

  return lax.fori_loop(0, fill_S.sum(dtype=jnp.int32), one, (list(k_layers), list(v_layers)))


def write_prompts(cache, store, fill_S, prompt_S, mesh=None):
  """`copy_rows` over the slots' cache; on a mesh within each device's own rows (`jax.shard_map`:
  rows stay where they are, the replicated store is read where it lies, nothing is gathered)."""
  args = (cache["k"], cache["v"], store["k"], store["v"], fill_S, prompt_S)
  if mesh is None:
    return copy_rows(*args)
  kv = sharding.cache_shardings(cache, mesh)
  k_specs, v_specs = [x.spec for x in kv["k"]], [x.spec for x in kv["v"]]
  rows = P(tuple(k_specs[0])[0]) if k_specs else P()
  def whole(spec):  # the store: replicated, split as the cache's other axes
    return P(None, *tuple(spec)[1:])
  return jax.shard_map(copy_rows, mesh=mesh, check_vma=False,
                       in_specs=(k_specs, v_specs, [whole(x) for x in k_specs], [whole(x) for x in v_specs],
                                 rows, rows),
                       out_specs=(k_specs, v_specs))(*args)


def decode_step(model, logits_of, rope, slots: Slots, eos_E, choose: Callable, pad_id: int,
                kernels: Kernels = XLA):
  """One token for every live slot (the others masked): (slots, (tokens, logp, entropy, live))."""
  s = slots.last_S.shape[0]
  hidden_Sx1xD, cache = model(slots.last_S[:, None], slots.positions_S[:, None], jnp.ones((s, 1), bool),
                              slots.cache, rope_table=rope, kernels=kernels)
  tokens_S, logp_S, entropy_S = choose(token_keys(slots.keys_S, slots.t_S), logits_of(hidden_Sx1xD[:, 0]))
  live_S = ~slots.done_S
  tokens_S = jnp.where(live_S, tokens_S, pad_id)
  step_S = live_S.astype(jnp.int32)
  cache["index"] = slots.cache["index"] + step_S
  t_S = slots.t_S + step_S
  slots = slots.replace(
      cache=cache, last_S=jnp.where(live_S, tokens_S, slots.last_S),
      positions_S=slots.positions_S + step_S, t_S=t_S,
      done_S=slots.done_S | (live_S & (stops(tokens_S, eos_E) | (t_S >= slots.cap_S))))
  zero = jnp.float32(0)
  return slots, (tokens_S, jnp.where(live_S, logp_S, zero), jnp.where(live_S, entropy_S, zero), live_S)


def run_block(weights: DecodeWeights, store, first_logits_PxV, prompt_len_P, slots: Slots, fill_S, prompt_S,
              keys_S, cap_S, eos_E, *, cfg, native: bool, k: int, capacity: int, pad_id: int, mesh=None):
  """The compiled block: insert the newcomers, then k decode steps (`lax.scan`, no host test),
  over the weights prepared once a call (`Sampler.prepared`)."""
  choose = chooser(cfg, native)
  with prepared_model(weights, native and cfg.packed_weights, mesh=mesh,
                      decode_rows=(1, 0) if native else None) as (model, logits_of, kernels):
    rope = rope_table(model.cfg, capacity)
    slots, first = insert(slots, store, first_logits_PxV, prompt_len_P, fill_S, prompt_S, keys_S, cap_S,
                          eos_E, choose, pad_id, mesh)
    step = functools.partial(decode_step, model, logits_of, rope, eos_E=eos_E, choose=choose,
                             pad_id=pad_id, kernels=kernels)
    slots, steps = lax.scan(lambda c, _: step(c), slots, length=k)
  slots = _on_mesh(slots, mesh)
  columns = [jnp.concatenate([a[:, None], b.T], axis=1) for a, b in zip(first, steps)]
  return slots, Block(*columns)


KV_LAYOUT = Layout.AUTO  # the block's cache layout: the compiler's pick (tests force another)


def lower_block(fn: Callable, args, donate: tuple[int, ...] = (4,)):
  """The block program (`run_block` over `args`, the slots `args[4]` donated) compiled with the
  slots' keys and values in the layout the compiler picks (`Layout.AUTO`), the same in and
  out. Its decode loop writes one slot per row (a scatter); on TPU it wants each row's slots
  major to its heads, and with the caller's (the default) layout the program would copy the
  whole cache into that layout and back every block. The engine's slots are copied into the
  picked layout before the first block (`sharding.fitted`: the compiled program refuses any
  other) and keep it from block to block. On CPU the picked layout is the default one."""
  slots = args[4]
  def placed(x):  # an array's sharding, None where jit places it (uncommitted: by the other arguments)
    return x.sharding if getattr(x, "committed", True) else None
  def auto(x):
    return Format(KV_LAYOUT, placed(x))
  def abstract(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=placed(x))
  def with_kv(base: Slots, f) -> Slots:  # `base`, its cache's keys and values f of the slots' own
    return base.replace(cache={**base.cache, "k": [f(x) for x in slots.cache["k"]],
                               "v": [f(x) for x in slots.cache["v"]]})
  formats = with_kv(jax.tree.map(placed, slots), auto)
  in_shardings = (None,) * 4 + (formats,) + (None,) * (len(args) - 5)
  return jax.jit(fn, donate_argnums=donate, in_shardings=in_shardings, out_shardings=(formats, None)).lower(
      *args[:4], with_kv(slots, abstract), *args[5:]).compile()


def slot_shardings(slots: Slots, mesh) -> Slots:
  """Where the slots live on `mesh`: rows split over its batch axes (data x fsdp, where they
  divide the row count; `sharding.spec_for`), the cache's other axes as
  `sharding.cache_shardings` has them."""
  def rows(x):
    return NamedSharding(mesh, sharding.spec_for(("batch",) + (None,) * (x.ndim - 1), x.shape, mesh))
  cache = sharding.cache_shardings(slots.cache, mesh)
  cache["index"] = rows(slots.cache["index"])
  return jax.tree.map(rows, slots).replace(cache=cache)


def _on_mesh(slots: Slots, mesh) -> Slots:
  """`slots` constrained to `slot_shardings` inside a program (as they are without a mesh)."""
  return slots if mesh is None else lax.with_sharding_constraint(slots, slot_shardings(slots, mesh))


def _shrink(slots: Slots, order_s: jax.Array, mesh=None) -> Slots:
  """The slots `order_s` (a gather over every per-slot leaf), as a state of fewer rows."""
  return _on_mesh(jax.tree.map(lambda x: x[order_s] if x.ndim else x, slots), mesh)


def check_processes() -> None:
  """The engine's host loop drives one process (one line naming the key where there are more)."""
  if jax.process_count() > 1:
    raise UserError(f"sampling.continuous: runs in one process ({jax.process_count()} here); set it "
                    f"false for a run over several processes")


@dataclasses.dataclass
class Batch:
  """Prompts the engine takes at once: ids and mask [P, Tp] (left-padded to the call's Tp), the
  requests' keys [P * G] (request p * G + g) and length caps [P * G]."""

  ids_PxTp: np.ndarray
  mask_PxTp: np.ndarray
  keys_R: jax.Array
  caps_R: np.ndarray


def prefill_into(weights: DecodeWeights, ids_PxTp, mask_PxTp, offset, store=None, *, cfg, native: bool,
                 cache_dtype, rows: int, mesh=None):
  """The program that prefills P prompts into rows [offset, offset + P) of the prompt store
  (its caches, and the logits after each prompt's last token), a store of `rows` prompts
  (zeros when `store` is None; replicated on a mesh): (store, logits [rows, V]). Over the
  weights prepared once a call (`Sampler.prepared`), as the blocks."""
  with prepared_model(weights, native and cfg.packed_weights, mesh=mesh) as (model, logits_of, kernels):
    cache_P, logits_PxV = prefill(model, logits_of, ids_PxTp, mask_PxTp, cache_dtype, kernels)
  if store is None:
    store = (jax.tree.map(lambda x: jnp.zeros((rows,) + x.shape[1:], x.dtype) if x.ndim else x, cache_P),
             jnp.zeros((rows,) + logits_PxV.shape[1:], logits_PxV.dtype))
  def write(whole, part):
    return lax.dynamic_update_slice(whole, part, (offset,) + (0,) * (part.ndim - 1)) if part.ndim else whole
  store = jax.tree.map(write, store, (cache_P, logits_PxV))
  return store if mesh is None else lax.with_sharding_constraint(store, sharding.replicated(mesh))


def run(sampler, graphdef, state, g: int, max_new: int, eos_E: jax.Array,
        next_batch: Callable[[int], Batch | None], batches: int = 1,
        on_group: Callable[[int, np.ndarray, np.ndarray], bool] | None = None) -> SampleOutput:
  """The engine: the G requests of each prompt queued through `config.slots` slots.

  Batch 0 (`next_batch(0)`, P prompts) is queued at once. When the G requests of prompt q
  are all done, `on_group(q, tokens_GxN, mask_GxN)` says whether to queue one more prompt:
  the next one of the batches taken so far, else of batch `next_batch(b)`, b < `batches`
  (None: no more). Returns the outputs of the Q prompts queued, in queue order, as host
  arrays [Q, G, max_new] (`SampleOutput`).
  """
  cfg, pad, mesh = sampler.config, sampler.pad_id, sampler.mesh
  check_processes()
  first = next_batch(0)
  p, tp = first.ids_PxTp.shape
  s, k = cfg.slots, cfg.refill_every
  capacity = slot_capacity(cfg, tp, max_new)
  native = sampler.uses_cpu_kernels()
  cache_dtype = as_dtype(cfg.cache_dtype) if cfg.cache_dtype else None
  place = jnp.asarray if mesh is None else functools.partial(put, sharding=sharding.replicated(mesh))
  load_fn = functools.partial(prefill_into, cfg=cfg, native=native, cache_dtype=cache_dtype,
                              rows=p * batches, mesh=mesh)
  r_count = p * batches * g  # room for every request of the batches
  ids_QxTp = np.full((p * batches, tp), pad, np.int32)
  mask_QxTp = np.zeros((p * batches, tp), bool)
  keys_impl = jax.random.key_impl(first.keys_R)
  key_data_R = np.zeros((r_count,) + jax.random.key_data(first.keys_R).shape[1:], np.uint32)
  caps_R = np.zeros(r_count, np.int32)
  store = None

  def load(b: int, batch: Batch):
    nonlocal store
    rows = slice(b * p, (b + 1) * p)
    requests = slice(b * p * g, (b + 1) * p * g)
    ids_QxTp[rows], mask_QxTp[rows] = batch.ids_PxTp, batch.mask_PxTp
    key_data_R[requests] = np.asarray(jax.random.key_data(batch.keys_R))
    caps_R[requests] = batch.caps_R
    args = (weights, place(batch.ids_PxTp), place(batch.mask_PxTp), place(np.int32(b * p)))
    if store is not None:
      args += (store,)
    tag = f"prefill prompts={p} into={p * batches} prompt_len={tp}" + (" more" if store is not None else "")
    store = sampler.compiled(graphdef, tag, load_fn, args, donate=(4,) if store is not None else ())(*args)

  weights = sampler.prepared(graphdef, state)
  load(0, first)
  block_fn = functools.partial(run_block, cfg=cfg, native=native, k=k, capacity=capacity,
                               pad_id=pad, mesh=mesh)
  slots = empty_slots(nnx.merge(graphdef, state).cfg, s, capacity, cache_dtype, first.keys_R)
  if mesh is not None:
    slots = jax.device_put(slots, slot_shardings(slots, mesh))

  tokens_RxN = np.full((r_count, max_new), pad, np.int32)
  logp_RxN = np.zeros((r_count, max_new), np.float32)
  entropy_RxN = np.zeros((r_count, max_new), np.float32)
  lengths_R = np.zeros(r_count, np.int32)
  done_Q = np.zeros(p * batches, np.int32)  # requests of each prompt done
  queue = collections.deque(range(p * g))
  queued, loaded = p, 1  # prompts queued, batches taken
  more = on_group is not None  # whether a finished group may still queue a prompt
  owner = [-1] * s  # the request in each slot
  sampler.decode_row_steps = 0  # rows x decode steps run, for benchmarks
  sampler.live_prompts = []  # per block, [rows, k]: the prompt of each live decode step, else -1
  while True:
    rows = len(owner)
    busy = [i for i in range(rows) if owner[i] >= 0]
    while not queue and not more and rows > 1 and len(busy) <= rows // 2:  # the tail: fewer rows
      rows //= 2
      order = busy + [i for i in range(len(owner)) if owner[i] < 0][:rows - len(busy)]
      order_arg = place(np.asarray(order, np.int32))
      shrink = sampler.compiled(graphdef, f"shrink slots={len(owner)}->{rows} capacity={capacity}",
                                functools.partial(_shrink, mesh=mesh), (slots, order_arg))
      slots = shrink(sharding.fitted(slots, shrink.input_formats[0][0]), order_arg)
      owner = [owner[i] for i in order]
      busy = list(range(len(busy)))
    fill = np.zeros(rows, bool)
    prompt_s, key_idx, cap_s = np.zeros(rows, np.int32), np.zeros(rows, np.int32), np.zeros(rows, np.int32)
    for i in range(rows):
      if owner[i] < 0 and queue:
        r = queue.popleft()
        owner[i], fill[i], prompt_s[i], key_idx[i], cap_s[i] = r, True, r // g, r, caps_R[r]
    if all(o < 0 for o in owner):
      break
    keys_S = jax.random.wrap_key_data(place(key_data_R[key_idx]), impl=keys_impl)
    args = (weights, store[0], store[1], place(mask_QxTp.sum(axis=1, dtype=np.int32)), slots,
            place(fill), place(prompt_s), keys_S, place(cap_s), eos_E)
    tag = f"block slots={rows} tokens={k} prompts={p * batches} prompt_len={tp} capacity={capacity}"
    program = sampler.compiled(graphdef, tag, block_fn, args, donate=(4,), lower=lower_block)  # the slots
    slots, block = program(*args[:4], sharding.fitted(slots, program.input_formats[0][4]), *args[5:])
    sampler.decode_row_steps += rows * k
    out, t_S, done_S = jax.device_get((block, slots.t_S, slots.done_S))
    prompt_of = np.asarray([o // g if o >= 0 else -1 for o in owner])[:, None]
    sampler.live_prompts.append(np.where(out.live_Sxk[:, 1:], prompt_of, -1))
    finished = []
    for i in range(rows):
      r = owner[i]
      if r < 0:
        continue
      live = out.live_Sxk[i]
      n_live = int(live.sum())
      end = int(t_S[i])
      tokens_RxN[r, end - n_live:end] = out.tokens_Sxk[i][live]
      logp_RxN[r, end - n_live:end] = out.logp_Sxk[i][live]
      entropy_RxN[r, end - n_live:end] = out.entropy_Sxk[i][live]
      if done_S[i]:
        lengths_R[r], owner[i] = end, -1
        finished.append(r)
    for r in finished:
      q = r // g
      done_Q[q] += 1
      if done_Q[q] < g or on_group is None:
        continue
      group = slice(q * g, (q + 1) * g)
      if not on_group(q, tokens_RxN[group], np.arange(max_new)[None, :] < lengths_R[group, None]) or not more:
        continue
      if queued == loaded * p:  # every prompt taken is queued: the next batch
        batch = next_batch(loaded) if loaded < batches else None
        if batch is None:
          more = False
          continue
        load(loaded, batch)
        loaded += 1
      queue.extend(range(queued * g, (queued + 1) * g))
      queued += 1
  requests = queued * g
  shape = (queued, g, max_new)
  mask_RxN = np.arange(max_new)[None, :] < lengths_R[:requests, None]
  return SampleOutput(
      tokens=tokens_RxN[:requests].reshape(shape), mask=mask_RxN.reshape(shape),
      logp=logp_RxN[:requests].reshape(shape), entropy=entropy_RxN[:requests].reshape(shape),
      lengths=lengths_R[:requests].reshape(queued, g), prompt_ids=ids_QxTp[:queued],
      prompt_mask=mask_QxTp[:queued])


def generate(sampler, graphdef, state, ids_PxTp: np.ndarray, mask_PxTp: np.ndarray, g: int,
             keys_R: jax.Array, max_new: int, eos_E: jax.Array,
             stop_after_R: np.ndarray | None = None) -> SampleOutput:
  """The P x G requests (request r = p * G + g, key keys_R[r]) through `config.slots` slots;
  the same output as the static sampler's. `stop_after_R` caps each request's length."""
  caps_R = np.full(ids_PxTp.shape[0] * g, max_new, np.int32)
  if stop_after_R is not None:
    caps_R = np.minimum(caps_R, np.asarray(stop_after_R, np.int32).reshape(-1))
  batch = Batch(np.asarray(ids_PxTp, np.int32), np.asarray(mask_PxTp, bool), keys_R, caps_R)
  out = run(sampler, graphdef, state, g, max_new, eos_E, lambda b: batch)
  return jax.tree.map(jnp.asarray, out)


def sample_queue(sampler, model: tuple, g: int, next_prompts: Callable[[int], tuple | None],
                 on_group: Callable[[int, np.ndarray, np.ndarray], bool], batches: int, *,
                 prompt_len: int) -> SampleOutput:
  """`run` over batches of prompts refilled on demand: `next_prompts(b)` gives batch b's token
  lists and key (its requests' keys `request_keys(key, P, G)`, the static sampler's for that
  key), or None; prompts are left-padded to `prompt_len` slots; `model` is (graphdef, state)."""
  graphdef, state = model
  max_new, pad = sampler.config.max_new_tokens, sampler.pad_id

  def batch(b: int) -> Batch | None:
    got = next_prompts(b)
    if got is None:
      return None
    prompts, key = got
    if max(len(x) for x in prompts) > prompt_len:
      raise ValueError(f"a prompt of {max(len(x) for x in prompts)} tokens exceeds prompt_len {prompt_len}")
    ids, mask = left_pad(prompts, prompt_len, pad)
    return Batch(ids, mask, request_keys(key, len(prompts), g), np.full(len(prompts) * g, max_new, np.int32))

  return run(sampler, graphdef, state, g, max_new, sampler.stop_ids(), batch, batches, on_group)
