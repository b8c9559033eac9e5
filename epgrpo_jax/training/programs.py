"""The jitted device work of an RL step: the programs, their shardings and compile options.

`Policy` splits the model once into a static graph, the trainable state (LoRA adapters, or
every weight for full fine-tuning), the frozen state, and, for full fine-tuning only, a frozen
copy of the initial weights as the reference. `StepFunctions` jits the pure functions of
`objective` over them, with explicit shardings on a mesh (`StepShardings`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from epgrpo_jax.core import advantages, losses
from epgrpo_jax.parallel import sharding
from epgrpo_jax.parallel.distributed import place
from epgrpo_jax.io.errors import UserError
from epgrpo_jax.kernels import seam
from epgrpo_jax.models import CausalLM, ModelConfig, param_rules
from epgrpo_jax.training.batches import Scored
from epgrpo_jax.training.objective import (accumulated_gradients, apply_gradients, fused_gradients,
                                           fused_update, reference_logprobs, score, update)
from epgrpo_jax.training.packing import check_layout


@dataclasses.dataclass(frozen=True)
class Policy:
  """The model split for jitted functions: graph, trainable, frozen, reference."""

  graphdef: Any
  trainable: nnx.State
  frozen: nnx.State
  reference: nnx.State | None  # full fine-tuning only; LoRA switches adapters off instead

  @classmethod
  def from_model(cls, model: CausalLM, full_finetune: bool) -> "Policy":
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

  def model(self) -> CausalLM:
    return nnx.merge(self.graphdef, self.frozen, self.trainable)


@dataclasses.dataclass(frozen=True)
class StepShardings:
  """Where the arguments and results of the step programs live on a mesh.

  States follow `sharding.state_shardings` by the model family's rules (optimizer moments
  like their parameters); per-sequence arrays [B, ...] and packed rows [R, L] are split over data x
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
    rules = param_rules(policy.model().cfg)
    of = lambda state: None if state is None else sharding.state_shardings(state, mesh, rules)
    return cls(mesh, of(policy.trainable), of(policy.frozen), of(policy.reference),
               of(jax.eval_shape(tx.init, policy.trainable)))

  @property
  def rows(self) -> jax.sharding.NamedSharding:
    return sharding.batch_sharding(self.mesh, 2)

  @property
  def replicated(self) -> jax.sharding.NamedSharding:
    return sharding.replicated(self.mesh)

  def rollout(self) -> jax.sharding.NamedSharding:
    """Every leaf of a `CompletionBatch` is [B, ...] or packed rows [R, L]: one sharding, a prefix of
    the rollout whatever its optional parts (packing, behaviour log-probs)."""
    return self.rows

  def update_batch(self) -> jax.sharding.NamedSharding:
    """An `UpdateBatch` is its rollout and [B, N] arrays: the same one sharding."""
    return self.rows

  def place_policy(self, policy: Policy) -> Policy:
    return dataclasses.replace(policy, trainable=place(policy.trainable, self.trainable),
                               frozen=place(policy.frozen, self.frozen),
                               reference=place(policy.reference, self.reference))


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
  CSE (`cpu_remat_options`); on TPU with FSDP, without windowed einsums (`tpu_fsdp_options`),
  as are the score and reference programs (`scoring_options`).

  With `adv_cfg`, `fused_update` runs an on-policy step's scoring, reference pass,
  advantage and update as one program (`fused_update`; with remat, `fused_gradients`
  then `apply_gradients`).
  """

  def __init__(self, graphdef, tx: optax.GradientTransformation, *,
               loss_cfg: losses.LossConfig, temperature: float, on_policy: bool,
               model_cfg: ModelConfig, shardings: StepShardings | None = None, remat: bool = False,
               adv_cfg: advantages.AdvantageConfig | None = None):
    mesh = shardings.mesh if shardings else None
    kernels = seam.choose(model_cfg, mesh, constrain=True)  # once for every program here
    fsdp = mesh.shape.get("fsdp", 1) if mesh else 1
    backend = seam.backend_of(mesh)
    grad_options = gradient_options(backend, remat, fsdp)  # the gradient programs'
    score_fn = functools.partial(score, graphdef, temperature=temperature, kernels=kernels)
    reference_fn = functools.partial(reference_logprobs, graphdef, temperature=temperature,
                                     kernels=kernels)
    self._grads_fn = functools.partial(accumulated_gradients, graphdef, loss_cfg=loss_cfg,
                                       temperature=temperature, kernels=kernels, on_policy=on_policy)
    apply_fn = functools.partial(apply_gradients, tx)
    update_fn = functools.partial(update, graphdef, tx, loss_cfg=loss_cfg,
                                  temperature=temperature, kernels=kernels, on_policy=on_policy)
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
    score_options = scoring_options(backend, fsdp)
    self.score_program = jit(score_fn, scored, (s.rows, s.rows, s.rows) if s else None,
                             compiler_options=score_options)
    self.reference_program = jit(reference_fn, scored, s.rows if s else None,
                                 compiler_options=score_options)
    self._jit, self._grad_options = jit, grad_options
    self._gradients_programs: dict[int, Any] = {}
    self.apply_program = jit(
        apply_fn, (s.trainable, s.opt_state, s.replicated, s.replicated, s.trainable) if s else None,
        (s.trainable, s.opt_state, s.replicated) if s else None, donate_argnums=(0, 1))
    self.update_program = jit(
        update_fn, (s.trainable, s.opt_state, s.frozen, s.update_batch()) if s else None,
        (s.trainable, s.opt_state, s.replicated) if s else None, donate_argnums=(0, 1))
    self.fused_program = self.fused_gradients_program = None
    if adv_cfg is not None:
      fused_kw = dict(loss_cfg=loss_cfg, adv_cfg=adv_cfg, temperature=temperature, kernels=kernels)
      scored = Scored(*(s.rows,) * 3, *(s.replicated,) * 3) if s else None
      fused_in = (s.trainable, s.frozen, s.reference, s.rollout(), s.replicated) if s else None
      self.fused_program = jit(
          functools.partial(fused_update, graphdef, tx, **fused_kw),
          (s.trainable, s.opt_state, *fused_in[1:]) if s else None,
          (s.trainable, s.opt_state, s.replicated, scored) if s else None, donate_argnums=(0, 1),
          compiler_options=score_options)  # as its passes: none on CPU and GPU (not remat's)
      self.fused_gradients_program = jit(
          functools.partial(fused_gradients, graphdef, **fused_kw), fused_in,
          (s.replicated, s.replicated, s.trainable, scored) if s else None,
          compiler_options=grad_options)

  def gradients_program(self, micro_batches: int = 1):
    """The jitted `accumulated_gradients` for `micro_batches` slices (compiled on first call)."""
    if micro_batches not in self._gradients_programs:
      s = self.shardings
      self._gradients_programs[micro_batches] = self._jit(
          functools.partial(self._grads_fn, micro_batches=micro_batches),
          (s.trainable, s.frozen, s.update_batch()) if s else None,
          (s.replicated, s.replicated, s.trainable) if s else None,
          compiler_options=self._grad_options)
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
  it, so the backward pass's recomputation (`models.ordered_remat`, the CPU's `Kernels.remat`) is merged with
  the forward's identical values, which then stay live from the forward to the backward:
  each layer's float32 copy of its input, and a layer's recomputed MLP outputs and
  attention score blocks. The GPU compiler removes the barriers only after scheduling (TPU:
  not checked).
  Without CSE, the 3B update of `benchmarks/memory_fsdp.py` needs 22.3 GiB per device
  instead of 41.4 (docs/distributed.md).
  """
  return {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED",
          "xla_disable_hlo_passes": "cse"}


