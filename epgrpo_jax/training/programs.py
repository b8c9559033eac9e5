"""The jitted device work of an RL step: scoring passes and the update.

Each function is pure over arrays and NNX states. `Policy` splits the model
once into a static graph, the trainable state (LoRA adapters, or every weight
for full fine-tuning), the frozen state, and, for full fine-tuning only, a
frozen copy of the initial weights as the reference.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from epgrpo_jax.core import advantages, losses
from epgrpo_jax.core import optim
from epgrpo_jax.parallel import sharding
from epgrpo_jax.parallel.distributed import place
from epgrpo_jax.parallel.platform import mesh_backend, mesh_platform, program_platform
from epgrpo_jax.io.errors import UserError
from epgrpo_jax.models import Qwen2, activation_constraint, one_device_program, rope_table
from epgrpo_jax.training.advantage_program import advantage_step
from epgrpo_jax.training.packing import Packing, check_layout


@struct.dataclass
class Rollout:
  """Flattened rows (B = prompts x samples) of prompts and sampled completions; with
  `packing`, the forward passes run over its packed rows instead (`training/packing.py`).
  `behaviour_logp`, the sampler's log-probs of the completions, gives the loss its mismatch
  metrics and `loss.rollout_correction` its behaviour policy (`losses.policy_loss`)."""

  prompt_ids: jax.Array  # [B, Tp] int32, left-padded
  prompt_mask: jax.Array  # [B, Tp] bool
  completion: jax.Array  # [B, N] int32
  completion_mask: jax.Array  # [B, N] bool
  packing: Packing | None = None
  behaviour_logp: jax.Array | None = None  # [B, N] float32


@struct.dataclass
class UpdateBatch:
  rollout: Rollout
  logp_old: jax.Array  # [B, N]
  logp_ref: jax.Array  # [B, N]
  advantage: jax.Array  # [B, N]


@dataclasses.dataclass(frozen=True)
class Policy:
  """The model split for jitted functions: graph, trainable, frozen, reference."""

  graphdef: Any
  trainable: nnx.State
  frozen: nnx.State
  reference: nnx.State | None  # full fine-tuning only; LoRA switches adapters off instead

  @classmethod
  def from_model(cls, model: Qwen2, full_finetune: bool) -> "Policy":
    if full_finetune:
      graphdef, trainable, frozen = nnx.split(model, nnx.Param, ...)
      # Abstract weights (a compile check's ShapeDtypeStructs) stand for their copy as they are.
      copy = lambda x: x if isinstance(x, jax.ShapeDtypeStruct) else jnp.copy(x)
      reference = jax.tree.map(copy, trainable)
    else:
      if model.lora is None:
        raise UserError("lora: the model has no adapters; set model.full_finetune=true or "
                         "configure lora")
      graphdef, trainable, frozen = nnx.split(model, nnx.LoRAParam, ...)
      reference = None
    return cls(graphdef, trainable, frozen, reference)

  def model(self) -> Qwen2:
    return nnx.merge(self.graphdef, self.frozen, self.trainable)


def completion_logprobs(model: Qwen2, rollout: Rollout, *, temperature: float,
                        adapters: bool = True, token_chunk: int = 1024,
                        vocab_chunk: int = 8192) -> tuple[jax.Array, jax.Array]:
  """Per-token log-prob and entropy of each completion under `model` ([B, N] float32).

  One forward over prompt + completion (minus its last token); the hidden state
  before each completion token predicts it, at `temperature` as sampled. With
  `rollout.packing`, the forward runs over the packed rows, and each token's values return to
  the [B, N] layout (0 where the completion mask is false).
  """
  kw = dict(temperature=temperature, token_chunk=token_chunk, vocab_chunk=vocab_chunk)
  # Positions stay below the row length. Looked up in a table (a constant), the rotary cos and
  # sin are not computed afresh: XLA:CPU fuses them into each consumer, once per head and layer.
  if rollout.packing is not None:
    p = rollout.packing
    hidden_RxLxD, _ = model(p.tokens, p.positions, p.segments > 0, adapters=adapters,
                            segments_BxT=p.segments,
                            rope_table=rope_table(model.cfg, p.tokens.shape[1]))
    per_slot = losses.token_logprob_entropy(hidden_RxLxD, model.head_DxV(), p.targets, **kw)
    mask_BxN = rollout.completion_mask
    return tuple(jnp.where(mask_BxN, x_RxL.reshape(-1)[p.index], 0.0) for x_RxL in per_slot)
  tp = rollout.prompt_ids.shape[1]
  tokens_BxL = jnp.concatenate([rollout.prompt_ids, rollout.completion], axis=1)[:, :-1]
  mask_BxL = jnp.concatenate([rollout.prompt_mask, rollout.completion_mask], axis=1)[:, :-1]
  positions_BxL = jnp.maximum(jnp.cumsum(mask_BxL, axis=1) - 1, 0)
  hidden_BxLxD, _ = model(tokens_BxL, positions_BxL, mask_BxL, adapters=adapters,
                          rope_table=rope_table(model.cfg, tokens_BxL.shape[1]))
  hidden_BxNxD = hidden_BxLxD[:, tp - 1:]
  return losses.token_logprob_entropy(hidden_BxNxD, model.head_DxV(), rollout.completion, **kw)


def reference_logprobs(graphdef, trainable: nnx.State, frozen: nnx.State,
                       reference: nnx.State | None, rollout: Rollout, *,
                       temperature: float) -> jax.Array:
  """The reference pass: log-probs under pi_ref (LoRA: the policy with adapters off)."""
  if reference is None:
    model = nnx.merge(graphdef, frozen, trainable)
    return completion_logprobs(model, rollout, temperature=temperature, adapters=False)[0]
  ref_model = nnx.merge(graphdef, frozen, reference)
  return completion_logprobs(ref_model, rollout, temperature=temperature)[0]


def score(graphdef, trainable: nnx.State, frozen: nnx.State, reference: nnx.State | None,
          rollout: Rollout, *, temperature: float) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The scoring pass (old log-probs, entropies) and the reference pass, in one program."""
  model = nnx.merge(graphdef, frozen, trainable)
  logp_old, entropy = completion_logprobs(model, rollout, temperature=temperature)
  logp_ref = reference_logprobs(graphdef, trainable, frozen, reference, rollout,
                                temperature=temperature)
  return logp_old, entropy, logp_ref


