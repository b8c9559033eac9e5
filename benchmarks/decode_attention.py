"""One layer's decode attention: our XLA formulation vs torch, same shapes, one run.

The shape of the sampler benchmark's decode steps (bench-tiny: 64 rows, 2 KV
heads x 2 query heads each, head dim 64, a 160-slot cache): scores
`[2, 64] x [64, 160]` per row and KV head, softmax, then `[2, 160] x [160, 64]`.
Ours is `epgrpo_jax.models._qwen2`'s code path on the cache layouts it keeps
(keys [B, K, Hd, S], values [B, K, S, Hd]), timed inside a `fori_loop` of 100
iterations so that dispatch does not count; torch runs `bmm`, softmax, `bmm`
with 2 threads. Prints milliseconds per layer for each, and their ratio.

  python benchmarks/decode_attention.py [--rows 64] [--slots 160] [--runs 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

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

  def attend(q, keys, values):  # as in _qwen2.Attention with a cache
    scores = jnp.einsum("bkgth,bkhs->bkgts", q, keys, preferred_element_type=jnp.float32)
    scores = jnp.where(allowed[:, None, None], scores / jnp.sqrt(hd).astype(jnp.float32), -1e30)
    return jnp.einsum("bkgts,bksh->bkgth", jax.nn.softmax(scores, axis=-1), values)

  iters = 100

  @jax.jit
  def loop(q, keys, values):
    return jax.lax.fori_loop(0, iters, lambda i, acc: acc + attend(q + 1e-9 * acc, keys, values),
                             jnp.zeros_like(q))

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
  mine = np.asarray(jax.jit(attend)(qj, kj, vj))
  assert np.allclose(mine, ref, atol=1e-4), "the two formulations disagree"

  def per_layer_ms(fn) -> float:
    fn()
    times = []
    for _ in range(args.runs):
      start = time.perf_counter()
      fn()
      times.append(time.perf_counter() - start)
    return statistics.median(times) / iters * 1e3

  ours_ms = per_layer_ms(lambda: loop(qj, kj, vj).block_until_ready())
  theirs_ms = per_layer_ms(theirs)
  print(f"decode attention, {b} rows x {k} KV heads x {g} queries, head dim {hd}, {s} slots; "
        f"jax {jax.__version__}, torch {torch.__version__} with 2 threads")
  print(f"ours (XLA)    {ours_ms:.3f} ms per layer")
  print(f"torch (bmm)   {theirs_ms:.3f} ms per layer")
  print(f"ratio ours / torch time: {ours_ms / theirs_ms:.2f}x")


if __name__ == "__main__":
  main()
