"""Compiled memory of log-prob + entropy, forward and backward: chunked vs naive.

Compiles (never runs) `value_and_grad` of `sum(logp + entropy)` wrt hidden and
head for both implementations on abstract shapes, and prints XLA's
`memory_analysis()` side by side. Defaults are Qwen2.5-3B's LM head over a
batch of 8 x 4096 tokens, float32 hidden/head and float32 math.

With `--dtype bfloat16` on the CPU backend, XLA's bf16 float-normalisation
runs each chunk's dynamic-slice in float32 and hoists the conversion of the
whole head (and hidden) out of the loops, adding ~1.4 GiB of temp memory that
is a CPU-backend artifact, not part of the algorithm.

  python benchmarks/logprob_memory.py [--dtype bfloat16] [--batch 8] [--tokens 4096]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from epgrpo_jax.core import token_stats

GIB = 2 ** 30


def compile_grad(fn, batch: int, tokens: int, hidden: int, vocab: int, dtype):
  def objective(h_BxTxD, w_DxV, t_BxT):
    logp_BxT, entropy_BxT = fn(h_BxTxD, w_DxV, t_BxT)
    return jnp.sum(logp_BxT + entropy_BxT)

  args = (jax.ShapeDtypeStruct((batch, tokens, hidden), dtype),
          jax.ShapeDtypeStruct((hidden, vocab), dtype),
          jax.ShapeDtypeStruct((batch, tokens), jnp.int32))
  start = time.perf_counter()
  compiled = jax.jit(jax.value_and_grad(objective, argnums=(0, 1))).lower(*args).compile()
  return compiled.memory_analysis(), time.perf_counter() - start


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--tokens", type=int, default=4096)
  parser.add_argument("--hidden", type=int, default=2048)
  parser.add_argument("--vocab", type=int, default=151_936)
  parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  parser.add_argument("--vocab-chunk", type=int, default=8192)
  parser.add_argument("--token-chunk", type=int, default=1024)
  a = parser.parse_args()
  dtype = jnp.dtype(a.dtype)

  chunked = lambda h, w, t: token_stats.token_logprob_entropy(
      h, w, t, vocab_chunk=a.vocab_chunk, token_chunk=a.token_chunk)
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}; B={a.batch} T={a.tokens} "
        f"D={a.hidden} V={a.vocab}; hidden/head {a.dtype}, float32 math; "
        f"chunks: {a.token_chunk} tokens x {a.vocab_chunk} vocab")
  rows = {}
  for name, fn in (("chunked", chunked), ("naive", token_stats.naive_token_logprob_entropy)):
    mem, seconds = compile_grad(fn, a.batch, a.tokens, a.hidden, a.vocab, dtype)
    rows[name] = mem
    print(f"compiled {name} in {seconds:.1f} s")
  fields = ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes",
            "alias_size_in_bytes", "generated_code_size_in_bytes")
  print(f"{'bytes':<30}{'chunked':>18}{'naive':>18}{'naive/chunked':>15}")
  for field in fields:
    c, n = getattr(rows["chunked"], field), getattr(rows["naive"], field)
    ratio = f"{n / c:.1f}x" if c else "-"
    print(f"{field:<30}{c:>18,}{n:>18,}{ratio:>15}")
  c, n = rows["chunked"].temp_size_in_bytes, rows["naive"].temp_size_in_bytes
  print(f"temp: chunked {c / GIB:.3f} GiB, naive {n / GIB:.3f} GiB; "
        f"chunked <= 1 GiB: {c <= GIB}")


if __name__ == "__main__":
  main()