def make_optimizer(learning_rate: float, total_updates: int, *, warmup_ratio: float,
                   weight_decay: float, max_grad_norm: float, b1: float = 0.9,
                   b2: float = 0.999, eps: float = 1e-8) -> tuple[optax.GradientTransformation, Any]:
  """AdamW with linear warm-up over `warmup_ratio` of the updates, then linear decay to 0."""
  schedule = optim.make_schedule(learning_rate, total_updates, warmup_ratio=warmup_ratio)
  return optim.make_optimizer(schedule, weight_decay=weight_decay, max_grad_norm=max_grad_norm,
                              b1=b1, b2=b2, eps=eps), schedule


def gradients(graphdef, trainable: nnx.State, frozen: nnx.State, batch: UpdateBatch, *,
              loss_cfg: losses.LossConfig, temperature: float, on_policy: bool):
  """(loss, aux metrics, gradients) of the clipped-surrogate loss w.r.t. `trainable`.

  `on_policy`: the first and only update on this rollout, so pi_old = pi_theta and
  the ratio is exactly 1 (`logp_old` is the stop-gradient of the new log-probs).
  """
  def terms(logp, entropy):
    return logp if on_policy else batch.logp_old, batch.logp_ref, batch.advantage, None

  loss, aux, grads, _ = policy_gradients(graphdef, trainable, frozen, batch.rollout, terms,
                                         loss_cfg=loss_cfg, temperature=temperature)
  return loss, aux, grads


def policy_gradients(graphdef, trainable: nnx.State, frozen: nnx.State, rollout: Rollout,
                     terms: Callable, *, loss_cfg: losses.LossConfig, temperature: float):
  """(loss, aux, gradients, extra) of `losses.policy_loss` on the policy's forward pass.

  `terms(logp_BxN, entropy_BxN)`, given that forward's log-probs and entropies under
  stop-gradient, returns (logp_old, logp_ref, advantage [B, N], extra): the loss's other
  inputs, and whatever else the caller wants back from inside the differentiated function.
  """
  def loss_fn(tr):
    model = nnx.merge(graphdef, frozen, tr)
    logp, entropy = completion_logprobs(model, rollout, temperature=temperature)
    logp_old, logp_ref, advantage, extra = terms(*jax.lax.stop_gradient((logp, entropy)))
    loss, aux = losses.policy_loss(logp, logp_old, logp_ref, advantage,
                                   rollout.completion_mask, loss_cfg, entropy_BxT=entropy,
                                   logp_behaviour_BxT=rollout.behaviour_logp)
    return loss, (aux, extra)

  (loss, (aux, extra)), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
  return loss, aux, grads, extra


