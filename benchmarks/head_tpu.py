"""The LM head's chunked log-prob backward on a TPU slice, its rows split over the chips:
compiled (never run) with the real TPU compiler (libtpu), as the update's gradient program
runs it per micro-batch, with and without token chunks within each chip's rows.

`python benchmarks/head_tpu.py [--topology v5e:2x4 --chips-per-host 2x4] [--rows 32]
[--tokens 2304] [--hidden 2048] [--vocab 151936]`

Defaults: the Qwen2.5-3B update's micro-batch on v5e-8 with FSDP over 8 (32 packed rows of
2,304 tokens, bf16, the head frozen as under LoRA: the gradient wrt the hidden states). Per
variant, one line of `tools.tpu_costs.row` (memory, FLOPs by trip count, XLA's bytes
accessed, HBM bytes per instruction, bytes all-gathered, estimated time, MFU):
- one block: token chunks of the flattened rows (`row_blocks=1`, the layout before), the head
  split over fsdp as the model holds it;
- row blocks: chunks within each chip's rows (`row_blocks` = chips), the head split (as the
  trainer runs it);
- row blocks, head gathered: the head an argument already replicated on every chip;
- row blocks, head constrained: the head split, gathered by a sharding constraint inside the
  program (where the compiler places that gather);
- row blocks, head gathered once: the head split, gathered as the trainer's programs now do
  (`parallel.sharding.gathered_once`: the constraint, an optimization barrier, the constraint).
docs/distributed.md ("The head's chunks on a split batch") records the figures.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from epgrpo_jax.core.token_stats import token_logprob_entropy
from epgrpo_jax.parallel.sharding import gathered_once
from epgrpo_jax.tools import tpu_costs


def compiled_head(mesh: Mesh, shape: tuple[int, int, int, int], blocks: int, gathered: bool,
                  constrained: str = ""):
  """d hidden of sum(c * logp) + 0.01 sum(c * entropy), the rows split over the mesh; the head
  gathered inside the program by `constrained` ("constraint", "once": `gathered_once`)."""
  b, t, d, v = shape
  rows = NamedSharding(mesh, PartitionSpec("fsdp"))
  head = NamedSharding(mesh, PartitionSpec(None if gathered else "fsdp", None))
  args = (jax.ShapeDtypeStruct((b, t, d), jnp.bfloat16, sharding=rows),
          jax.ShapeDtypeStruct((d, v), jnp.bfloat16, sharding=head),
          jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=rows),
          jax.ShapeDtypeStruct((b, t), jnp.float32, sharding=rows))

  def loss(h, w, y, c):
    whole = NamedSharding(mesh, PartitionSpec())
    if constrained == "constraint":  # a sharding constraint alone (reverted from the trainer)
      w = jax.lax.with_sharding_constraint(w, whole)
    elif constrained == "once":  # the trainer's `Kernels.constrain(head, "head")`
      w = gathered_once(w, whole)
    logp, entropy = token_logprob_entropy(h, w, y, row_blocks=blocks)
    return jnp.sum(c * logp) + 0.01 * jnp.sum(c * entropy)

  return jax.jit(jax.grad(loss)).lower(*args).compile()


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--topology", default="v5e:2x4")
  p.add_argument("--chips-per-host", default="2x4")
  p.add_argument("--rows", type=int, default=32)
  p.add_argument("--tokens", type=int, default=2304)
  p.add_argument("--hidden", type=int, default=2048)
  p.add_argument("--vocab", type=int, default=151936)
  p.add_argument("--only", default="", help="variants to compile, separated by ; (default: all)")
  args = p.parse_args()
  jax.config.update("jax_enable_compilation_cache", False)
  devices = tpu_costs.topology_devices(args.topology, args.chips_per_host)
  mesh = Mesh(np.array(devices), ("fsdp",))
  shape = (args.rows, args.tokens, args.hidden, args.vocab)
  print(f"{args.topology}: {len(devices)} chips; rows x tokens x hidden x vocab = {shape}")
  print(tpu_costs.HEADER)
  variants = (("one block", 1, False, ""), ("row blocks", len(devices), False, ""),
              ("row blocks, head gathered", len(devices), True, ""),
              ("row blocks, head constrained", len(devices), False, "constraint"),
              ("row blocks, head gathered once", len(devices), False, "once"))
  only = set(args.only.split(";")) if args.only else None
  for name, blocks, gathered, constrained in variants:
    if only and name not in only:
      continue
    start = time.perf_counter()
    m = tpu_costs.measure(name, compiled_head(mesh, shape, blocks, gathered, constrained),
                          tpu_costs.chip_of(devices))
    print(tpu_costs.row(m), f"[{time.perf_counter() - start:.0f}s]", flush=True)


if __name__ == "__main__":
  main()
