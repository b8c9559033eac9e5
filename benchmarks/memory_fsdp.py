"""Compiled per-device memory of the RL train step on 8 devices: replicated vs FSDP.

Builds the Qwen2.5 presets abstractly (`nnx.eval_shape`: no weights, nothing
allocated), lays them out with the project's partition rules
(`epgrpo_jax.parallel.sharding`) on a mesh, compiles (never runs) the jitted update
program of `epgrpo_jax.training.programs.StepFunctions` -- the forward and backward pass
of the clipped-surrogate loss plus the AdamW update, the peak of a step -- and
prints XLA's `memory_analysis()` of one device's program as a table (with
remat, the larger of the update's two programs).

Defaults are the paper's setup (configs/qwen2.5-3b-epgrpo.yaml): LoRA rank 32
on every projection, bf16 compute and base weights, fp32 adapters and Adam
state, 16 prompts x 8 completions = 128 sequences per update, prompts of up
to 1024 and completions of up to 2048 tokens, decoder layers rematerialised
(`model.remat=true`). It runs on fake CPU devices
(`--xla_force_host_platform_device_count`, set here); with remat, the update
is compiled as the trainer compiles it on CPU, with XLA:CPU's memory-optimised
scheduler and without CSE (`programs.cpu_remat_options`); the CPU backend computes bf16 dots in float32, so its
temporaries overstate what a GPU needs.

  python benchmarks/memory_fsdp.py                         # 3B and 7B, data=8 vs fsdp=8
  python benchmarks/memory_fsdp.py --presets qwen2.5-7b --meshes 1,8,1 --grad-accumulation 4
  python benchmarks/memory_fsdp.py --attention plain       # the materialised-scores attention
  python benchmarks/memory_fsdp.py --presets qwen2.5-3b --meshes 1,1,1 --packed-rows 8 \
      --prompts 8 --generations 8 --prompt-len 256 --completion-len 768   # one GPU, packed rows
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from epgrpo_jax.core import losses
from epgrpo_jax.parallel import sharding
from epgrpo_jax.training import batches, objective, programs  # noqa: E402
from epgrpo_jax.training.packing import PackedRows  # noqa: E402
from epgrpo_jax.models import LoraConfig, Qwen2, preset  # noqa: E402

import _common as C  # noqa: E402

GIB = 2 ** 30


def abstract_policy(name: str, *, dtype: str, lora_rank: int, remat: bool,
                    full_finetune: bool, attention: str = "blockwise",
                    attention_block: int = 512) -> programs.Policy:
  """The preset's policy split as shapes only (no weights are made)."""
  cfg = preset(name, dtype=dtype, param_dtype=dtype, remat=remat, attention=attention,
               attention_block=attention_block)
  lora = None if full_finetune else LoraConfig(rank=lora_rank, alpha=2.0 * lora_rank)
  model = nnx.eval_shape(lambda: Qwen2(cfg, lora=lora, rngs=nnx.Rngs(0)))
  if full_finetune:  # the trainable copy is fp32, the reference stays in the base dtype
    graphdef, trainable, frozen = nnx.split(model, nnx.Param, ...)
    reference = trainable
    trainable = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), trainable)
    return programs.Policy(graphdef, trainable, frozen, reference)
  graphdef, trainable, frozen = nnx.split(model, nnx.LoRAParam, ...)
  return programs.Policy(graphdef, trainable, frozen, None)


def with_shardings(tree, shardings):
  """ShapeDtypeStructs of `tree` carrying `shardings` (None stays None)."""
  if tree is None:
    return None
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, shardings)


def update_memory(policy: programs.Policy, mesh, *, rows: int, prompt_len: int,
                  completion_len: int, remat: bool, packed_rows: int = 0, row_length: int = 0):
  """`memory_analysis()` of the update's compiled program(s) (`StepFunctions.update_memory`)
  for `rows` sequences on `mesh`: one program, or with remat the gradient and apply programs.
  `packed_rows` > 0: the forward runs over that many packed rows of `row_length` tokens
  (`train.packing`) instead of the padded rows."""
  tx, _ = objective.make_optimizer(5e-6, 1000, warmup_ratio=0.1, weight_decay=1e-3,
                               max_grad_norm=1.0)
  s = programs.StepShardings.create(policy, tx, mesh)
  fns = programs.StepFunctions(policy.graphdef, tx, loss_cfg=losses.LossConfig(), temperature=1.0,
                            on_policy=True, shardings=s, remat=remat, model_cfg=policy.model().cfg)
  row = lambda n, dt: jax.ShapeDtypeStruct((rows, n), dt, sharding=s.rows)
  packing = None
  if packed_rows:
    slots = lambda: jax.ShapeDtypeStruct((packed_rows, row_length), jnp.int32, sharding=s.rows)
    packing = PackedRows(slots(), slots(), slots(), slots(), row(completion_len, jnp.int32))
  batch = batches.UpdateBatch(
      rollout=batches.CompletionBatch(row(prompt_len, jnp.int32), row(prompt_len, jnp.bool_),
                            row(completion_len, jnp.int32), row(completion_len, jnp.bool_),
                            packing),
      logp_old=row(completion_len, jnp.float32), logp_ref=row(completion_len, jnp.float32),
      advantage=row(completion_len, jnp.float32))
  opt_state = jax.eval_shape(tx.init, policy.trainable)
  args = (with_shardings(policy.trainable, s.trainable), with_shardings(opt_state, s.opt_state),
          with_shardings(policy.frozen, s.frozen), batch, None)
  return fns.update_memory(*args[:4]), s