def apply_gradients(tx: optax.GradientTransformation, trainable: nnx.State, opt_state: Any,
                    loss: jax.Array, aux: dict, grads: nnx.State):
  """The optimizer step; skipped (states unchanged) if the loss or a gradient is not finite."""
  grad_norm = optax.tree.norm(grads)
  # Not optax.apply_if_finite: it checks only the gradients (a non-finite loss must skip too), and
  # it applies a non-finite update after max_consecutive_errors, where the trainer stops the run.
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  updates, new_opt_state = tx.update(grads, opt_state, trainable)
  new_trainable = optax.apply_updates(trainable, updates)
  keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
  new_trainable = keep(new_trainable, trainable)
  new_opt_state = keep(new_opt_state, opt_state)
  metrics = dict(aux, loss=loss, grad_norm=grad_norm, skipped=(~finite).astype(jnp.float32))
  return new_trainable, new_opt_state, metrics


def update(graphdef, tx: optax.GradientTransformation, trainable: nnx.State, opt_state: Any,
           frozen: nnx.State, batch: UpdateBatch, *, loss_cfg: losses.LossConfig,
           temperature: float, on_policy: bool):
  """One optimizer update with the clipped-surrogate loss: `gradients`, then `apply_gradients`."""
  loss, aux, grads = gradients(graphdef, trainable, frozen, batch, loss_cfg=loss_cfg,
                               temperature=temperature, on_policy=on_policy)
  return apply_gradients(tx, trainable, opt_state, loss, aux, grads)


@struct.dataclass
class Scored:
  """What the fused update computes on its way to the loss: the scoring pass (old log-probs,
  entropies), the reference log-probs and the token-level advantage with its parts and
  `ep/*` diagnostics; the same values the separate scoring and advantage programs give."""

  logp_old: jax.Array  # [B, N]
  entropy: jax.Array  # [B, N]
  logp_ref: jax.Array  # [B, N]
  advantage: jax.Array  # [P, G, N]
  components: Any  # advantages.Components
  adv_metrics: dict[str, jax.Array]


def fused_gradients(graphdef, trainable: nnx.State, frozen: nnx.State,
                    reference: nnx.State | None, rollout: Rollout, rewards_PxG: jax.Array, *,
                    loss_cfg: losses.LossConfig, adv_cfg: advantages.AdvantageConfig,
                    temperature: float):
  """(loss, aux, gradients, Scored) of one on-policy update from the rollout and its rewards.

  The policy's forward pass is the one the loss differentiates: its log-probs and entropies
  (under stop-gradient) are the scoring pass, so no separate scoring forward runs. The
  reference log-probs (no gradient) and the advantage (`advantage_step`, stop-gradient) come
  from the same program. On-policy, pi_old = pi_theta and the ratio is exactly 1.
  """
  P, G = rewards_PxG.shape
  mask_BxN = rollout.completion_mask
  logp_ref = jax.lax.stop_gradient(reference_logprobs(
      graphdef, trainable, frozen, reference, rollout, temperature=temperature))
  to_groups = lambda x: x.reshape(P, G, -1)
  same = policy_is_reference(trainable, reference)

  def terms(logp_old, entropy_old):
    # While the policy is its reference (every LoRA B zero, or full fine-tuning's weights
    # unchanged: the first step), its log-probs are the reference's by definition. Computed
    # apart, the differentiated forward and the plain reference forward round differently
    # (1e-7), and the bucket z-scores would blow that noise up into a progress signal.
    logp_ref_used = jnp.where(same, logp_old, logp_ref)
    adv, comps, adv_metrics = advantage_step(
        rewards_PxG, to_groups(entropy_old), to_groups(logp_old), to_groups(logp_ref_used),
        to_groups(mask_BxN), cfg=adv_cfg)
    scored = Scored(logp_old, entropy_old, logp_ref_used, adv, comps, adv_metrics)
    return logp_old, logp_ref_used, adv.reshape(P * G, -1), scored

  return policy_gradients(graphdef, trainable, frozen, rollout, terms, loss_cfg=loss_cfg,
                          temperature=temperature)


