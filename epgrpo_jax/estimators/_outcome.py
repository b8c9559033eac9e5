"""What the estimators share: the `ep/*` diagnostics of any token advantage, and the parts and
metrics of an estimator that gives each response one advantage (no gate, no progress):
`per_response`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from epgrpo_jax.core import advantages


def masked_mean(x_PxGxT: jax.Array, mask_PxGxT: jax.Array) -> jax.Array:
  """Mean of `x` over the response tokens (0 when there are none)."""
  return jnp.sum(jnp.where(mask_PxGxT, x_PxGxT, 0.0)) / jnp.maximum(mask_PxGxT.sum(), 1)


def outcome_metrics(adv_PxGxT: jax.Array, outcome_token_PxGxT: jax.Array,
                    zero_variance_P: jax.Array, mask_PxGxT: jax.Array) -> dict[str, jax.Array]:
  """The diagnostics every estimator reports: its outcome and final advantages' means and the
  zero-variance groups' share (of groups and of response tokens)."""
  mean = lambda x: masked_mean(x, mask_PxGxT)
  return {
      "ep/outcome_adv_mean": mean(outcome_token_PxGxT),
      "ep/outcome_adv_abs_mean": mean(jnp.abs(outcome_token_PxGxT)),
      "ep/final_adv_mean": mean(adv_PxGxT),
      "ep/final_adv_abs_mean": mean(jnp.abs(adv_PxGxT)),
      "ep/zero_variance_frac": zero_variance_P.mean(),
      "ep/zero_variance_token_frac": jnp.sum(mask_PxGxT & zero_variance_P[:, None, None])
                                     / jnp.maximum(mask_PxGxT.sum(), 1),
  }


def response_estimate(outcome_PxG: jax.Array, zero_variance_P: jax.Array, mask_PxGxT: jax.Array):
  """`(adv, parts, metrics)` of a per-response advantage on every response token: the parts
  EP-GRPO's switches-off values (gate 1, no anchor, signal, progress; tau and bucket 0)."""
  adv_PxGxT = advantages.token_advantage(outcome_PxG, mask_PxGxT)
  zeros_PxGxT = jnp.zeros(mask_PxGxT.shape, jnp.float32)
  parts = advantages.Components(
      outcome=outcome_PxG, gate=mask_PxGxT.astype(jnp.float32), outcome_token=adv_PxGxT,
      anchor=jnp.zeros_like(outcome_PxG), signal=zeros_PxGxT, tau=zeros_PxGxT,
      bucket=jnp.zeros(mask_PxGxT.shape, jnp.int32), progress=zeros_PxGxT,
      zero_variance=zero_variance_P)
  return adv_PxGxT, parts, outcome_metrics(adv_PxGxT, adv_PxGxT, zero_variance_P, mask_PxGxT)


def per_response(fn):
  """The estimator of `fn(rewards_PxG, cfg) -> (A_PxG, zero_variance_P)`: A_i on every token of
  response i, with the parts and metrics of `response_estimate`."""

  @functools.wraps(fn)
  def estimator(rewards_PxG, entropy_PxGxT, logp_old_PxGxT, logp_ref_PxGxT, mask_PxGxT, cfg):
    return response_estimate(*fn(rewards_PxG, cfg), mask_PxGxT)

  return estimator
