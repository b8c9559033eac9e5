"""The LM head's log-prob + entropy, counted by XLA: FLOPs, exponentials and temporaries.

Compiles (never runs) `core.token_stats.token_logprob_entropy` forward, its gradient wrt the
hidden states only (LoRA: the head is frozen) and wrt hidden states and head (full
fine-tuning), and prints from the optimized HLO (`models.flops.hlo_counts`: each loop body times
its trip count) the dot FLOPs in units of one head pass (2 N D V) and the exponentials per
logit (N V), with the compiled temporaries (`memory_analysis()`). Defaults: Qwen2.5-3B's
head (D 2,048, V 151,936) over 8 x 4,096 tokens in float32, chunks of 1,024 tokens x 8,192
vocabulary columns (the library's defaults; 151,936 is not a multiple of 8,192, so the last
vocabulary chunk overlaps its predecessor by 2.4%).

  python benchmarks/head_cost.py [--tokens 32768] [--hidden 2048] [--vocab 151936]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from epgrpo_jax.core import token_stats
from epgrpo_jax.models import flops


def program(kind: str, n: int, d: int, v: int, tc: int, vc: int):
  """The compiled program of `kind` (forward | grad_hidden | grad_both) on float32 shapes."""
  fn = lambda h, w, t: token_stats.token_logprob_entropy(h, w, t, token_chunk=tc, vocab_chunk=vc)

  def objective(h, w, t):
    logp, entropy = fn(h, w, t)
    return jnp.sum(logp) + 0.01 * jnp.sum(entropy)

  argnums = {"forward": None, "grad_hidden": 0, "grad_both": (0, 1)}[kind]
  run = fn if argnums is None else jax.grad(objective, argnums)
  args = (jax.ShapeDtypeStruct((1, n, d), jnp.float32), jax.ShapeDtypeStruct((d, v), jnp.float32),
          jax.ShapeDtypeStruct((1, n), jnp.int32))
  return jax.jit(run).lower(*args).compile()


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--tokens", type=int, default=8 * 4096)
  ap.add_argument("--hidden", type=int, default=2048)
  ap.add_argument("--vocab", type=int, default=151936)
  ap.add_argument("--token-chunk", type=int, default=1024)
  ap.add_argument("--vocab-chunk", type=int, default=8192)
  args = ap.parse_args()
  n, d, v = args.tokens, args.hidden, args.vocab
  print(f"jax {jax.__version__} {jax.default_backend()}; N {n} tokens, D {d}, V {v}, float32, "
        f"chunks {args.token_chunk} x {args.vocab_chunk}")
  print(f"{'program':<14}{'TFLOP':>9}{'head passes':>13}{'exp per logit':>15}{'temp GiB':>10}")
  for kind in ("forward", "grad_hidden", "grad_both"):
    compiled = program(kind, n, d, v, args.token_chunk, args.vocab_chunk)
    counts = flops.hlo_counts(compiled.as_text())
    temp = compiled.memory_analysis().temp_size_in_bytes
    print(f"{kind:<14}{counts['dot_flops'] / 1e12:>9.3f}{counts['dot_flops'] / (2 * n * d * v):>13.2f}"
          f"{counts['exp'] / (n * v):>15.2f}{temp / 2**30:>10.3f}")


if __name__ == "__main__":
  main()
