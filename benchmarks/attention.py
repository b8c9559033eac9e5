"""One layer's training attention, forward + backward: plain vs blockwise vs cuDNN vs the C++
kernel, time and memory.

The causal, left-padded attention of the scoring and update passes (`models._attention`)
at a model's head shapes (`--preset`: query heads, KV heads, head dim), `--rows`
sequences of `--tokens` tokens, a quarter of each row's tokens left padding. Each
implementation's `jax.grad` of a weighted sum of its output is jitted and compiled;
prints per implementation the median milliseconds of forward + backward (alternating
runs), TFLOP/s (4 matmuls of T x T x Hd forward, 8 backward, causal half not
skipped, as plain computes them) and the compiled program's temporaries from
`memory_analysis()`. cuDNN runs only where JAX sees a GPU and the dtype is bf16/fp16; the
C++ kernel (`model.attention=cpu`) on CPU in float32, its inputs transposed to its layout
inside the timed program (the model hands it that layout without transposes).
Also checks that the implementations agree (float32: 1e-5; bf16: 2e-2).

  python benchmarks/attention.py [--preset qwen2.5-1.5b] [--rows 4] [--tokens 4096]
      [--dtype bfloat16] [--block 512] [--runs 5]
"""

from __future__ import annotations

import argparse

import numpy as np


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--preset", default="qwen2.5-1.5b")
  ap.add_argument("--rows", type=int, default=4)
  ap.add_argument("--tokens", type=int, default=4096)
  ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
  ap.add_argument("--block", type=int, default=512, help="model.attention_block")
  ap.add_argument("--runs", type=int, default=5)
  args = ap.parse_args()
  import jax
  import jax.numpy as jnp

  from epgrpo_jax.kernels import cpu as cpu_kernels
  from epgrpo_jax.models import _attention, as_dtype, preset

  import _common as C

  cfg = preset(args.preset)
  b, t, hd = args.rows, args.tokens, cfg.head_dim
  k, g = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
  dtype = as_dtype(args.dtype)
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((b, k, g, t, hd)), dtype)
  keys = jnp.asarray(rng.standard_normal((b, k, hd, t)), dtype)
  values = jnp.asarray(rng.standard_normal((b, k, t, hd)), dtype)
  weights = jnp.asarray(rng.standard_normal((b, k, g, t, hd)), dtype)
  valid = jnp.asarray(np.arange(t)[None] >= np.arange(b)[:, None] * (t // 4) // max(b - 1, 1))

  impls = {
      "plain": lambda q, kk, v: _attention.attend(q, kk, v, _attention.visible(valid, 0, t)),
      "blockwise": lambda q, kk, v: _attention.blockwise(q, kk, v, valid, 0, block=args.block),
  }
  if jax.default_backend() == "gpu" and args.dtype != "float32":
    impls["cudnn"] = lambda q, kk, v: _attention.cudnn(q, kk, v, valid, 0)
  if jax.default_backend() == "cpu" and args.dtype == "float32" and cpu_kernels.available():
    segments = jnp.zeros(valid.shape, jnp.int32)
    impls["cpu"] = lambda q, kk, v: cpu_kernels.causal_attention(
        q.transpose(0, 3, 1, 2, 4), kk.transpose(0, 3, 1, 2), v.transpose(0, 2, 1, 3), valid,
        segments).transpose(0, 2, 3, 1, 4)

  def grad_program(fn):
    def loss(q, kk, v):
      return jnp.sum((fn(q, kk, v) * weights).astype(jnp.float32))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

  programs, temps, outs = {}, {}, {}
  for name, fn in impls.items():
    try:
      compiled = grad_program(fn).lower(q, keys, values).compile()
    except Exception as e:  # noqa: BLE001 (cuDNN rejects some shapes: report, go on)
      print(f"{name}: failed to compile: {type(e).__name__}: {str(e)[:200]}")
      continue
    programs[name] = compiled
    temps[name] = compiled.memory_analysis().temp_size_in_bytes
    outs[name] = compiled(q, keys, values)
  tol = 1e-5 if args.dtype == "float32" else 2e-2
  real = np.asarray(_attention.visible(valid, 0, t).any(-1))  # cuDNN differs on unseen rows
  for name, out in outs.items():
    if name == "plain":
      continue
    dq_plain = np.asarray(outs["plain"][1][0], np.float32)
    dq = np.asarray(out[1][0], np.float32)
    sel = np.broadcast_to(real[:, None, None, :, None], dq.shape)
    err = np.abs(dq[sel] - dq_plain[sel]).max() / max(np.abs(dq_plain[sel]).max(), 1e-9)
    print(f"{name} vs plain: max relative difference of dq {err:.1e}"
          + ("" if err < tol else f"  ABOVE {tol:g}"))
  seconds = C.alternating_medians(
      {name: lambda p=p: jax.block_until_ready(p(q, keys, values)) for name, p in programs.items()},
      args.runs)
  flops = 12 * b * cfg.num_heads * t * t * hd
  print(f"attention forward + backward, {args.preset} heads ({cfg.num_heads} query, {k} KV, head dim "
        f"{hd}), {b} rows x {t} tokens, {args.dtype}, {jax.devices()[0].device_kind}")
  for name, s in seconds.items():
    print(f"  {name:<10} {s * 1e3:9.2f} ms  {flops / s / 1e12:7.2f} TFLOP/s  temporaries "
          f"{temps[name] / 2**30:7.3f} GiB  ({s / seconds['plain']:.2f}x plain's time)")


if __name__ == "__main__":
  main()
