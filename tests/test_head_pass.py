"""The LM head's log-prob + entropy at one pass over the head per chunk: the compiled
programs' dot FLOPs and exponentials (counted by `models.flops.hlo_counts`), and the
gradients each differentiated input and output asks for, against the full softmax."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from epgrpo_jax.core.token_stats import naive_token_logprob_entropy, token_logprob_entropy
from epgrpo_jax.models.flops import hlo_counts

N, D, V = 256, 32, 2048  # 2 token chunks x 4 vocabulary chunks below
TC, VC = 128, 512


def test_hlo_counts_multiplies_loop_bodies():
  """A loop of 5 steps, each a [8, 4] x [4, 6] product (2 x 8 x 6 x 4 = 384 FLOPs) and an
  exponential of its 48 elements: 1,920 FLOPs and 240 exponentials."""
  def f(x, w):
    return jax.lax.fori_loop(0, 5, lambda i, a: a + jnp.exp((x * i) @ w), jnp.zeros((8, 6)))

  text = jax.jit(f).lower(jnp.ones((8, 4)), jnp.ones((4, 6))).compile().as_text()
  assert hlo_counts(text) == {"dot_flops": 1920.0, "exp": 240.0, "all_gather_bytes": 0.0}
  assert hlo_counts(text, loops=False) == {"dot_flops": 384.0, "exp": 48.0, "all_gather_bytes": 0.0}


def _compiled_counts(argnums):
  fn = lambda h, w, t: token_logprob_entropy(h, w, t, token_chunk=TC, vocab_chunk=VC)

  def objective(h, w, t):
    logp, entropy = fn(h, w, t)
    return jnp.sum(logp) + 0.1 * jnp.sum(entropy)

  run = fn if argnums is None else jax.grad(objective, argnums)
  args = (jax.ShapeDtypeStruct((1, N, D), jnp.float32), jax.ShapeDtypeStruct((D, V), jnp.float32),
          jax.ShapeDtypeStruct((1, N), jnp.int32))
  counts = hlo_counts(jax.jit(run).lower(*args).compile().as_text())
  return counts["dot_flops"] / (2 * N * D * V), counts["exp"] / (N * V)


@pytest.mark.parametrize("argnums,passes", [(None, 1), (0, 3), (1, 3), ((0, 1), 4)],
                         ids=["forward", "d-hidden", "d-head", "d-both"])
def test_one_head_pass_per_chunk(argnums, passes):
  """Forward: the logits once. Backward: each chunk's logits recomputed once and exponentiated
  once, then dz W^T and/or h^T dz: 1 + 1 + (1 or 2) head passes, 2 exponentials per logit (the
  forward's and the backward's; the online softmax adds one per row and chunk). Before, the
  full fine-tuning gradient took 5 passes and 3 exponentials (two backward loops)."""
  head_passes, exps = _compiled_counts(argnums)
  assert head_passes == passes
  assert (1.0 if argnums is None else 2.0) <= exps < (1.0 if argnums is None else 2.0) + 0.01


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.normal(0, 0.5, (2, 37, 8)), jnp.float32),
          jnp.asarray(rng.normal(0, 1, (8, 45)), jnp.float32),
          jnp.asarray(rng.integers(0, 45, (2, 37)), jnp.int32),
          jnp.asarray(rng.normal(size=(2, 37)), jnp.float32))


@pytest.mark.parametrize("use", ["logp", "entropy", "both"])
@pytest.mark.parametrize("argnums", [0, 1, (0, 1)], ids=["d-hidden", "d-head", "d-both"])
def test_gradients_of_what_is_asked_equal_the_full_softmax(use, argnums):
  """Each combination of differentiated inputs and used outputs (an unused output's cotangent
  is a symbolic zero, its term left out), with ragged chunks (7 tokens x 10 columns), equals
  the full float32 softmax (1e-5; measured 1e-6)."""
  hidden, head, targets, weights = _inputs()

  def objective(fn):
    def f(h, w):
      logp, entropy = fn(h, w, targets)
      parts = {"logp": jnp.sum(weights * logp), "entropy": jnp.sum(weights * entropy)}
      return sum(parts.values()) if use == "both" else parts[use]
    return f

  chunked = lambda h, w, t: token_logprob_entropy(h, w, t, token_chunk=7, vocab_chunk=10,
                                                  temperature=0.8)
  naive = lambda h, w, t: naive_token_logprob_entropy(h, w, t, temperature=0.8)
  got = jax.jit(jax.grad(objective(chunked), argnums))(hidden, head)
  want = jax.grad(objective(naive), argnums)(hidden, head)
  for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("row_blocks", [2, 4, 3])
def test_row_blocks_keep_values_and_gradients(row_blocks):
  """Token chunks taken within each of `row_blocks` blocks of rows (a batch split over devices;
  3 does not divide the 4 rows and is read as one block), with ragged chunks (7 of each block's
  37 or more tokens): values and both gradients equal the full float32 softmax (1e-5)."""
  rng = np.random.default_rng(4)
  hidden = jnp.asarray(rng.normal(0, 0.5, (4, 37, 8)), jnp.float32)
  head = jnp.asarray(rng.normal(0, 1, (8, 45)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, 45, (4, 37)), jnp.int32)
  weights = jnp.asarray(rng.normal(size=(2, 4, 37)), jnp.float32)

  def run(fn):
    def f(h, w):
      logp, entropy = fn(h, w, targets)
      return jnp.sum(weights[0] * logp) + jnp.sum(weights[1] * entropy), (logp, entropy)
    (_, outs), grads = jax.jit(jax.value_and_grad(f, (0, 1), has_aux=True))(hidden, head)
    return (*outs, *grads)

  got = run(lambda h, w, t: token_logprob_entropy(h, w, t, token_chunk=7, vocab_chunk=10,
                                                  temperature=0.8, row_blocks=row_blocks))
  want = run(lambda h, w, t: naive_token_logprob_entropy(h, w, t, temperature=0.8))
  for name, g, r in zip(("logp", "entropy", "d hidden", "d head"), got, want):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5, err_msg=name)
