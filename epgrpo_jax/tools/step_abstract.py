"""The trainer's programs of one RL step, built as the trainer builds them but over abstract
arguments (`jax.ShapeDtypeStruct`s with their shardings on the mesh): compiled, not run.
`tools/compile_check.py` compiles them for a TPU slice from any host."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from epgrpo_jax.models import abstract_model, as_dtype, init_cache, param_rules, rope_table
from epgrpo_jax.parallel import sharding
from epgrpo_jax.rollout import continuous
from epgrpo_jax.rollout.decode import placements
from epgrpo_jax.rollout.sampling import Sampler, bucket, round_up, segment_ends
from epgrpo_jax.training.advantage_program import AdvantageProgram
from epgrpo_jax.training.batches import CompletionBatch, UpdateBatch
from epgrpo_jax.training.build import check_rows, step_programs, with_runtime_options
from epgrpo_jax.training.packing import pack_micro_batches
from epgrpo_jax.training.programs import Policy, StepFunctions, StepShardings


def abstract(tree, shardings):
  """`tree`'s leaves (arrays, numpy arrays or shape structs) as `ShapeDtypeStruct`s placed by
  the matching leaves of `shardings`, or all by one sharding."""
  leaf = lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s)
  if isinstance(shardings, jax.sharding.Sharding):
    return jax.tree.map(lambda x: leaf(x, shardings), tree)
  return jax.tree.map(leaf, tree, shardings)


def synthetic_rollout(rows: int, prompt_slots: int, prompt_tokens: int, completion_slots: int,
                      completion_tokens: int) -> CompletionBatch:
  """A host rollout of `rows` sequences: `prompt_tokens` real tokens left-padded to
  `prompt_slots`, `completion_tokens` real tokens right-padded to `completion_slots`, with the
  sampler's log-probs (the trainer always hands them on)."""
  prompt_mask = np.zeros((rows, prompt_slots), bool)
  prompt_mask[:, prompt_slots - prompt_tokens:] = True
  completion_mask = np.zeros((rows, completion_slots), bool)
  completion_mask[:, :completion_tokens] = True
  ones = lambda shape: np.ones(shape, np.int32)
  return CompletionBatch(ones((rows, prompt_slots)), prompt_mask, ones((rows, completion_slots)),
                 completion_mask, behaviour_logp=np.zeros((rows, completion_slots), np.float32))


