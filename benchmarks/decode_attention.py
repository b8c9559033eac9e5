"""One layer's decode attention: ours (XLA, and the C++ CPU kernel) vs torch, same shapes.

The shape of the sampler benchmark's decode steps (bench-tiny: 64 rows, 2 KV
heads x 2 query heads each, head dim 64, a 160-slot cache): scores
`[2, 64] x [64, 160]` per row and KV head, softmax, then `[2, 160] x [160, 64]`.
Ours twice: the model's XLA attention (`models.attend`) and the sampler's C++
decode kernel (`kernels.cpu`), on the cache layouts the model keeps
(keys [B, K, Hd, S], values [B, K, S, Hd]), each timed inside a `fori_loop` of
100 iterations so that dispatch does not count; torch runs `bmm`, softmax,
`bmm` with 2 threads. The three alternate; prints the median milliseconds per
layer of each. The loop reads the same cache every iteration, so at this size
it stays in the CPU's caches: the sampler's steps, which read every layer's
cache once, see less bandwidth.

  python benchmarks/decode_attention.py [--rows 64] [--slots 160] [--runs 7]
"""

from __future__ import annotations

import argparse

import numpy as np


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--rows", type=int, default=64)
  ap.add_argument("--slots", type=int, default=160)
  ap.add_argument("--kv-heads", type=int, default=2)
  ap.add_argument("--groups", type=int, default=2, help="query heads per KV head")
  ap.add_argument("--head-dim", type=int, default=64)
  ap.add_argument("--runs", type=int, default=7)
  args = ap.parse_args()
  import jax
  import jax.numpy as jnp
  import torch

  b, k, g, hd, s = args.rows, args.kv_heads, args.groups, args.head_dim, args.slots
  rng = np.random.default_rng(0)
  q = rng.standard_normal((b, k, g, 1, hd), np.float32)
  keys = rng.standard_normal((b, k, hd, s), np.float32)
  values = rng.standard_normal((b, k, s, hd), np.float32)
  allowed = np.ones((b, 1, s), bool)

  from epgrpo_jax.kernels import cpu as cpu_kernels

  from epgrpo_jax.models import attend

  import _common as C

  def xla(q, keys, values):  # the model's attention with a cache
    return attend(q, keys, values, allowed)

  def kernel(q, keys, values):  # the sampler's decode attention on one CPU device
    return cpu_kernels.decode_attention(q[:, :, :, 0], keys, values, allowed[:, 0], s)[:, :, :, None]

  iters = 100

  def looped(fn):
    return jax.jit(lambda q, keys, values: jax.lax.fori_loop(
        0, iters, lambda i, acc: acc + fn(q + 1e-9 * acc, keys, values), jnp.zeros_like(q)))

  qj, kj, vj = jnp.asarray(q), jnp.asarray(keys), jnp.asarray(values)
  torch.set_num_threads(2)
  qt = torch.from_numpy(q.reshape(b * k, g, hd).copy())
  kt = torch.from_numpy(keys.reshape(b * k, hd, s).copy())
  vt = torch.from_numpy(values.reshape(b * k, s, hd).copy())

  def theirs():
    with torch.inference_mode():
      for _ in range(iters):
        out = torch.bmm(torch.softmax(torch.bmm(qt, kt) / hd ** 0.5, dim=-1), vt)
    return out

  ref = theirs().numpy().reshape(b, k, g, 1, hd)
  assert cpu_kernels.available(), "the C++ kernel could not be built (see the warning)"
  for fn in (xla, kernel):
    assert np.allclose(np.asarray(jax.jit(fn)(qj, kj, vj)), ref, atol=1e-4), "formulations disagree"

  xla_loop, kernel_loop = looped(xla), looped(kernel)
  seconds = C.alternating_medians({"xla": lambda: xla_loop(qj, kj, vj).block_until_ready(),
                                   "kernel": lambda: kernel_loop(qj, kj, vj).block_until_ready(),
                                   "torch": theirs}, args.runs)
  xla_ms, kernel_ms, theirs_ms = (t / iters * 1e3 for t in seconds.values())
  print(f"decode attention, {b} rows x {k} KV heads x {g} queries, head dim {hd}, {s} slots; "
        f"jax {jax.__version__}, torch {torch.__version__} with 2 threads")
  print(f"ours, XLA         {xla_ms:.3f} ms per layer  ({xla_ms / theirs_ms:.2f}x torch's time)")
  print(f"ours, C++ kernel  {kernel_ms:.3f} ms per layer  ({kernel_ms / theirs_ms:.2f}x torch's time)")
  print(f"torch (bmm)       {theirs_ms:.3f} ms per layer")


if __name__ == "__main__":
  main()
