"""Attention without a dense mask: the runs cuDNN gets as lengths and offsets, values and
gradients of the mask-free paths against plain attention on padded and packed rows (odd
lengths), and no [L, L] buffer in the compiled blockwise program at a 4,096-token row."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epgrpo_jax.models import _attention

ATOL = 1e-5


def test_segment_runs_by_hand():
  valid = jnp.asarray([[0, 1, 1, 1, 0, 0, 0],  # padded: one run, slots 1..3
                       [1, 1, 1, 1, 1, 0, 0],  # packed: segments 1 (2 slots), 2 (3 slots)
                       [1, 1, 1, 1, 1, 1, 1],  # three segments, two runs allowed
                       [1, 0, 1, 0, 0, 0, 0]], bool)  # one segment with a hole
  segments = jnp.asarray([[0, 0, 0, 0, 0, 0, 0], [1, 1, 2, 2, 2, 0, 0], [1, 2, 2, 3, 3, 3, 3],
                          [0, 0, 0, 0, 0, 0, 0]], jnp.int32)
  lengths, starts, broken = _attention.segment_runs(valid, segments, 2)
  np.testing.assert_array_equal(lengths, [[3, -1], [2, 3], [1, 2], [1, 1]])
  np.testing.assert_array_equal(starts, [[1, -1, -1], [0, 2, -1], [0, 1, -1], [0, 2, -1]])
  np.testing.assert_array_equal(broken, [False, False, True, True])


def _rows(seed, b, s, packed):
  """Valid slots and segment ids: padded rows (left-padded prompt, completion, right padding)
  or packed rows (contiguous sequences of random lengths, then empty slots)."""
  rng = np.random.default_rng(seed)
  valid, segments = np.zeros((b, s), bool), np.zeros((b, s), np.int32)
  for r in range(b):
    if not packed:
      lo = rng.integers(0, s // 2)
      valid[r, lo:rng.integers(lo + 1, s + 1)] = True
      continue
    at, sid = 0, 1
    while at < s - 1 and rng.random() < 0.85:
      n = int(rng.integers(1, s - at))
      valid[r, at:at + n], segments[r, at:at + n] = True, sid
      at, sid = at + n, sid + 1
  return jnp.asarray(valid), jnp.asarray(segments)


@settings(max_examples=max(1, settings.default.max_examples // 25), deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([2, 13]), st.booleans())
def test_runs_mask_is_the_visibility_of_valid_queries(seed, s, packed):
  """What cuDNN applies to the runs equals `visible` at every valid query (padding queries'
  outputs are zeroed and never read)."""
  valid, segments = _rows(seed, 3, s, packed)
  lengths, starts, broken = _attention.segment_runs(valid, segments, s)
  assert not np.asarray(broken).any()
  want = np.asarray(_attention.visible(valid, 0, s, segments)) & np.asarray(valid)[:, :, None]
  np.testing.assert_array_equal(_attention.runs_visible(lengths, starts, s), want)


PATHS = {
    "cudnn-runs": lambda q, kk, v, valid, seg: _attention.cudnn(
        q, kk, v, valid, 0, implementation="xla", segments_BxS=seg, max_segments=6),
    "blockwise": lambda q, kk, v, valid, seg: _attention.blockwise(q, kk, v, valid, 0, block=4,
                                                                   segments_BxS=seg),
}


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("path", list(PATHS))
def test_values_and_grads_equal_plain(path, packed):
  """GQA (2 KV heads x 2), 13 slots (odd; blocks of 4, the last partial), rows padded or
  packed with sequences of random (odd and even) lengths: outputs and q/k/v gradients at the
  valid queries equal plain attention's; padding queries' outputs are 0 (cuDNN runs) or
  finite (blockwise)."""
  b, k, g, s, hd = 4, 2, 2, 13, 8
  rng = np.random.default_rng(3)
  q, w = (jnp.asarray(rng.standard_normal((b, k, g, s, hd)), jnp.float32) for _ in range(2))
  keys = jnp.asarray(rng.standard_normal((b, k, hd, s)), jnp.float32)
  values = jnp.asarray(rng.standard_normal((b, k, s, hd)), jnp.float32)
  valid, segments = _rows(11 if packed else 12, b, s, packed)
  live = valid[:, None, None, :, None]

  def run(fn):
    out, vjp = jax.vjp(lambda q, kk, v: fn(q, kk, v, valid, segments), q, keys, values)
    return out, vjp(jnp.where(live, w, 0.0))

  plain = lambda q, kk, v, valid, seg: _attention.attend(q, kk, v,
                                                         _attention.visible(valid, 0, s, seg))
  (want, want_grads), (got, got_grads) = run(plain), jax.jit(lambda: run(PATHS[path]))()
  np.testing.assert_allclose(np.where(live, got, 0.0), np.where(live, want, 0.0), atol=ATOL)
  for a, r in zip(got_grads, want_grads):
    np.testing.assert_allclose(a, r, atol=ATOL)
  assert np.isfinite(np.asarray(got)).all()
  if path == "cudnn-runs":
    assert not np.asarray(got)[~np.broadcast_to(np.asarray(live), got.shape)].any()


def test_cudnn_runs_refuse_a_row_they_cannot_express():
  """More sequences in a row than `max_segments`, or a segment with a hole: NaN outputs for
  that row (the update turns non-finite and is skipped), the other rows untouched."""
  q = jnp.ones((2, 1, 1, 6, 8))
  keys, values = jnp.ones((2, 1, 8, 6)), jnp.ones((2, 1, 6, 8))
  valid = jnp.asarray([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]], bool)
  segments = jnp.asarray([[1, 2, 3, 4, 5, 6], [1, 1, 1, 0, 0, 0]], jnp.int32)
  out = _attention.cudnn(q, keys, values, valid, implementation="xla", segments_BxS=segments,
                         max_segments=4)
  assert np.isnan(np.asarray(out[0])).all() and np.isfinite(np.asarray(out[1])).all()
  holes = jnp.asarray([[1, 0, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]], bool)
  out = _attention.cudnn(q, keys, values, holes, implementation="xla")
  assert np.isnan(np.asarray(out[0])).all() and np.isfinite(np.asarray(out[1])).all()


def _square_buffers(hlo_text: str, length: int) -> list[str]:
  """Array shapes in an HLO module with two dimensions of at least `length`, or at least
  `length` squared elements."""
  found = set()
  for dims in re.findall(r"\b[a-z]+[0-9]*\[([0-9,]+)\]", hlo_text):
    sizes = [int(x) for x in dims.split(",")]
    if sum(x >= length for x in sizes) >= 2 or np.prod(sizes) >= length * length:
      found.add(dims)
  return sorted(found)


def _update_program(fn, length: int):
  """Compiled forward + backward of `fn` over one packed row of `length` tokens (GQA)."""
  b, k, g, hd = 1, 1, 2, 16
  args = (jax.ShapeDtypeStruct((b, k, g, length, hd), jnp.float32),
          jax.ShapeDtypeStruct((b, k, hd, length), jnp.float32),
          jax.ShapeDtypeStruct((b, k, length, hd), jnp.float32),
          jax.ShapeDtypeStruct((b, length), jnp.bool_), jax.ShapeDtypeStruct((b, length), jnp.int32))

  def loss(q, kk, v, valid, seg):
    return jnp.sum(fn(q, kk, v, valid, seg) ** 2)

  return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()


def test_no_square_buffer_in_the_blockwise_update_at_4096_tokens():
  """The blockwise path builds each block's mask from segment ids and slot numbers inside
  the loop: its compiled forward + backward over a 4,096-token packed row holds no array
  with two dimensions of 4,096 or 4,096^2 elements. The plain path, compiled alike, does
  (so the check can fail)."""
  length = 4096
  blockwise = _update_program(lambda q, kk, v, valid, seg: _attention.blockwise(
      q, kk, v, valid, 0, block=512, segments_BxS=seg), length)
  assert _square_buffers(blockwise.as_text(), length) == []
  plain = _update_program(lambda q, kk, v, valid, seg: _attention.attend(
      q, kk, v, _attention.visible(valid, 0, length, seg)), length)
  assert _square_buffers(plain.as_text(), length)
  assert plain.memory_analysis().temp_size_in_bytes >= length * length * 4


def test_cudnn_update_traces_without_a_mask_array(monkeypatch):
  """Forward + backward of the cuDNN path over two packed 4,096-token rows, traced (not run:
  no GPU here) with jax's GPU probes answering as a Hopper GPU with cuDNN 9.10: the arguments
  pass jax's own checks of the packed layout (ranks, dtypes, lengths and offsets), the
  program is cuDNN's fused forward and backward with the padding-causal mask and no bias,
  and it holds no [L, L] array. Whether the kernel computes the right values is checked
  only on a GPU (benchmarks/gpu.sh)."""
  from jax._src.cudnn import fused_attention_stablehlo as fa

  monkeypatch.setattr(fa, "check_cudnn_version", lambda: 91000)
  monkeypatch.setattr(fa, "check_compute_capability", lambda capability: True)
  monkeypatch.setattr(fa, "is_cuda_compute_capability_equal", lambda capability: False)
  length, bf16 = 4096, jnp.bfloat16
  args = (jax.ShapeDtypeStruct((2, 2, 6, length, 128), bf16),
          jax.ShapeDtypeStruct((2, 2, 128, length), bf16),
          jax.ShapeDtypeStruct((2, 2, length, 128), bf16),
          jax.ShapeDtypeStruct((2, length), jnp.bool_), jax.ShapeDtypeStruct((2, length), jnp.int32))

  def loss(q, kk, v, valid, seg):
    out = _attention.cudnn(q, kk, v, valid, 0, segments_BxS=seg, max_segments=8)
    return jnp.sum(out.astype(jnp.float32) ** 2)

  text = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(*args))
  assert "dot_product_attention_fwd_wrapper" in text and "dot_product_attention_bwd_wrapper" in text
  assert "PADDING_CAUSAL" in text and "variadic_args=(False, False)" in text
  assert _square_buffers(text, length) == []


def test_trainer_refuses_packed_rows_with_more_sequences_than_cudnn_takes():
  from epgrpo_jax.io.errors import UserError
  from epgrpo_jax.training.packing import check_segments, pack

  ones = np.ones((3, 2), bool)
  packing = pack(np.full((3, 2), 5), ones, np.full((3, 2), 6), ones, row_length=16)
  assert int(np.asarray(packing.segments).max()) == 3  # three sequences of 3 tokens, one row
  check_segments(packing, 3)
  with pytest.raises(UserError, match=r"model.attention_segments: a packed row holds 3 sequences"):
    check_segments(packing, 2)
