"""A decode step's products, ours (XLA's dot and the packed C++ products) vs torch, same shapes.

The projections and head of one decode step of a Qwen2 preset (default
qwen2.5-0.5b) at `--rows` rows (the sampler's 8 x 8 = 64): x [M, K] times
w [K, N] for q/k/v (one product), o, gate/up (one product), down and the head.
In bfloat16: XLA's bf16 -> float32 dot, our product by a weight packed once
(`kernels.cpu.pack_bf16`) on AMX tiles and with AVX512-BF16 dot products,
where this CPU has them; in float32: XLA's dot and the AVX-512 panels
(`pack_panels`). The peer is torch's `x @ w.T` on w [N, K] (what an nn.Linear
in transformers runs) with 2 threads. Random weights; packing is outside the
timing (the sampler packs once per call). The calls alternate; prints the
median milliseconds and GFLOP/s of each.

  OMP_WAIT_POLICY=PASSIVE python benchmarks/decode_products.py [--dtype bfloat16] [--rows 64]
"""

from __future__ import annotations

import argparse
import functools

import numpy as np


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--preset", default="qwen2.5-0.5b")
  ap.add_argument("--rows", type=int, default=64)
  ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
  ap.add_argument("--runs", type=int, default=9)
  args = ap.parse_args()
  import jax
  import jax.numpy as jnp
  import torch

  from epgrpo_jax.kernels import cpu as cpu_kernels
  from epgrpo_jax.models import PRESETS

  import _common as C

  assert cpu_kernels.available(), "the C++ kernels could not be built (see the warning)"
  cfg, m, dtype = PRESETS[args.preset], args.rows, jnp.dtype(args.dtype)
  d, hd, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
  shapes = {"q/k/v": (d, (cfg.num_heads + 2 * cfg.num_kv_heads) * hd), "o": (cfg.num_heads * hd, d),
            "gate/up": (d, 2 * f), "down": (f, d), "head": (d, cfg.vocab_size)}
  # label: (pack once, product by the packed weight)
  ours = {"xla": (lambda w: w, functools.partial(jnp.dot, preferred_element_type=jnp.float32))}
  if dtype == jnp.bfloat16:
    for unit, ok in (("amx", cpu_kernels.amx_available()), ("avx512", cpu_kernels.pairs_available())):
      if ok:
        ours[unit] = (cpu_kernels.pack_bf16, functools.partial(cpu_kernels.packed_matmul, unit=unit))
  elif cpu_kernels.panels_available():
    ours["panels"] = (lambda w: cpu_kernels.pack_panels([w]), cpu_kernels.panel_matmul)
  torch.set_num_threads(2)
  print(f"{args.preset} decode products, {m} rows, {args.dtype}; {C.machine_line()}; jax "
        f"{jax.__version__}, torch {torch.__version__} with 2 threads; median of {args.runs}")
  rng = np.random.default_rng(0)
  for name, (k, n) in shapes.items():
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((k, n)) * k ** -0.5, dtype)
    calls = {}
    for label, (pack, product) in ours.items():
      if name == "head" and label in ("amx", "avx512"):  # float32 logits, as the sampler's
        product = functools.partial(product, out_dtype=jnp.float32)
      fn, packed = jax.jit(product), pack(w)
      calls[label] = functools.partial(lambda fn, packed: fn(x, packed).block_until_ready(), fn, packed)
    x_t = torch.from_numpy(np.array(x.astype(jnp.float32))).to(getattr(torch, args.dtype))
    w_t = torch.from_numpy(np.asarray(w.astype(jnp.float32)).T.copy()).to(x_t.dtype)

    def theirs():
      with torch.inference_mode():
        return x_t @ w_t.T

    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    for label, call in calls.items():
      got = np.asarray(call(), np.float64)
      assert np.allclose(got, want, rtol=0.05, atol=0.05 * np.abs(want).max()), f"{label} disagrees"
    seconds = C.alternating_medians({**calls, "torch": theirs}, args.runs)
    gflop = 2 * m * k * n / 1e9
    row = "  ".join(f"{label} {t * 1e3:7.2f} ms ({gflop / t:4.0f} GFLOP/s)" for label, t in seconds.items())
    print(f"{name:8s} [{m}, {k}] x [{k}, {n}]: {row}")


if __name__ == "__main__":
  main()
