"""The attention paths: blockwise, the C++ kernel (and jax.nn's reference) equal the plain one in
values and grads.

float32 throughout; tiny shapes so that the whole file runs in seconds on CPU.
"""

from __future__ import annotations

import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from epgrpo_jax.io.errors import UserError
from epgrpo_jax.kernels import cpu as cpu_kernels
from epgrpo_jax.kernels import seam
from epgrpo_jax.models import LORA, LoraConfig, _attention
from helpers import random_model, tiny_config

ATOL = 1e-5


def _inputs(b, k, g, t, s, hd, seed):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((b, k, g, t, hd)), jnp.float32)
  keys = jnp.asarray(rng.standard_normal((b, k, hd, s)), jnp.float32)
  values = jnp.asarray(rng.standard_normal((b, k, s, hd)), jnp.float32)
  weights = jnp.asarray(rng.standard_normal((b, k, g, t, hd)), jnp.float32)
  return q, keys, values, weights


def _left_padded(b, s, seed):
  """Row 0 unpadded, row 1 left-padded, row 2 (if any) fully padded, others random holes."""
  rng = np.random.default_rng(seed)
  valid = rng.random((b, s)) < 0.8
  valid[0] = True
  if b > 1:
    valid[1] = np.arange(s) >= s // 3
  if b > 2:
    valid[2] = False
  return jnp.asarray(valid)


def _value_and_grads(fn, q, keys, values, weights, seen_BxT=None):
  """The output and the grads of q, keys and values for the cotangent `weights`.

  Given `seen_BxT` (queries with a visible slot), the outputs of the others are zeroed and get
  no cotangent: their value is only required to be finite (the model never reads it).
  """
  out, vjp = jax.vjp(fn, q, keys, values)
  if seen_BxT is None:
    return out, vjp(weights)
  seen = seen_BxT[:, None, None, :, None]
  return jnp.where(seen, out, 0.0), vjp(jnp.where(seen, weights, 0.0))


def _seen(valid, offset, t):
  """[B, T]: the queries that see at least one slot."""
  return _attention.visible(valid, offset, t).any(-1)


def _behind_offset(b, k, g, t, s, hd, offset, seed):
  """Inputs of t queries at slots offset.. of s, the valid slots, the queries that see one,
  and plain attention's outputs and grads (the reference)."""
  q, keys, values, weights = _inputs(b, k, g, t, s, hd, seed=seed)
  valid = _left_padded(b, s, seed=seed)
  seen = _seen(valid, offset, t)
  plain = lambda q, kk, v: _attention.attend(q, kk, v, _attention.visible(valid, offset, t))
  return (q, keys, values, weights), valid, seen, _value_and_grads(plain, q, keys, values,
                                                                   weights, seen)


class BlockwiseTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_values_and_grads_equal_plain(self):
    # GQA (2 KV heads x 3 query heads each), 11 keys in blocks of 5: the last one is partial.
    # (Other block sizes: test_blockwise_property and the model test.)
    b, k, g, t, hd = 4, 2, 3, 11, 8
    for block in (5,):
      q, keys, values, weights = _inputs(b, k, g, t, t, hd, seed=block)
      valid = _left_padded(b, t, seed=block)
      seen = _seen(valid, 0, t)
      plain = lambda q, kk, v: _attention.attend(q, kk, v, _attention.visible(valid, 0, t))
      want = _value_and_grads(plain, q, keys, values, weights, seen)
      got = self.variant(lambda q, kk, v, w, block=block, valid=valid: _value_and_grads(
          lambda q, kk, v: _attention.blockwise(q, kk, v, valid, 0, block=block), q, kk, v, w,
          seen))(q, keys, values, weights)
      chex.assert_trees_all_close(got, want, atol=ATOL, rtol=0)
      assert np.isfinite(np.asarray(_attention.blockwise(q, keys, values, valid, 0,
                                                         block=block))).all()

  @chex.variants(with_jit=True, without_jit=True)
  def test_queries_behind_an_offset_equal_plain(self):
    # A cache prefill: 5 queries at slots 4..8 of 13 (later slots are not yet written).
    inputs, valid, seen, want = _behind_offset(3, 1, 2, 5, 13, 4, offset=4, seed=3)
    # An array offset (the cache's write index) scans every slot; a Python int skips the slots
    # after each query block (blocks of 2 queries: 3 blocks seeing 6, 8 and 9 slots).
    for block, offset in itertools.product((7, 2), (jnp.int32(4), 4)):
      got = self.variant(lambda q, kk, v, w, block=block, offset=offset: _value_and_grads(
          lambda q, kk, v: _attention.blockwise(q, kk, v, valid, offset, block=block), q, kk, v, w,
          seen))(*inputs)
      chex.assert_trees_all_close(got, want, atol=ATOL, rtol=0)

  @chex.variants(with_jit=True, without_jit=True)
  def test_jax_nn_reference_equals_plain_where_a_key_is_visible(self):
    # The cudnn path's call (layouts, GQA, mask) run by jax.nn's XLA implementation. Rows with
    # no visible key differ (jax.nn's own masking), so only rows that see a key are compared.
    b, k, g, t, hd = 3, 2, 2, 9, 8
    q, keys, values, _ = _inputs(b, k, g, t, t, hd, seed=5)
    valid = _left_padded(2, t, seed=5)
    valid = jnp.concatenate([valid, valid[:1]])
    seen_BxT = _attention.visible(valid, 0, t).any(-1)
    want = _attention.attend(q, keys, values, _attention.visible(valid, 0, t))
    got = self.variant(lambda *a: _attention.cudnn(*a, implementation="xla"))(
        q, keys, values, valid)
    mask = np.broadcast_to(np.asarray(seen_BxT)[:, None, None, :, None], want.shape)
    chex.assert_trees_all_close(np.asarray(got)[mask], np.asarray(want)[mask], atol=ATOL, rtol=0)

  @chex.variants(with_jit=True, without_jit=True)
  def test_jax_nn_gets_a_cache_prefill_at_odd_lengths_as_they_are(self):
    # With a cache (no gradient: cuDNN's inference pass takes a mask at any length), 7 queries
    # at slots 2..8 of 9 keys reach jax.nn as they are, no padding slot added; the outputs and
    # grads of the queries that see a key equal plain's.
    inputs, valid, seen, want = _behind_offset(2, 2, 2, 7, 9, 8, offset=2, seed=7)
    shapes, call = [], jax.nn.dot_product_attention

    def spy(query, key, value, **kw):
      shapes.append((query.shape[1], key.shape[1], kw["mask"].shape[2:]))
      return call(query, key, value, **kw)

    with pytest.MonkeyPatch.context() as mp:
      mp.setattr(jax.nn, "dot_product_attention", spy)
      got = self.variant(lambda q, kk, v, w: _value_and_grads(
          lambda q, kk, v: _attention.cudnn(q, kk, v, valid, 2, implementation="xla"), q, kk, v, w,
          seen))(*inputs)
    assert set(shapes) == {(7, 9, (7, 9))}
    chex.assert_trees_all_close(got, want, atol=ATOL, rtol=0)


def _kernel_layout(fn):
  """`fn` of q [B, K, G, T, Hd], keys [B, K, Hd, S], values [B, K, S, Hd] (the other paths'
  layouts) as a function of q [B, T, K, G, Hd], k and v [B, T, K, Hd] (the kernel's)."""
  return lambda q, k, v: fn(q.transpose(0, 2, 3, 1, 4), k.transpose(0, 2, 3, 1),
                            v.transpose(0, 2, 1, 3)).transpose(0, 3, 1, 2, 4)


class CpuKernelTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_values_and_grads_equal_plain(self):
    # GQA (2 KV heads x 3 query heads), 75 queries: blocks of 16 queries, the last partial;
    # head dim 64 and up to 75 slots: whole blocks of 64 columns and tails in the products;
    # row 0 unpadded, row 1 left-padded, row 2 all padding, row 3 holes and 3 packed segments.
    assert cpu_kernels.available()
    b, k, g, t, hd = 4, 2, 3, 75, 64
    rng = np.random.default_rng(11)
    q, weights = (jnp.asarray(rng.standard_normal((b, t, k, g, hd)), jnp.float32) for _ in range(2))
    keys, values = (jnp.asarray(rng.standard_normal((b, t, k, hd)), jnp.float32) for _ in range(2))
    valid = _left_padded(b, t, seed=11)
    segments = jnp.zeros((b, t), jnp.int32).at[3, 12:].set(1).at[3, 50:].set(2)
    allowed = _attention.visible(valid, 0, t, segments)
    seen = allowed.any(-1)
    plain = _kernel_layout(lambda q, kk, v: _attention.attend(q, kk, v, allowed))
    kernel = lambda q, kk, v: cpu_kernels.causal_attention(q, kk, v, valid, segments)

    def masked(fn):
      out, vjp = jax.vjp(fn, q, keys, values)
      mask = seen[:, :, None, None, None]
      return jnp.where(mask, out, 0.0), vjp(jnp.where(mask, weights, 0.0)), out

    want, got = masked(plain), self.variant(lambda: masked(kernel))()
    chex.assert_trees_all_close(got[:2], want[:2], atol=ATOL, rtol=0)
    assert not np.asarray(seen[2]).any()
    np.testing.assert_array_equal(np.asarray(got[2][2]), 0.0)  # sees nothing: 0, not NaN

  def test_model_takes_the_kernel_in_one_device_programs_and_equals_plain(self):
    # Through the whole model (left padding, GQA, remat, LoRA grads, packed segments): auto's
    # kernel (the seam's CPU choice) gives the loss and adapter grads of plain; on several
    # devices it runs plain (and the MLP's activation runs in XLA: that case compares both C++
    # kernels with XLA).
    lora = LoraConfig(rank=2, alpha=4.0)
    cfg = tiny_config(num_layers=2, remat=True)
    tokens = jnp.asarray(np.random.default_rng(0).integers(2, 97, (3, 21)), jnp.int32)
    mask = jnp.asarray(np.arange(21)[None] >= np.asarray([[0], [4], [21]]))  # row 2: all padding
    positions = jnp.maximum(jnp.cumsum(mask, 1) - 1, 0)
    segments = jnp.zeros((3, 21), jnp.int32).at[0, 9:].set(1)

    def loss(model, kernels):
      hidden, _ = model(tokens, positions, mask, segments_BxT=segments, kernels=kernels)
      return jnp.sum(jnp.where(mask[..., None], model.logits(hidden), 0.0) ** 2) / 100

    grad = nnx.value_and_grad(loss, argnums=nnx.DiffState(0, LORA))
    results, calls = {}, {}
    for name, one_device in (("plain", True), ("auto", True), ("auto", False)):
      model = random_model(cfg.replace(attention=name), lora=lora, seed=7)
      kernels = seam.for_backend(model.cfg, "cpu", one_device)
      value, grads = nnx.jit(grad, static_argnums=1)(model, kernels)
      graphdef, state = nnx.split(model)
      jaxpr = str(jax.make_jaxpr(lambda st: grad(nnx.merge(graphdef, st), kernels))(state))
      backward = jaxpr.count("epgrpo_causal_attention_grad")
      calls[name, one_device] = (jaxpr.count("epgrpo_causal_attention") - backward, backward)
      # The MLP's gated activation: a C++ kernel in one-device programs (plain attention too).
      assert ("epgrpo_swiglu" in jaxpr) == one_device
      results[name, one_device] = (value, nnx.to_pure_dict(grads))
    # Per layer: the forward, its recomputation in the backward (remat), one backward.
    layers = cfg.num_layers
    assert calls == {("plain", True): (0, 0), ("auto", True): (2 * layers, layers),
                     ("auto", False): (0, 0)}
    chex.assert_trees_all_close(results["auto", True], results["plain", True], atol=ATOL, rtol=1e-5)
    chex.assert_trees_all_close(results["auto", False], results["plain", True], atol=ATOL,
                                rtol=1e-5)


@jax.jit
def _both(q, keys, values, weights, valid, offset):
  plain = lambda q, kk, v: _attention.attend(q, kk, v, _attention.visible(valid, offset, q.shape[3]))
  blockwise = lambda q, kk, v: _attention.blockwise(q, kk, v, valid, offset, block=3)
  scan = lambda q, kk, v: _attention.blockwise(q, kk, v, valid, offset, block=3, loop="scan")
  want = _value_and_grads(plain, q, keys, values, weights)
  return (_value_and_grads(blockwise, q, keys, values, weights),
          _value_and_grads(scan, q, keys, values, weights)), (want, want)


