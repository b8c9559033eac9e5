"""The pure functions of an RL step's device work: the scoring and reference passes
(`completion_logprobs`), the clipped-surrogate loss's gradients (one pass, accumulated over
micro-batches, or fused with scoring and the advantage) and the optimizer update.

Each is pure over arrays and NNX states (graph, trainable, frozen, reference: `programs.Policy`);
`programs.StepFunctions` jits them.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from epgrpo_jax.core import advantages, losses, token_stats
from epgrpo_jax.core import optim
from epgrpo_jax.models import XLA, CausalLM, Kernels, adapters_are_zero, rope_table
from epgrpo_jax.training.advantage_program import advantage_step
from epgrpo_jax.training.batches import CompletionBatch, Scored, UpdateBatch


def completion_logprobs(model: CausalLM, rollout: CompletionBatch, *, temperature: float,
                        kernels: Kernels = XLA,
                        adapters: bool = True, token_chunk: int = 1024,
                        vocab_chunk: int = 8192) -> tuple[jax.Array, jax.Array]:
  """Per-token log-prob and entropy of each completion under `model` ([B, N] float32).

  One forward over prompt + completion (minus its last token); the hidden state
  before each completion token predicts it, at `temperature` as sampled. With
  `rollout.packing`, the forward runs over the packed rows, and each token's values return to
  the [B, N] layout (0 where the completion mask is false).
  """
  kw = dict(temperature=temperature, token_chunk=token_chunk, vocab_chunk=vocab_chunk,
            row_blocks=kernels.batch_shards)
  # Positions stay below the row length. Looked up in a table (a constant), the rotary cos and
  # sin are not computed afresh: XLA:CPU fuses them into each consumer, once per head and layer.
  if rollout.packing is not None:
    p = rollout.packing
    hidden_RxLxD, _ = model(p.tokens, p.positions, p.segments > 0, adapters=adapters,
                            segments_BxT=p.segments, kernels=kernels,
                            rope_table=rope_table(model.cfg, p.tokens.shape[1]))
    per_slot = token_stats.token_logprob_entropy(hidden_RxLxD, _head(model, kernels), p.targets, **kw)
    mask_BxN = rollout.completion_mask
    return tuple(jnp.where(mask_BxN, x_RxL.reshape(-1)[p.index], 0.0) for x_RxL in per_slot)
  tp = rollout.prompt_ids.shape[1]
  tokens_BxL = jnp.concatenate([rollout.prompt_ids, rollout.completion], axis=1)[:, :-1]
  mask_BxL = jnp.concatenate([rollout.prompt_mask, rollout.completion_mask], axis=1)[:, :-1]
  positions_BxL = jnp.maximum(jnp.cumsum(mask_BxL, axis=1) - 1, 0)
  hidden_BxLxD, _ = model(tokens_BxL, positions_BxL, mask_BxL, adapters=adapters, kernels=kernels,
                          rope_table=rope_table(model.cfg, tokens_BxL.shape[1]))
  hidden_BxNxD = hidden_BxLxD[:, tp - 1:]
  return token_stats.token_logprob_entropy(hidden_BxNxD, _head(model, kernels), rollout.completion,
                                           **kw)


def _head(model: CausalLM, kernels: Kernels) -> jax.Array:
  """The LM head [D, V] as the chunked log-probs read it: laid out once for their loops by the
  program's constraint (`Kernels.constrain`, "head": gathered over fsdp on a sharded mesh)."""
  return kernels.constrain(model.head_DxV(), "head")


def reference_logprobs(graphdef, trainable: nnx.State, frozen: nnx.State,
                       reference: nnx.State | None, rollout: CompletionBatch, *,
                       temperature: float, kernels: Kernels = XLA) -> jax.Array:
  """The reference pass: log-probs under pi_ref (LoRA: the policy with adapters off)."""
  if reference is None:
    model = nnx.merge(graphdef, frozen, trainable)
    return completion_logprobs(model, rollout, temperature=temperature, kernels=kernels, adapters=False)[0]
  ref_model = nnx.merge(graphdef, frozen, reference)
  return completion_logprobs(ref_model, rollout, temperature=temperature, kernels=kernels)[0]