def policy_is_reference(trainable: nnx.State, reference: nnx.State | None) -> jax.Array:
  """bool []: the policy equals its reference (LoRA: every B is zero; full fine-tuning: the
  trainable weights equal the reference copy)."""
  if reference is not None:
    same = jax.tree.map(lambda a, b: jnp.all(a == b), trainable, reference)
    return jnp.all(jnp.stack(jax.tree.leaves(same)))
  flat = jax.tree_util.tree_flatten_with_path(trainable)[0]
  b = [jnp.all(x == 0) for path, x in flat
       if "lora_b" in (getattr(k, "key", getattr(k, "name", None)) for k in path)]
  return jnp.all(jnp.stack(b))


def fused_update(graphdef, tx: optax.GradientTransformation, trainable: nnx.State,
                 opt_state: Any, frozen: nnx.State, reference: nnx.State | None,
                 rollout: Rollout, rewards_PxG: jax.Array, *, loss_cfg: losses.LossConfig,
                 adv_cfg: advantages.AdvantageConfig, temperature: float):
  """`fused_gradients`, then `apply_gradients`: (trainable, opt_state, metrics, Scored)."""
  loss, aux, grads, scored = fused_gradients(graphdef, trainable, frozen, reference, rollout,
                                             rewards_PxG, loss_cfg=loss_cfg, adv_cfg=adv_cfg,
                                             temperature=temperature)
  return (*apply_gradients(tx, trainable, opt_state, loss, aux, grads), scored)


def split_rows(batch: UpdateBatch, parts: int) -> list[UpdateBatch]:
  """`parts` equal consecutive row slices of the batch."""
  if parts == 1:
    return [batch]
  size = batch.advantage.shape[0] // parts
  return [jax.tree.map(lambda x: x[i * size:(i + 1) * size], batch) for i in range(parts)]


def accumulated_gradients(graphdef, trainable: nnx.State, frozen: nnx.State, batch: UpdateBatch,
                          *, micro_batches: int, loss_cfg: losses.LossConfig, temperature: float,
                          on_policy: bool):
  """(loss, aux, grads) of `batch` computed as `micro_batches` row slices in turn (gradient
  accumulation): equal to one pass over the batch, with a k-th of its activation memory.

  The gradients are one running sum in a `lax.scan` (memory of one gradient, whatever k). Each
  slice's loss is its numerator over its own denominator (`losses.policy_loss`), so weighting
  by the denominators gives exactly the full batch's loss and gradients. Slice i takes rows
  i, i + k, ...: on a mesh each device keeps its own rows.
  """
  grad_fn = functools.partial(gradients, graphdef, loss_cfg=loss_cfg, temperature=temperature,
                              on_policy=on_policy)
  if micro_batches == 1:
    return grad_fn(trainable, frozen, batch)
  k = micro_batches
  slices = jax.tree.map(lambda x: x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1),
                        batch)

  def body(carry, micro):
    loss_sum, grads_sum = carry
    loss, aux, grads = grad_fn(trainable, frozen, micro)
    den = aux["loss_denominator"]
    grads_sum = jax.tree.map(lambda s, g: s + (den * g).astype(s.dtype), grads_sum, grads)
    return (loss_sum + den * loss, grads_sum), aux

  zeros = jax.tree.map(jnp.zeros_like, trainable)
  (loss_sum, grads_sum), aux_K = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros), slices)
  total = jnp.maximum(jnp.sum(aux_K["loss_denominator"]), 1e-8)
  grads = jax.tree.map(lambda s: (s / total).astype(s.dtype), grads_sum)
  return loss_sum / total, combine_metrics(aux_K), grads