def tpu_fsdp_options() -> dict[str, str]:
  """TPU compiler options for an FSDP gradient program: no windowed einsums for all-gathers.

  By default the SPMD partitioner turns each product with a weight split over `fsdp` along
  its input axis into a loop of collective permutes writing a whole-output buffer, and the
  TPU scheduler allocates all those buffers (every layer's forward, rematerialised forward
  and backward products) at the start of the micro-batch loop, each live until its loop
  ends: 0.43 GB a layer for Qwen2.5-3B at 2 x 2,304 tokens a chip, over v5e's HBM at 36
  layers by extrapolation. Gathering the weights instead holds 0.05 GB a layer
  (docs/distributed.md).
  """
  return {"xla_tpu_enable_windowed_einsum_for_all_gather": "false"}


def scoring_options(backend: str, fsdp: int) -> dict[str, str] | None:
  """Compiler options for the score and reference programs: `tpu_fsdp_options` on TPU with
  `fsdp` > 1, else none (CPU and GPU: the compiler's defaults).

  With the two passes of the score program fenced apart (`objective.score`), each pass gathers a
  layer's weights just before its products: Qwen2.5-7B on a v5e-16 holds 0.03 GiB a layer, against
  0.29-0.43 with the compiler's defaults and 1.5 with windowed products over fenced weights
  (docs/distributed.md).
  """
  if backend == "tpu" and fsdp > 1:
    return tpu_fsdp_options()
  return None


def gradient_options(backend: str, remat: bool, fsdp: int) -> dict[str, str] | None:
  """Compiler options for the gradient programs: `cpu_remat_options` on CPU with remat,
  `scoring_options` elsewhere (`tpu_fsdp_options` on TPU with `fsdp` > 1)."""
  if backend == "cpu" and remat:
    return cpu_remat_options()
  return scoring_options(backend, fsdp)


def _jit(fn, in_shardings, out_shardings, *, mesh, **kw):
  """`jax.jit`, with explicit shardings when there is a mesh."""
  if mesh is None:
    return jax.jit(fn, **kw)
  return jax.jit(fn, in_shardings=in_shardings, out_shardings=out_shardings, **kw)