# A fortieth of the profile's count (ci: 12, dev: 1): each example runs two attention paths.
@settings(max_examples=max(1, settings.default.max_examples // 40))
@given(valid=st.lists(st.booleans(), min_size=2 * 10, max_size=2 * 10),
       offset=st.integers(0, 4), seed=st.integers(0, 2 ** 16))
def test_blockwise_property(valid, offset, seed):
  # Any validity pattern (rows of 10 slots in blocks of 3), any query offset: one compile.
  q, keys, values, weights = _inputs(2, 2, 2, 6, 10, 4, seed)
  got, want = _both(q, keys, values, weights, jnp.asarray(valid).reshape(2, 10), offset)
  chex.assert_trees_all_close(got, want, atol=ATOL, rtol=0)


def test_model_blockwise_equals_plain_with_remat_and_lora():
  # Through the whole model: left padding, GQA, remat, LoRA grads; block 4 over 9 tokens.
  lora = LoraConfig(rank=2, alpha=4.0)
  cfg = tiny_config(num_layers=1, remat=True)
  tokens = jnp.asarray(np.random.default_rng(0).integers(2, 97, (3, 9)), jnp.int32)
  mask = jnp.asarray(np.arange(9)[None] >= np.asarray([[0], [4], [9]]))  # row 2: all padding
  positions = jnp.maximum(jnp.cumsum(mask, 1) - 1, 0)

  def loss(model):
    hidden, _ = model(tokens, positions, mask)
    return jnp.sum(jnp.where(mask[..., None], model.logits(hidden), 0.0) ** 2) / 100

  grad = nnx.jit(nnx.value_and_grad(loss, argnums=nnx.DiffState(0, LORA)))
  results = {}
  for name in ("plain", "blockwise"):
    model = random_model(cfg.replace(attention=name, attention_block=4), lora=lora, seed=7)
    value, grads = grad(model)
    results[name] = (value, nnx.to_pure_dict(grads))
  chex.assert_trees_all_close(results["blockwise"], results["plain"], atol=ATOL, rtol=1e-6)


def test_auto_choice_and_config_errors():
  # CPU: the C++ kernel in float32 (it builds on the test machines), plain in bf16; GPU bf16:
  # cuDNN; GPU fp32 and TPU: blockwise.
  assert cpu_kernels.available()
  assert seam.resolve("auto", jnp.float32, "cpu") == "cpu"
  assert seam.resolve("auto", jnp.bfloat16, "cpu") == "plain"
  assert seam.resolve("auto", jnp.bfloat16, "gpu") == "cudnn"
  assert seam.resolve("auto", jnp.float32, "gpu") == "blockwise"
  assert seam.resolve("auto", jnp.bfloat16, "tpu") == "blockwise"
  assert seam.resolve("blockwise", jnp.float32, "cpu") == "blockwise"
  # A model called without the seam's choice runs XLA's: auto is plain there.
  assert _attention.configured("auto") == "plain"
  assert _attention.configured("blockwise") == "blockwise"
  with pytest.raises(ValueError, match="model.attention"):
    tiny_config(attention="flash")
  # "cpu" is auto's business now: one line that says so.
  with pytest.raises(UserError, match="model.attention: 'cpu' is not a value; use auto"):
    tiny_config(attention="cpu")
  with pytest.raises(ValueError, match="model.attention_block"):
    tiny_config(attention_block=0)


def test_blockwise_backward_temporaries_shrink():
  # Compiled grad programs at T = 512: plain holds [T, T] scores and probabilities; the scan
  # holds one [T, 64] block at a time, the fenced unrolled loop (the model's) less than plain.
  b, k, g, t, hd = 1, 1, 2, 512, 16
  q, keys, values, weights = _inputs(b, k, g, t, t, hd, seed=0)
  valid = jnp.ones((b, t), bool)
  fns = {"plain": lambda q, kk, v: _attention.attend(q, kk, v, _attention.visible(valid, 0, t)),
         "scan": lambda q, kk, v: _attention.blockwise(q, kk, v, valid, 0, block=64, loop="scan"),
         "unrolled": lambda q, kk, v: _attention.blockwise(q, kk, v, valid, 0, block=64)}
  temp = {name: jax.jit(lambda q, kk, v, w, fn=fn: _value_and_grads(fn, q, kk, v, w)).lower(
      q, keys, values, weights).compile().memory_analysis().temp_size_in_bytes
      for name, fn in fns.items()}
  scores = b * k * g * t * t * 4
  print(f"\ngrad temporaries at T={t}, MiB: " + ", ".join(f"{n} {v / 2**20:.1f}" for n, v in temp.items())
        + f" (one [T, T] float32 score matrix: {scores / 2**20:.1f})")
  assert temp["plain"] >= scores
  assert temp["scan"] < scores / 2
  assert temp["unrolled"] < temp["plain"]


def test_training_config_reaches_the_model():
  from epgrpo_jax.training.config import ModelRunConfig
  from epgrpo_jax.training.build import with_runtime_options
  model = random_model(tiny_config())
  section = ModelRunConfig(remat=True, attention="blockwise", attention_block=64)
  cfg = with_runtime_options(model, section).cfg
  assert (cfg.remat, cfg.attention, cfg.attention_block) == (True, "blockwise", 64)
  with pytest.raises(ValueError, match="model.attention"):
    ModelRunConfig(attention="flash")
  with pytest.raises(ValueError, match="model.attention_block"):
    ModelRunConfig(attention_block=0)