def score(graphdef, trainable: nnx.State, frozen: nnx.State, reference: nnx.State | None,
          rollout: CompletionBatch, *, temperature: float, kernels: Kernels = XLA) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The scoring pass (old log-probs, entropies) and the reference pass, in one program.

  The reference pass reads the frozen weights only after the scoring pass (`after`): under LoRA
  both passes read the same frozen weights, and the compiler otherwise gathered each FSDP-split
  weight once for both, holding every layer's gathered copy from one pass to the other (Qwen2.5-7B
  on a v5e-16: 0.29 GiB a layer, docs/distributed.md).
  """
  model = nnx.merge(graphdef, frozen, trainable)
  logp_old, entropy = completion_logprobs(model, rollout, temperature=temperature, kernels=kernels)
  frozen = after(frozen, (logp_old, entropy))
  logp_ref = reference_logprobs(graphdef, trainable, frozen, reference, rollout,
                                temperature=temperature, kernels=kernels)
  return logp_old, entropy, logp_ref


def after(state: Any, done: Any) -> Any:
  """`state` unchanged, as values that exist only once `done` is computed (an optimization
  barrier): what reads them cannot share work with, or be scheduled before, what made `done`."""
  return jax.lax.optimization_barrier((state, done))[0]


def make_optimizer(learning_rate: float, total_updates: int, *, warmup_ratio: float,
                   weight_decay: float, max_grad_norm: float, b1: float = 0.9,
                   b2: float = 0.999, eps: float = 1e-8) -> tuple[optax.GradientTransformation, Any]:
  """AdamW with linear warm-up over `warmup_ratio` of the updates, then linear decay to 0."""
  schedule = optim.make_schedule(learning_rate, total_updates, warmup_ratio=warmup_ratio)
  return optim.make_optimizer(schedule, weight_decay=weight_decay, max_grad_norm=max_grad_norm,
                              b1=b1, b2=b2, eps=eps), schedule


def gradients(graphdef, trainable: nnx.State, frozen: nnx.State, batch: UpdateBatch, *,
              loss_cfg: losses.LossConfig, temperature: float, kernels: Kernels = XLA, on_policy: bool):
  """(loss, aux metrics, gradients) of the clipped-surrogate loss w.r.t. `trainable`.

  `on_policy`: the first and only update on this rollout, so pi_old = pi_theta and
  the ratio is exactly 1 (`logp_old` is the stop-gradient of the new log-probs).
  """
  def terms(logp, entropy):
    return logp if on_policy else batch.logp_old, batch.logp_ref, batch.advantage, None

  loss, aux, grads, _ = policy_gradients(graphdef, trainable, frozen, batch.rollout, terms,
                                         loss_cfg=loss_cfg, temperature=temperature, kernels=kernels)
  return loss, aux, grads


def policy_gradients(graphdef, trainable: nnx.State, frozen: nnx.State, rollout: CompletionBatch,
                     terms: Callable, *, loss_cfg: losses.LossConfig, temperature: float, kernels: Kernels = XLA):
  """(loss, aux, gradients, extra) of `losses.policy_loss` on the policy's forward pass.

  `terms(logp_BxN, entropy_BxN)`, given that forward's log-probs and entropies under
  stop-gradient, returns (logp_old, logp_ref, advantage [B, N], extra): the loss's other
  inputs, and whatever else the caller wants back from inside the differentiated function.
  """
  def loss_fn(tr):
    model = nnx.merge(graphdef, frozen, tr)
    logp, entropy = completion_logprobs(model, rollout, temperature=temperature, kernels=kernels)
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
           temperature: float, kernels: Kernels = XLA, on_policy: bool):
  """One optimizer update with the clipped-surrogate loss: `gradients`, then `apply_gradients`."""
  loss, aux, grads = gradients(graphdef, trainable, frozen, batch, loss_cfg=loss_cfg,
                               temperature=temperature, kernels=kernels, on_policy=on_policy)
  return apply_gradients(tx, trainable, opt_state, loss, aux, grads)


def fused_gradients(graphdef, trainable: nnx.State, frozen: nnx.State,
                    reference: nnx.State | None, rollout: CompletionBatch, rewards_PxG: jax.Array, *,
                    loss_cfg: losses.LossConfig, adv_cfg: advantages.AdvantageConfig,
                    temperature: float, kernels: Kernels = XLA):
  """(loss, aux, gradients, Scored) of one on-policy update from the rollout and its rewards.

  The policy's forward pass is the one the loss differentiates: its log-probs and entropies
  (under stop-gradient) are the scoring pass, so no separate scoring forward runs. The
  reference log-probs (no gradient) and the advantage (`advantage_step`, stop-gradient) come
  from the same program. On-policy, pi_old = pi_theta and the ratio is exactly 1.
  """
  P, G = rewards_PxG.shape
  mask_BxN = rollout.completion_mask
  logp_ref = jax.lax.stop_gradient(reference_logprobs(
      graphdef, trainable, frozen, reference, rollout, temperature=temperature, kernels=kernels))
  to_groups = lambda x: x.reshape(P, G, -1)
  same = policy_is_reference(graphdef, trainable, frozen, reference)

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
                          temperature=temperature, kernels=kernels)


def policy_is_reference(graphdef, trainable: nnx.State, frozen: nnx.State,
                        reference: nnx.State | None) -> jax.Array:
  """bool []: the policy equals its reference (LoRA: every adapter's B is zero; full
  fine-tuning: the trainable weights equal the reference copy)."""
  if reference is not None:
    same = jax.tree.map(lambda a, b: jnp.all(a == b), trainable, reference)
    return jnp.all(jnp.stack(jax.tree.leaves(same)))
  model = nnx.merge(graphdef, frozen, trainable)
  return adapters_are_zero(model)


def fused_update(graphdef, tx: optax.GradientTransformation, trainable: nnx.State,
                 opt_state: Any, frozen: nnx.State, reference: nnx.State | None,
                 rollout: CompletionBatch, rewards_PxG: jax.Array, *, loss_cfg: losses.LossConfig,
                 adv_cfg: advantages.AdvantageConfig, temperature: float, kernels: Kernels = XLA):
  """`fused_gradients`, then `apply_gradients`: (trainable, opt_state, metrics, Scored)."""
  loss, aux, grads, scored = fused_gradients(graphdef, trainable, frozen, reference, rollout,
                                             rewards_PxG, loss_cfg=loss_cfg, adv_cfg=adv_cfg,
                                             temperature=temperature, kernels=kernels)
  return (*apply_gradients(tx, trainable, opt_state, loss, aux, grads), scored)


def accumulated_gradients(graphdef, trainable: nnx.State, frozen: nnx.State, batch: UpdateBatch,
                          *, micro_batches: int, loss_cfg: losses.LossConfig, temperature: float, kernels: Kernels = XLA,
                          on_policy: bool):
  """(loss, aux, grads) of `batch` computed as `micro_batches` row slices in turn (gradient
  accumulation): equal to one pass over the batch, with a k-th of its activation memory.

  The gradients are one running sum in a `lax.scan` (memory of one gradient, whatever k). Each
  slice's loss is its numerator over its own denominator (`losses.policy_loss`), so weighting
  by the denominators gives exactly the full batch's loss and gradients. Slice i takes rows
  i, i + k, ...: on a mesh each device keeps its own rows.
  """
  grad_fn = functools.partial(gradients, graphdef, loss_cfg=loss_cfg, temperature=temperature, kernels=kernels,
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