def bytes_per_device(tree, shardings) -> int:
  """Bytes of one device's shards of `tree` laid out by `shardings`."""
  return sum(math.prod(sh.shard_shape(x.shape)) * x.dtype.itemsize
             for x, sh in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--presets", default="qwen2.5-3b,qwen2.5-7b")
  parser.add_argument("--meshes", nargs="+", default=["8,1,1", "1,8,1"],
                      help="data,fsdp,tensor sizes (8 devices in all)")
  parser.add_argument("--prompts", type=int, default=16, help="prompts per step")
  parser.add_argument("--generations", type=int, default=8, help="completions per prompt")
  parser.add_argument("--mini-batches", type=int, default=1, help="train.mini_batches")
  parser.add_argument("--grad-accumulation", type=int, default=1, help="train.grad_accumulation")
  parser.add_argument("--prompt-len", type=int, default=1024)
  parser.add_argument("--completion-len", type=int, default=2048)
  parser.add_argument("--lora-rank", type=int, default=32)
  parser.add_argument("--packed-rows", type=int, default=0,
                      help="train.packing: packed rows per update program (0: padded rows)")
  parser.add_argument("--row-length", type=int, default=4096, help="train.packing_length")
  parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
  parser.add_argument("--no-remat", action="store_true")
  parser.add_argument("--full-finetune", action="store_true")
  parser.add_argument("--attention", default="blockwise", choices=("plain", "blockwise"),
                      help="model.attention (cuDNN's memory is not visible on CPU; blockwise "
                           "stands in for a memory-efficient kernel)")
  parser.add_argument("--attention-block", type=int, default=512, help="model.attention_block")
  args = parser.parse_args()

  rows = args.prompts * args.generations // (args.mini_batches * args.grad_accumulation)
  packed = (f", packed into {args.packed_rows} rows of {args.row_length} tokens"
            if args.packed_rows else "")
  print(f"gradient program: {rows} sequences x ({args.prompt_len} prompt + {args.completion_len} "
        f"completion) tokens{packed}, {'full fine-tuning' if args.full_finetune else f'LoRA rank {args.lora_rank}'}, "
        f"{args.dtype}, remat {'off' if args.no_remat else 'on'}, {args.attention} attention"
        f"{f' (blocks of {args.attention_block})' if args.attention == 'blockwise' else ''}; "
        f"{jax.device_count()} "
        f"{jax.devices()[0].platform} devices; GiB per device from memory_analysis()")
  header = (f"{'preset':<12} {'mesh (d,f,t)':<13} {'seq/dev':>7} {'weights':>8} {'args':>8} "
            f"{'temp':>8} {'out':>8} {'alias':>8} {'peak':>8} {'compile':>8}")
  print(header)
  print("-" * len(header))
  for name in args.presets.split(","):
    policy = abstract_policy(name, dtype=args.dtype, lora_rank=args.lora_rank,
                             remat=not args.no_remat, full_finetune=args.full_finetune,
                             attention=args.attention, attention_block=args.attention_block)
    for spec in args.meshes:
      shape = tuple(int(x) for x in spec.split(","))
      mesh = sharding.make_mesh(sharding.MeshConfig(*shape))
      start = time.perf_counter()
      analyses, s = update_memory(policy, mesh, rows=rows, prompt_len=args.prompt_len,
                                  completion_len=args.completion_len, remat=not args.no_remat,
                                  packed_rows=args.packed_rows, row_length=args.row_length)
      m = max(analyses, key=C.peak_bytes)
      seconds = time.perf_counter() - start
      weights = bytes_per_device(policy.frozen, s.frozen)
      arg, tmp, out = m.argument_size_in_bytes, m.temp_size_in_bytes, m.output_size_in_bytes
      alias, peak = m.alias_size_in_bytes, C.peak_bytes(m)
      shards = mesh.shape["data"] * mesh.shape["fsdp"]
      print(f"{name:<12} {str(shape):<13} {rows // shards:>7} {weights / GIB:>8.2f} "
            f"{arg / GIB:>8.2f} {tmp / GIB:>8.2f} {out / GIB:>8.2f} {alias / GIB:>8.2f} "
            f"{peak / GIB:>8.2f} {seconds:>7.0f}s", flush=True)
  print("weights: frozen base weights held per device; peak = args + temp + out - alias "
        "(donated trainable and optimizer state are aliased to the outputs); with remat the "
        "update is two programs (gradients, then the optimizer step) and the row is the larger")


if __name__ == "__main__":
  main()