def combine_metrics(aux_K: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """One update's metrics from those of its k micro-batches (each [k]): sums for the counts,
  min/max for the extremes, the pooled std for `advantage/std`, token-weighted means for the
  rest."""
  tokens = aux_K["num_tokens"]
  weight = tokens / jnp.maximum(jnp.sum(tokens), 1e-8)
  mean = lambda k: jnp.sum(weight * aux_K[k])
  aux = {}
  for k, v in aux_K.items():
    if k in ("loss_numerator", "loss_denominator", "num_tokens"):
      aux[k] = jnp.sum(v)
    elif k.endswith("/min"):
      aux[k] = jnp.min(v)
    elif k.endswith("/max"):
      aux[k] = jnp.max(v)
    elif k == "advantage/std":
      second = jnp.sum(weight * (v ** 2 + aux_K["advantage/mean"] ** 2))
      aux[k] = jnp.sqrt(jnp.maximum(second - mean("advantage/mean") ** 2, 0.0))
    else:
      aux[k] = mean(k)
  return aux


@dataclasses.dataclass(frozen=True)
class StepShardings:
  """Where the arguments and results of the step programs live on a mesh.

  States follow `sharding.state_shardings` (optimizer moments like their
  parameters); per-sequence arrays [B, ...] and packed rows [R, L] are split over data x
  fsdp.
  """

  mesh: jax.sharding.Mesh
  trainable: Any
  frozen: Any
  reference: Any
  opt_state: Any

  @classmethod
  def create(cls, policy: Policy, tx: optax.GradientTransformation,
             mesh: jax.sharding.Mesh) -> "StepShardings":
    of = lambda state: None if state is None else sharding.state_shardings(state, mesh)
    return cls(mesh, of(policy.trainable), of(policy.frozen), of(policy.reference),
               of(jax.eval_shape(tx.init, policy.trainable)))

  @property
  def rows(self) -> jax.sharding.NamedSharding:
    return sharding.batch_sharding(self.mesh, 2)

  @property
  def replicated(self) -> jax.sharding.NamedSharding:
    return sharding.replicated(self.mesh)

  def rollout(self) -> jax.sharding.NamedSharding:
    """Every leaf of a `Rollout` is [B, ...] or packed rows [R, L]: one sharding, a prefix of
    the rollout whatever its optional parts (packing, behaviour log-probs)."""
    return self.rows

  def update_batch(self) -> jax.sharding.NamedSharding:
    """An `UpdateBatch` is its rollout and [B, N] arrays: the same one sharding."""
    return self.rows

  def place_policy(self, policy: Policy) -> Policy:
    return dataclasses.replace(policy, trainable=place(policy.trainable, self.trainable),
                               frozen=place(policy.frozen, self.frozen),
                               reference=place(policy.reference, self.reference))


def _constrained(fn, mesh: jax.sharding.Mesh):
  """`fn` traced with the model's hidden states kept batch-sharded over data x fsdp, and
  knowing whether it runs on one device (`one_device_program`) and on which platform
  (`program_platform`: the mesh's devices, which a compile check names apart from this host's)."""
  constrain = sharding.activation_constraints(mesh)

  @functools.wraps(fn)
  def wrapped(*args):
    with (activation_constraint(constrain), one_device_program(mesh.size == 1),
          program_platform(mesh_platform(mesh))):
      return fn(*args)
  return wrapped


class StepFunctions:
  """The jitted score, reference-only and update programs of a run (compiled once per shape).

  `reference` runs when the sampler's log-probs and entropies stand in for the
  scoring pass (`train.reuse_sampler_logprobs`).

  Only the graph definition and configuration are closed over; every array
  (trainable, frozen, reference, batch) is an argument, and the update donates
  the trainable and optimizer states. With `shardings`, the programs have
  explicit in/out shardings (arguments are moved there first when they are
  elsewhere) and constrain the model's activations to the batch sharding.

  `update(..., micro_batches=k)` accumulates: `accumulated_gradients` over k row
  slices (one program per k), then one `apply_gradients` (the same update as
  one pass over the batch, with a k-th of the activation memory).

  With `remat`, the update also runs as the two programs `gradients` then
  `apply_gradients`. In one program, every new weight depends on the global
  gradient norm (clipping, the non-finite skip), and XLA:CPU then kept each
  layer's recomputed activations live at once, as if there were no remat: the
  compiled temporaries grew with depth (`tests/test_model.py`). On CPU the
  gradient program is also compiled with XLA's memory-optimised scheduler and without
  CSE (`cpu_remat_options`).

  With `adv_cfg`, `fused_update` runs an on-policy step's scoring, reference pass,
  advantage and update as one program (`fused_update`; with remat, `fused_gradients`
  then `apply_gradients`).
  """

  def __init__(self, graphdef, tx: optax.GradientTransformation, *,
               loss_cfg: losses.LossConfig, temperature: float, on_policy: bool,
               shardings: StepShardings | None = None, remat: bool = False,
               adv_cfg: advantages.AdvantageConfig | None = None):
    on_cpu = mesh_backend(shardings.mesh if shardings else None) == "cpu"
    cpu_memory = cpu_remat_options() if remat and on_cpu else None
    score_fn = functools.partial(score, graphdef, temperature=temperature)
    reference_fn = functools.partial(reference_logprobs, graphdef, temperature=temperature)
    self._grads_fn = functools.partial(accumulated_gradients, graphdef, loss_cfg=loss_cfg,
                                       temperature=temperature, on_policy=on_policy)
    apply_fn = functools.partial(apply_gradients, tx)
    update_fn = functools.partial(update, graphdef, tx, loss_cfg=loss_cfg,
                                  temperature=temperature, on_policy=on_policy)
    self.shardings = shardings
    self.split_update = remat
    s = shardings
    # Where each named argument lives (built once: `_placed` runs at every call).
    self._where = None if s is None else {
        "trainable": s.trainable, "opt_state": s.opt_state, "frozen": s.frozen,
        "reference": s.reference, "rollout": s.rollout(), "batch": s.update_batch(),
        "rewards": s.replicated}
    jit = functools.partial(_jit, mesh=s.mesh if s else None)
    scored = (s.trainable, s.frozen, s.reference, s.rollout()) if s else None
    self.score_program = jit(score_fn, scored, (s.rows, s.rows, s.rows) if s else None)
    self.reference_program = jit(reference_fn, scored, s.rows if s else None)
    self._jit, self._cpu_memory = jit, cpu_memory
    self._gradients_programs: dict[int, Any] = {}
    self.apply_program = jit(
        apply_fn, (s.trainable, s.opt_state, s.replicated, s.replicated, s.trainable) if s else None,
        (s.trainable, s.opt_state, s.replicated) if s else None, donate_argnums=(0, 1))
    self.update_program = jit(
        update_fn, (s.trainable, s.opt_state, s.frozen, s.update_batch()) if s else None,
        (s.trainable, s.opt_state, s.replicated) if s else None, donate_argnums=(0, 1))
    self.fused_program = self.fused_gradients_program = None
    if adv_cfg is not None:
      fused_kw = dict(loss_cfg=loss_cfg, adv_cfg=adv_cfg, temperature=temperature)
      scored = Scored(*(s.rows,) * 3, *(s.replicated,) * 3) if s else None
      fused_in = (s.trainable, s.frozen, s.reference, s.rollout(), s.replicated) if s else None
      self.fused_program = jit(
          functools.partial(fused_update, graphdef, tx, **fused_kw),
          (s.trainable, s.opt_state, *fused_in[1:]) if s else None,
          (s.trainable, s.opt_state, s.replicated, scored) if s else None, donate_argnums=(0, 1))
      self.fused_gradients_program = jit(
          functools.partial(fused_gradients, graphdef, **fused_kw), fused_in,
          (s.replicated, s.replicated, s.trainable, scored) if s else None,
          compiler_options=cpu_memory)

  def gradients_program(self, micro_batches: int = 1):
    """The jitted `accumulated_gradients` for `micro_batches` slices (compiled on first call)."""
    if micro_batches not in self._gradients_programs:
      s = self.shardings
      self._gradients_programs[micro_batches] = self._jit(
          functools.partial(self._grads_fn, micro_batches=micro_batches),
          (s.trainable, s.frozen, s.update_batch()) if s else None,
          (s.replicated, s.replicated, s.trainable) if s else None,
          compiler_options=self._cpu_memory)
    return self._gradients_programs[micro_batches]

  def _placed(self, **args):
    """The arguments on their declared shardings (as given without a mesh)."""
    if self._where is None:
      return args
    return {k: place(v, self._where[k]) for k, v in args.items()}

  def score(self, trainable, frozen, reference, rollout):
    """(old log-probs, entropies, reference log-probs), each [B, N]."""
    return self.score_program(*self._placed(trainable=trainable, frozen=frozen,
                                            reference=reference, rollout=rollout).values())

  def reference(self, trainable, frozen, reference, rollout):
    """Reference log-probs [B, N]."""
    return self.reference_program(*self._placed(trainable=trainable, frozen=frozen,
                                                reference=reference, rollout=rollout).values())

  def update(self, trainable, opt_state, frozen, batch, micro_batches: int = 1):
    """(new trainable, new optimizer state, metrics); donates the trainable and optimizer state.

    `micro_batches` > 1 accumulates the gradients of that many row slices of `batch`."""
    a = self._placed(trainable=trainable, opt_state=opt_state, frozen=frozen)
    if micro_batches == 1 and not self.split_update:
      return self.update_program(a["trainable"], a["opt_state"], a["frozen"],
                                 self._placed(batch=batch)["batch"])
    loss, aux, grads = self.gradients(a["trainable"], a["frozen"], batch, micro_batches)
    return self.apply_program(a["trainable"], a["opt_state"], loss, aux, grads)

  def fused_update(self, trainable, opt_state, frozen, reference, rollout, rewards_PxG):
    """(new trainable, new optimizer state, metrics, Scored) of one on-policy update that
    scores, computes the advantage and updates in one program; donates the trainable and
    optimizer state."""
    a = self._placed(trainable=trainable, opt_state=opt_state, frozen=frozen,
                     reference=reference, rollout=rollout, rewards=rewards_PxG)
    if not self.split_update:
      return self.fused_program(*a.values())
    loss, aux, grads, scored = self.fused_gradients_program(
        a["trainable"], a["frozen"], a["reference"], a["rollout"], a["rewards"])
    return (*self.apply_program(a["trainable"], a["opt_state"], loss, aux, grads), scored)

  def gradients(self, trainable, frozen, batch, micro_batches: int = 1):
    """(loss, aux metrics, gradients) of the loss on `batch`, without an optimizer step.

    A packed `batch` with `micro_batches` > 1 must have `pack_micro_batches`' layout."""
    r = batch.rollout
    if micro_batches > 1 and r.packing is not None and all(
        getattr(x, "is_fully_addressable", True) for x in jax.tree.leaves(r)):
      check_layout(r.packing, r.completion, r.completion_mask, micro_batches)
    a = self._placed(trainable=trainable, frozen=frozen, batch=batch)
    return self.gradients_program(micro_batches)(a["trainable"], a["frozen"], a["batch"])

  def update_memory(self, trainable, opt_state, frozen, batch, micro_batches: int = 1
                    ) -> list[Any]:
    """XLA's `memory_analysis()` of each compiled program of the update, for these (possibly
    abstract) arguments: one program, or the gradient and apply programs with remat or
    gradient accumulation."""
    if micro_batches == 1 and not self.split_update:
      return [self.update_program.lower(trainable, opt_state, frozen, batch)
              .compile().memory_analysis()]
    program = self.gradients_program(micro_batches)
    loss, aux, grads = jax.eval_shape(program, trainable, frozen, batch)
    return [program.lower(trainable, frozen, batch).compile().memory_analysis(),
            self.apply_program.lower(trainable, opt_state, loss, aux, grads)
            .compile().memory_analysis()]


def cpu_remat_options() -> dict[str, str]:
  """XLA:CPU options for a rematerialised gradient program: the memory-optimised scheduler,
  and no common-subexpression elimination.

  XLA:CPU removes optimization barriers before layout assignment and runs CSE again after
  it, so the backward pass's recomputation (`models.recompute_in_backward`) is merged with
  the forward's identical values, which then stay live from the forward to the backward:
  each layer's float32 copy of its input, and a layer's recomputed MLP outputs and
  attention score blocks. The GPU compiler removes the barriers only after scheduling (TPU:
  not checked).
  Without CSE, the 3B update of `benchmarks/memory_fsdp.py` needs 22.3 GiB per device
  instead of 41.4 (docs/distributed.md).
  """
  return {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED",
          "xla_disable_hlo_passes": "cse"}


def _jit(fn, in_shardings, out_shardings, *, mesh, **kw):
  """`jax.jit`, with explicit shardings and activation constraints when there is a mesh."""
  if mesh is None:
    return jax.jit(fn, **kw)
  return jax.jit(_constrained(fn, mesh), in_shardings=in_shardings, out_shardings=out_shardings,
                 **kw)