@dataclasses.dataclass
class StepParts:
  """The policy split, shardings, step functions, advantage program and sampler of a run
  (`Trainer.__init__`'s objects), and abstract arguments for each program."""

  cfg: Any  # TrainConfig
  model_cfg: Any
  mesh: jax.sharding.Mesh
  policy: Policy  # abstract states
  shardings: StepShardings
  tx: Any  # optax.GradientTransformation
  fns: StepFunctions
  sampler: Sampler  # on `sampler_mesh`
  sampler_mesh: jax.sharding.Mesh  # the training mesh, or the sampler's own over its devices
  fused: bool
  prompt_slots: int
  prompt_tokens: int
  completion_tokens: int
  packing_length: int

  @classmethod
  def create(cls, cfg, model_cfg, mesh, prompt_tokens: int, completion_tokens: int,
             sampler_mesh: jax.sharding.Mesh | None = None) -> "StepParts":
    """`sampler_mesh`: a mesh of the same devices for the sampler's programs (its weights laid
    out by the same rules on it), or None: the training mesh, as the trainer samples today."""
    t = cfg.train
    check_rows(t, mesh)
    lora = None if cfg.model.full_finetune else cfg.lora
    model = abstract_model(model_cfg, lora, t.seed)
    model = with_runtime_options(model, cfg.model)
    policy = Policy.from_model(model, cfg.model.full_finetune)
    built = step_programs(cfg, policy, mesh, model_cfg=model.cfg)
    tx, fused, shardings = built.tx, built.fused, built.shardings
    of = lambda state, where: None if state is None else abstract(state, where)
    policy = dataclasses.replace(policy, trainable=of(policy.trainable, shardings.trainable),
                                 frozen=of(policy.frozen, shardings.frozen),
                                 reference=of(policy.reference, shardings.reference))
    sampler_mesh = mesh if sampler_mesh is None else sampler_mesh
    sampler = Sampler(cfg.sampling, eos_ids=model_cfg.eos_ids or (0,), pad_id=0, mesh=sampler_mesh)
    prompt_slots = bucket(prompt_tokens, cfg.sampling.prompt_buckets)
    packing_length = t.packing_length or prompt_tokens + cfg.sampling.max_new_tokens
    return cls(cfg, model_cfg, mesh, policy, shardings, tx, built.fns, sampler, sampler_mesh, fused,
               prompt_slots,
               prompt_tokens, completion_tokens, packing_length)

  # -- abstract arguments ------------------------------------------------------------------

  @property
  def trainable(self):
    return self.policy.trainable

  @property
  def frozen(self):
    return self.policy.frozen

  @functools.cached_property
  def opt_state(self):
    return abstract(jax.eval_shape(self.tx.init, self.trainable), self.shardings.opt_state)

  def rollout(self, rows: int, micro_batches: int = 1) -> CompletionBatch:
    """The abstract rollout of `rows` sequences as the trainer hands it to the programs: the
    completions cut to their length bucket, packed (per micro-batch) under train.packing."""
    t, s = self.cfg.train, self.cfg.sampling
    n = min(bucket(self.completion_tokens, s.length_buckets), bucket(s.max_new_tokens,
                                                                     s.length_buckets))
    host = synthetic_rollout(rows, self.prompt_slots, self.prompt_tokens, n,
                             self.completion_tokens)
    if t.packing:
      shards = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
      host = host.replace(packing=pack_micro_batches(
          host.prompt_ids, host.prompt_mask, host.completion, host.completion_mask,
          micro_batches=micro_batches, row_length=self.packing_length, multiple=shards))
    return abstract(host, self.shardings.rollout())

  @property
  def rows(self) -> int:
    return self.cfg.train.prompts_per_step * self.cfg.train.num_generations

  def floats(self, shape) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=self.shardings.rows)

  # -- programs ----------------------------------------------------------------------------

  def score_program(self):
    r = self.rollout(self.rows)
    p = self.fns.reference_program if self.cfg.train.reuse_sampler_logprobs else self.fns.score_program
    return p.lower(self.trainable, self.frozen, self.policy.reference, r).compile()

  def advantage_program(self):
    t = self.cfg.train
    shape = (t.prompts_per_step, t.num_generations)
    groups, program = AdvantageProgram(self.mesh).program(shape, self.cfg.advantage)
    n = self.rollout(self.rows).completion.shape[1]
    x = jax.ShapeDtypeStruct((*shape, n), jnp.float32, sharding=groups)
    args = (jax.ShapeDtypeStruct(shape, jnp.float32, sharding=groups), x, x, x,
            jax.ShapeDtypeStruct((*shape, n), jnp.bool_, sharding=groups))
    return program.lower(*args).compile()

  def update_programs(self) -> Iterator[tuple[str, Callable]]:
    """("name", compile) of the separate update's programs for one mini-batch: one program, or
    the gradient program (k micro-batches) and the optimizer step."""
    t = self.cfg.train
    k = t.grad_accumulation
    rollout = self.rollout(self.rows // t.mini_batches, micro_batches=k)
    n = rollout.completion.shape
    batch = UpdateBatch(rollout, self.floats(n), self.floats(n), self.floats(n))
    fns = self.fns
    if k == 1 and not fns.split_update:
      yield "(one program)", lambda: fns.update_program.lower(
          self.trainable, self.opt_state, self.frozen, batch).compile()
      return
    program = fns.gradients_program(k)
    yield f"gradients (k={k})", lambda: program.lower(self.trainable, self.frozen, batch).compile()
    yield "optimizer step", lambda: self._apply(program.lower(self.trainable, self.frozen, batch))

  def fused_programs(self) -> Iterator[tuple[str, Callable]]:
    """("name", compile) of the fused update: one program, or with remat its gradient program
    and the optimizer step."""
    t = self.cfg.train
    r = self.rollout(self.rows)
    rewards = jax.ShapeDtypeStruct((t.prompts_per_step, t.num_generations), jnp.float32,
                                   sharding=self.shardings.replicated)
    args = (self.frozen, self.policy.reference, r, rewards)
    fns = self.fns
    if not fns.split_update:
      yield "fused", lambda: fns.fused_program.lower(self.trainable, self.opt_state,
                                                      *args).compile()
      return
    yield "fused gradients", lambda: fns.fused_gradients_program.lower(
        self.trainable, *args).compile()
    yield "optimizer step", lambda: self._apply(
        fns.fused_gradients_program.lower(self.trainable, *args))

  def _apply(self, lowered_gradients):
    """The optimizer step compiled for the outputs of a lowered gradient program."""
    loss, aux, grads = jax.tree.map(
        lambda o: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=o.sharding),
        lowered_gradients.out_info)[:3]
    return self.fns.apply_program.lower(self.trainable, self.opt_state, loss, aux,
                                        grads).compile()

  # -- the sampler -------------------------------------------------------------------------

  @property
  def gen_len(self) -> int:
    return bucket(self.cfg.sampling.max_new_tokens, self.cfg.sampling.length_buckets)

  @functools.cached_property
  def sampler_state(self):
    """The policy's weights as they would be laid out on the sampler's mesh
    (`sharding.state_shardings`; on the training mesh, as they are): the read a decode step
    is set against."""
    state = nnx.merge_state(self.frozen, self.trainable)
    if self.sampler_mesh is self.mesh:
      return state
    rules = param_rules(self.model_cfg)
    return abstract(state, sharding.state_shardings(state, self.sampler_mesh, rules))

  @functools.cached_property
  def _weights_program(self):
    return self.sampler.compile(self.policy.graphdef, (nnx.merge_state(self.frozen, self.trainable),),
                                num_samples=self.cfg.train.num_generations, gen_len=self.gen_len,
                                prompt_len=self.prompt_slots, part="prepare")

  def weights_program(self):
    """The sampler's weights prepared once a sampling call (`Sampler.prepared`), compiled: from
    the policy's weights where the trainer holds them (the training mesh), laid out there;
    `Sampler.prepared` then moves them onto a sampler mesh of its own leaf by leaf."""
    return self._weights_program

  @property
  def sampler_weights(self):
    """The prepared weights (`decode.DecodeWeights`), abstract, where the sampler's other
    programs take them: on the sampler's mesh."""
    out = jax.tree.map(lambda o: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=o.sharding),
                       self._weights_program.out_info)
    if self.sampler_mesh is self.mesh:
      return out
    return abstract(out, placements(out, self.sampler_mesh))

  def _sampler_args(self, part: str):
    t = self.cfg.train
    p = t.prompts_per_step
    where = self.sampler.prompt_sharding((p, self.prompt_slots))
    rep = sharding.replicated(self.sampler_mesh)
    ids = jax.ShapeDtypeStruct((p, self.prompt_slots), jnp.int32, sharding=where)
    mask = jax.ShapeDtypeStruct((p, self.prompt_slots), jnp.bool_, sharding=where)
    key = jax.eval_shape(lambda: jax.random.key(0))
    key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=rep)
    eos = jax.ShapeDtypeStruct((len(self.sampler.eos_ids) or 1,), jnp.int32, sharding=rep)
    caps = jax.ShapeDtypeStruct((p * t.num_generations,), jnp.int32, sharding=rep)
    return (self.sampler_weights, ids, mask, key, caps, eos)

  def sampler_program(self, part: str):
    """The sampler's whole program ("sample") or its prefill ("prefill"), compiled."""
    return self.sampler.compile(self.policy.graphdef, self._sampler_args(part),
                                num_samples=self.cfg.train.num_generations, gen_len=self.gen_len,
                                prompt_len=self.prompt_slots, part=part)

  @property
  def block_steps(self) -> int:
    """Decode steps per block (`sampling.stop_check_every`): the decode loop's body."""
    return self.cfg.sampling.stop_check_every

  def decode_segments(self) -> list[tuple[int, int]]:
    """(cache slots, decode blocks run) of each decode segment, for completions of
    `completion_tokens` (every row runs to the longest): the sampler's loop runs whole blocks
    of `block_steps` steps while the step is below the segment's end and the longest cap."""
    k = self.block_steps
    out, step = [], 1  # the prefill draws the first token
    for end in segment_ends(round_up(self.gen_len, k), self.cfg.sampling.decode_segments, k):
      blocks = max(0, -(-(min(end, self.completion_tokens) - step) // k))
      out.append((self.prompt_slots + end, blocks))
      step += blocks * k
    return out

  @functools.cached_property
  def _prefill_loop(self):
    return self.sampler_program("prefill").out_info

  def decode_block_program(self, slots: int):
    """One block of `block_steps` decode steps over a cache of `slots` slots, compiled."""
    rep = sharding.replicated(self.sampler_mesh)
    loop, keys = jax.tree.map(lambda o: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=o.sharding),
                              self._prefill_loop)
    b = loop.last_B.shape[0]
    s = self.cfg.sampling
    cache_dtype = as_dtype(s.cache_dtype) if s.cache_dtype else None
    prompt = loop.cache.get("prompt")  # kept once per group (`sampling.shared_prompt_cache`)
    own = slots if prompt is None else slots - self.prompt_slots  # the rows' own slots
    cache = jax.eval_shape(lambda: init_cache(self.model_cfg, b, own, cache_dtype))
    cache = cache if prompt is None else {**cache, "prompt": prompt}
    loop = loop.replace(cache=abstract(cache, sharding.cache_shardings(cache, self.sampler_mesh)))
    n = round_up(self.gen_len, self.block_steps)
    rope = jax.eval_shape(lambda: rope_table(self.model_cfg, self.prompt_slots + n))
    *_, caps, eos = self._sampler_args("prefill")
    args = (self.sampler_weights, loop, keys, caps, eos, abstract(rope, (rep, rep)))
    return self.sampler.compile(self.policy.graphdef, args,
                                num_samples=self.cfg.train.num_generations, gen_len=self.gen_len,
                                prompt_len=self.prompt_slots, part="block")

  # -- the continuous engine (`sampling.continuous`) ----------------------------------------

  def _continuous(self, fn):
    s = self.cfg.sampling
    return functools.partial(fn, cfg=s, native=self.sampler.uses_cpu_kernels(), mesh=self.sampler_mesh)

  @functools.cached_property
  def _slot_prefill(self):
    t, s = self.cfg.train, self.cfg.sampling
    p, rep = t.prompts_per_step, sharding.replicated(self.sampler_mesh)
    cache_dtype = as_dtype(s.cache_dtype) if s.cache_dtype else None
    fn = self._continuous(functools.partial(continuous.prefill_into, cache_dtype=cache_dtype, rows=p))
    ids = jax.ShapeDtypeStruct((p, self.prompt_slots), jnp.int32, sharding=rep)
    mask = jax.ShapeDtypeStruct((p, self.prompt_slots), jnp.bool_, sharding=rep)
    offset = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)
    return jax.jit(fn).lower(self.sampler_weights, ids, mask, offset).compile()

  def slot_prefill_program(self):
    """The continuous engine's prefill of a batch of P prompts into its prompt store (one
    batch: no dynamic refill), over the prepared weights, compiled."""
    return self._slot_prefill

  @property
  def slot_capacity(self) -> int:
    return continuous.slot_capacity(self.cfg.sampling, self.prompt_slots, self.cfg.sampling.max_new_tokens)

  def slot_blocks(self) -> int:
    """Blocks the engine runs for P x G requests of `completion_tokens` each through
    `sampling.slots` slots (every slot busy, no tail): a request's first token comes with its
    insertion, the rest `refill_every` a block."""
    s = self.cfg.sampling
    waves = -(-self.rows // s.slots)
    return waves * -(-max(1, self.completion_tokens - 1) // s.refill_every)

  def slot_block_program(self):
    """One block of the continuous engine over all `sampling.slots` slots (insertion of the
    newcomers, then `refill_every` decode steps), compiled."""
    s = self.cfg.sampling
    rep = sharding.replicated(self.sampler_mesh)
    store, logits = jax.tree.map(lambda o: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=o.sharding),
                                 self._slot_prefill.out_info)
    cache_dtype = as_dtype(s.cache_dtype) if s.cache_dtype else None
    keys_R = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), self.rows))
    slots = jax.eval_shape(lambda k: continuous.empty_slots(self.model_cfg, s.slots, self.slot_capacity,
                                                              cache_dtype, k), keys_R)
    slots = abstract(slots, continuous.slot_shardings(slots, self.sampler_mesh))
    per_slot = lambda dtype: jax.ShapeDtypeStruct((s.slots,), dtype, sharding=rep)
    keys_S = jax.ShapeDtypeStruct((s.slots,), keys_R.dtype, sharding=rep)
    prompt_len_P = jax.ShapeDtypeStruct(logits.shape[:1], jnp.int32, sharding=rep)
    eos = self._sampler_args("prefill")[-1]
    fn = self._continuous(functools.partial(continuous.run_block, k=s.refill_every,
                                            capacity=self.slot_capacity, pad_id=0))
    args = (self.sampler_weights, store, logits, prompt_len_P, slots, per_slot(jnp.bool_),
            per_slot(jnp.int32), keys_S, per_slot(jnp.int32), eos)
    return continuous.lower_block(fn, args)  # as the engine: the slots donated, their cache's layout picked
