"""The RL update on an accelerator: packed rows, MFU by the one FLOP model, peak memory, and the
update's device time split into attention, LM head and the rest.

Random weights of a Qwen2.5 preset (bf16 by default, LoRA rank 32 on every projection,
decoder layers rematerialised), synthetic sequences of `--prompt-len` + `--completion-len`
tokens packed into `--rows` rows of `--row-length` tokens (`training.packing.pack`, as
`train.packing` does), and the trainer's fused on-policy update (`train.fused_update`:
reference forward, scoring forward, advantage, loss, backward, AdamW; with remat the
gradient and apply programs). Prints the median step time, the update's model FLOPs
(`epgrpo_jax.models.flops`, the reference forward included) and MFU, the device's peak
memory in use (`memory_stats()`; on a CPU the compiled programs' footprint instead), and the
device time of one profiled step (`jax.profiler`) by the name scope of each op:
"attention" (the attention core, forward and backward), "lm_head" (log-prob and entropy
over the vocabulary) and the rest (projections, MLP, norms, optimizer, ...).

  python benchmarks/update_gpu.py --preset qwen2.5-3b [--rows 8] [--row-length 4096] \\
      [--prompt-len 256] [--completion-len 768] [--steps 3] [--peak-tflops 989]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import _common as C
import _profile as prof
from epgrpo_jax.core import advantages, losses
from epgrpo_jax.models import LoraConfig, Qwen2, flops, preset
from epgrpo_jax.parallel import sharding
from epgrpo_jax.training import batches, objective, programs
from epgrpo_jax.training.packing import pack

SCOPES = ("attention", "lm_head")


def packed_rollout(rows: int, row_length: int, prompt_len: int, completion_len: int,
                   vocab: int, seed: int = 0):
  """(CompletionBatch with its packing, prompts P, samples G): as many sequences as fill `rows` rows."""
  per_row = row_length // (prompt_len + completion_len - 1)
  if per_row < 1:
    raise SystemExit(f"--row-length {row_length}: shorter than one sequence")
  count = rows * per_row
  samples = next(g for g in (8, 4, 2, 1) if count % g == 0)
  rng = np.random.default_rng(seed)
  prompt_ids = rng.integers(3, vocab, (count, prompt_len)).astype(np.int32)
  completion = rng.integers(3, vocab, (count, completion_len)).astype(np.int32)
  prompt_mask = np.ones((count, prompt_len), bool)
  completion_mask = np.ones((count, completion_len), bool)
  packing = pack(prompt_ids, prompt_mask, completion, completion_mask, row_length=row_length)
  rollout = batches.CompletionBatch(prompt_ids, prompt_mask, completion, completion_mask, packing)
  return rollout, count // samples, samples


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--preset", default="qwen2.5-3b")
  ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
  ap.add_argument("--rows", type=int, default=8)
  ap.add_argument("--row-length", type=int, default=4096)
  ap.add_argument("--prompt-len", type=int, default=256)
  ap.add_argument("--completion-len", type=int, default=768)
  ap.add_argument("--lora-rank", type=int, default=32)
  ap.add_argument("--attention", default="auto")
  ap.add_argument("--no-remat", action="store_true")
  ap.add_argument("--steps", type=int, default=3)
  ap.add_argument("--peak-tflops", type=float, default=0.0,
                  help="per chip (0: the device kind's dense bf16 peak, models/flops.py)")
  args = ap.parse_args()

  cfg = preset(args.preset, dtype=args.dtype, param_dtype=args.dtype, remat=not args.no_remat,
               attention=args.attention)
  lora = LoraConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank)
  model = nnx.eval_shape(lambda: Qwen2(cfg, lora=lora, rngs=nnx.Rngs(0)))
  C._fill_random(model, 0, jnp.dtype(args.dtype))  # LoRA's B too: the policy is not the reference
  policy = programs.Policy.from_model(model, full_finetune=False)
  tx, _ = objective.make_optimizer(1e-5, 1000, warmup_ratio=0.0, weight_decay=0.0,
                                  max_grad_norm=1.0)
  mesh = sharding.make_mesh(sharding.MeshConfig(1, 1, 1))
  s = programs.StepShardings.create(policy, tx, mesh)
  policy = s.place_policy(policy)
  fns = programs.StepFunctions(policy.graphdef, tx, loss_cfg=losses.LossConfig(), temperature=1.0,
                               on_policy=True, shardings=s, remat=cfg.remat, model_cfg=cfg,
                               adv_cfg=advantages.AdvantageConfig())
  rollout, P, G = packed_rollout(args.rows, args.row_length, args.prompt_len,
                                 args.completion_len, cfg.vocab_size)
  rollout = jax.device_put(rollout, s.rollout())
  rewards = jax.device_put(np.random.default_rng(1).random((P, G)).astype(np.float32),
                           s.replicated)
  trainable, opt_state = policy.trainable, jax.jit(tx.init)(policy.trainable)
  print(f"{args.preset} {args.dtype}, LoRA rank {args.lora_rank}, remat {cfg.remat}, attention "
        f"{args.attention}; {P * G} sequences of {args.prompt_len} + {args.completion_len} tokens "
        f"packed into {rollout.packing.tokens.shape[0]} rows of {args.row_length}; "
        f"{jax.devices()[0].device_kind}", flush=True)

  # The update's programs, compiled once (their HLO names the ops in the profile).
  start = time.perf_counter()
  if cfg.remat:
    grads_in = (trainable, policy.frozen, policy.reference, rollout, rewards)
    grads_program = fns.fused_gradients_program.lower(*grads_in).compile()
    loss, aux, grads, _ = jax.eval_shape(fns.fused_gradients_program, *grads_in)
    apply_program = fns.apply_program.lower(trainable, opt_state, loss, aux, grads).compile()
    compiled = [grads_program, apply_program]

    def step(trainable, opt_state):
      loss, aux, grads, _ = grads_program(trainable, policy.frozen, policy.reference, rollout,
                                          rewards)
      return apply_program(trainable, opt_state, loss, aux, grads)[:2]
  else:
    program = fns.fused_program.lower(trainable, opt_state, policy.frozen, policy.reference,
                                      rollout, rewards).compile()
    compiled = [program]

    def step(trainable, opt_state):
      return program(trainable, opt_state, policy.frozen, policy.reference, rollout, rewards)[:2]
  print(f"compile {time.perf_counter() - start:.1f} s", flush=True)

  trainable, opt_state = jax.block_until_ready(step(trainable, opt_state))  # warm-up
  times = []
  for _ in range(args.steps):
    start = time.perf_counter()
    trainable, opt_state = jax.block_until_ready(step(trainable, opt_state))
    times.append(time.perf_counter() - start)
  seconds = statistics.median(times)

  prompts = [args.prompt_len] * P
  done = flops.step(cfg, prompts, [args.completion_len] * (P * G), G, fused=True)["update"]
  peak = flops.peak_flops(jax.devices()[0].device_kind, args.peak_tflops)
  used = flops.mfu(done.total, seconds, peak)
  print(f"update: median {seconds * 1e3:.1f} ms of {args.steps} steps; model FLOPs "
        f"{done.total / 1e12:.2f} TFLOP (linear {done.linear / 1e12:.2f}, attention "
        f"{done.attention / 1e12:.2f}, head {done.head / 1e12:.2f}; reference forward included); "
        f"{done.total / seconds / 1e12:.1f} TFLOP/s; MFU "
        + (f"{used:.1%} (peak {peak / 1e12:g} TFLOP/s)" if used is not None
           else "n/a (unknown peak: pass --peak-tflops)"))
  device_peak = C.device_peak_bytes()
  if device_peak is not None:
    print(f"device memory: peak {device_peak / 2**30:.2f} GiB in use (memory_stats)")
  else:
    footprint = max(C.peak_bytes(p.memory_analysis()) for p in compiled)
    print(f"device memory: no memory_stats here; compiled footprint {footprint / 2**30:.2f} GiB "
          f"(largest program: arguments + temporaries + outputs - aliased)")

  ops = prof.op_parts(compiled, prof.by_scope(SCOPES))
  split = prof.time_by_part(lambda: step(trainable, opt_state), ops)
  busy = sum(split.values())
  parts = ", ".join(f"{name} {split.get(name, 0.0) * 1e3:.1f} ms "
                    f"({split.get(name, 0.0) / max(busy, 1e-12):.0%})"
                    for name in ("attention", "lm_head", "rest"))
  print(f"profiled step, device op time {busy * 1e3:.1f} ms: {parts}")
  print(f"machine: {C.machine_line()}")


if __name__ == "__main__":
  main()
