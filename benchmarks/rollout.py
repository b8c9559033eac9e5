"""Static vs continuous batching of the same rollout requests, alternating, in one run.

P prompts x G completions of a random `--preset` model (bench-tiny: vocab 1024, hidden 256, 4
layers). Prompt lengths are training questions as training renders them and completion
lengths MATH solution lengths, both in Qwen2.5 tokens (`packing.math_lengths`), drawn once;
the lengths are imposed on the random model by a stop schedule (`Sampler.sample(...,
stop_after=)`, stop tokens ignored), capped at `--new-tokens`. Both sides get the same
prompts, keys and schedule, and produce the same completions. T 1.0, top-p 0.95.

Printed per side: median seconds per call, useful tokens/s (tokens of the completions),
useful-slot fraction (decode row-steps that produced a real token / all decode row-steps;
the first token of each completion comes from the prefill on both sides and is left out of
both counts), programs compiled while timed (must be 0), the largest compiled program's
footprint (arguments + temporaries + outputs, `memory_analysis`), and the device's or the
process's peak memory. The decode attention the seam chose is named first: on a GPU the
Pallas kernel that reads each row's own slots (`kernels/gpu.py`), unless `--attention plain`
(XLA's einsums over every slot, for the prefill as well).

`--shared-prompt-cache`: a third side, the static sampler with each prompt's cache kept once for
its G rows (`sampling.shared_prompt_cache`; the static side has it off), timed in the same
alternation. `--cpu-kernels false`: XLA's decode attention, draw and products on a CPU too
(the attention every TPU program runs).

`--profile`: after the timed calls, one more call of each side with every completion cut to
`--profile-tokens` tokens, traced with `jax.profiler` (`_profile.py`): the device op time of
the decode steps (the ops of the decode loop's body; on a CPU the XLA ops on the host
threads) per decode step, split by name scope into decode attention ("attention"), q/k/v, o
and the MLP ("projections"), the LM head ("lm_head"), the token choice, top-p included
("sampling"), the KV cache writes ("cache_write") and the rest; the op time outside the
decode steps (prefill, inserting newcomers, growing the cache); and the ratio of the time per
step to the weight-read floor (every layer's weights and the head read once per step at the
device's memory bandwidth: `--hbm-gbps`, else the device kind's known figure).

  python benchmarks/rollout.py [--prompts 16] [--samples 8] [--new-tokens 2048] [--slots 32]
      [--refill-every 8] [--rounds 2] [--preset bench-tiny] [--dtype float32] [--attention auto]
      [--shared-prompt-cache] [--cpu-kernels true] [--profile] [--profile-tokens 32] [--hbm-gbps 0]
"""

from __future__ import annotations

import argparse
import re
import resource
import time

import numpy as np

import _common as C
import _profile as prof

DECODE_PARTS = ("attention", "projections", "lm_head", "sampling", "cache_write", "rest")
DECODE_LOOP = re.compile(r"^jit\([^/]*\)/while/body/")  # the program's own loop, not a nested one


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  C.batch_shape_args(ap, prompts=16, samples=8, new_tokens=2048, max_prompt_tokens=512)
  ap.add_argument("--slots", type=int, default=32, help="sampling.slots")
  ap.add_argument("--refill-every", type=int, default=8, help="sampling.refill_every")
  ap.add_argument("--stop-check-every", type=int, default=8, help="sampling.stop_check_every")
  ap.add_argument("--rounds", type=int, default=2, help="timed calls of each side")
  ap.add_argument("--preset", default="bench-tiny")
  ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  ap.add_argument("--attention", default="auto", choices=("auto", "plain", "blockwise", "cudnn"),
                  help="model.attention (plain: XLA's decode attention on a GPU too)")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--shared-prompt-cache", action="store_true",
                  help="a third side: the static sampler with sampling.shared_prompt_cache=true")
  ap.add_argument("--cpu-kernels", default="true", choices=("true", "false"), help="sampling.cpu_kernels")
  ap.add_argument("--profile", action="store_true", help="trace one call of each side (see above)")
  ap.add_argument("--profile-tokens", type=int, default=32, help="completion length of the traced calls")
  ap.add_argument("--hbm-gbps", type=float, default=0.0,
                  help="memory bandwidth for the weight-read floor (0: the device kind's, if known)")
  return ap.parse_args(argv)


def static_row_steps(lengths: np.ndarray, k: int) -> int:
  """Decode row-steps of the static sampler: every row until the longest completion's last
  token, in blocks of k steps after the first token."""
  longest = int(lengths.max())
  return lengths.size * k * -(-(longest - 1) // k)


def prompt_reads(prompt_lengths_P: np.ndarray, lengths_PxG: np.ndarray, live_prompts: list) -> tuple:
  """(the prompts' share of the decode steps' valid-slot reads, the share of those reads that
  reading each prompt's slots once per step for its live rows would save): a decode step of a
  request with t tokens so far reads its prompt's slots and its t own; `live_prompts` holds
  the continuous engine's schedule (per block, the prompt of each live decode step or -1)."""
  steps_PxG = lengths_PxG.astype(np.int64) - 1
  prompt = int((steps_PxG * prompt_lengths_P[:, None]).sum())
  total = prompt + int((steps_PxG * (steps_PxG + 1) // 2).sum())
  once = 0
  for block_SxK in live_prompts:
    for step_S in block_SxK.T:
      once += int(prompt_lengths_P[np.unique(step_S[step_S >= 0])].sum())
  return prompt / total, (prompt - once) / total


def agreement(a, b) -> str:
  """How far two sides' outputs agree: completions equal token for token, where the others
  first part, and the largest log-prob gap before that."""
  equal = np.asarray(a.tokens) == np.asarray(b.tokens)
  rows_same = equal.all(-1)
  first_diff = np.argmin(equal, -1)[~rows_same]
  prefix = np.arange(equal.shape[-1]) < (first_diff.min() if first_diff.size else equal.shape[-1])
  logp_gap = np.abs(np.asarray(a.logp) - np.asarray(b.logp))[..., prefix].max()
  return (f"{rows_same.sum()} of {rows_same.size} completions token for token"
          + (f" (the others part at token {first_diff.min()} or later)" if first_diff.size else "")
          + f", log-prob gap before the first parting {logp_gap:.1e}")


def decode_attention_name(kernels, sampler) -> str:
  """Which decode attention the sampler's programs run."""
  if kernels.decode_attention is not None:
    return "Pallas, each row's own slots (kernels/gpu.py)"
  return "C++ (sampling.cpu_kernels)" if sampler.uses_cpu_kernels() else "XLA, every slot"


def decode_parts(instructions: list) -> list[str]:
  """The part of a decode step (`DECODE_PARTS`) of each instruction (`_profile.hlo_instructions`)
  of a sampler's program, "outside" for those outside its decode loop: an instruction is in a
  decode step when its op_name lies in the body of the program's outermost loop (the static
  sampler's `in_blocks`, the continuous engine's `lax.scan`), or, without an op_name (a copy
  XLA added), when its computation holds such instructions."""
  loop = {comp for _, _, op_name, comp in instructions if op_name and DECODE_LOOP.match(op_name)}
  out = []
  for _, _, op_name, comp in instructions:
    inside = bool(DECODE_LOOP.match(op_name)) if op_name else comp in loop
    out.append(prof.first_scope(op_name, DECODE_PARTS[:-1]) if inside else "outside")
  return out


def weight_bytes(model) -> int:
  """Bytes a decode step reads of the weights: every parameter but the embedding table (of
  which it gathers one row per token), and the head (the table itself when tied)."""
  import jax
  from flax import nnx
  total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  embed = model.embed[...]
  head = model.head_DxV()
  return total - embed.size * embed.dtype.itemsize + head.size * head.dtype.itemsize


def profile_summary(name: str, split: dict, steps: int, rows: float, floor: float | None) -> str:
  """The lines of one side's profile: op time per decode step by part, outside the decode
  steps, and the ratio to the weight-read floor (seconds per step, or None)."""
  decode = sum(split.get(part, 0.0) for part in DECODE_PARTS)
  per_step = decode / max(steps, 1)
  parts = ", ".join(f"{part} {split.get(part, 0.0) / max(steps, 1) * 1e3:.3f} ms "
                    f"({split.get(part, 0.0) / max(decode, 1e-12):.0%})" for part in DECODE_PARTS)
  floor_text = (f"{per_step / floor:.1f}x the weight-read floor {floor * 1e3:.3f} ms"
                if floor else "weight-read floor unknown (no bandwidth for this device: --hbm-gbps)")
  return (f"profile {name}: {steps} decode steps traced, {rows:.1f} rows a step on average; device op "
          f"time per decode step {per_step * 1e3:.3f} ms: {parts}\n"
          f"profile {name}: outside the decode steps {split.get('outside', 0.0) * 1e3:.1f} ms "
          f"(prefill, inserts, cache growth, other programs); {floor_text}")


def largest_program_bytes(sampler) -> int:
  return max(C.peak_bytes(p.memory_analysis()) for p in sampler._programs.values())


def main(argv=None) -> None:
  args = parse_args(argv)
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from epgrpo_jax.kernels import seam
  from epgrpo_jax.models import Qwen2, preset
  from epgrpo_jax.rollout.sampling import Sampler, SamplingConfig
  from packing import math_lengths

  if args.profile:  # a program from the persistent cache keeps the op_name scopes of the code
    jax.config.update("jax_enable_compilation_cache", False)  # that first compiled it
  print(C.machine_line())
  print("jax", jax.__version__, jax.devices()[0].device_kind)
  p, g = args.prompts, args.samples
  prompt_lengths, completion_lengths = math_lengths(args.max_prompt_tokens, 2000, args.seed)
  rng = np.random.default_rng(args.seed)
  lp_P = rng.choice(prompt_lengths, p)
  lengths_PxG = np.minimum(rng.choice(completion_lengths, (p, g)), args.new_tokens).astype(np.int32)
  cfg = preset(args.preset, param_dtype=args.dtype, dtype=args.dtype, attention=args.attention)
  model = nnx.eval_shape(lambda: Qwen2(cfg, rngs=nnx.Rngs(args.seed)))
  C._fill_random(model, args.seed, jnp.dtype(args.dtype))
  prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in lp_P]
  print(f"{args.preset} {args.dtype}, P x G = {p} x {g}, max_new_tokens {args.new_tokens}; prompt "
        f"lengths {lp_P.min()}-{lp_P.max()}, completion lengths mean {lengths_PxG.mean():.0f} "
        f"median {np.median(lengths_PxG):.0f} max {lengths_PxG.max()}")

  base = SamplingConfig(temperature=1.0, top_p=0.95, max_new_tokens=args.new_tokens, ignore_eos=True,
                        stop_check_every=args.stop_check_every, cpu_kernels=args.cpu_kernels == "true",
                        shared_prompt_cache=False)
  sides = {"static": Sampler(base),
           "continuous": Sampler(base.replace(continuous=True, slots=args.slots,
                                              refill_every=args.refill_every))}
  if args.shared_prompt_cache:
    sides["shared"] = Sampler(base.replace(shared_prompt_cache=True))
  print(f"decode attention: {decode_attention_name(seam.choose(cfg), sides['static'])}")
  graph = nnx.split(model)
  key = jax.random.key(args.seed)
  outs = {}

  def call(name):
    outs[name] = jax.block_until_ready(sides[name].sample(graph, prompts, g, key, stop_after=lengths_PxG))

  for name in sides:  # compile every program (the tail's smaller row counts too)
    start = time.perf_counter()
    call(name)
    print(f"{name}: first call {time.perf_counter() - start:.1f} s, "
          f"{sides[name].num_compilations} programs")
  times = {name: [] for name in sides}
  with C.CompileCounter() as compiles:
    for i in range(args.rounds):
      for name in (list(sides) if i % 2 == 0 else list(sides)[::-1]):
        times[name].append(C.time_call(lambda: call(name)))
  a, b = outs["static"], outs["continuous"]
  same = agreement(a, b)
  useful = int(lengths_PxG.sum())
  decode_useful = useful - lengths_PxG.size
  row_steps = {"static": static_row_steps(lengths_PxG, args.stop_check_every),
               "continuous": sides["continuous"].decode_row_steps}
  row_steps["shared"] = row_steps["static"]
  assert (np.asarray(a.lengths) == lengths_PxG).all() and (np.asarray(b.lengths) == lengths_PxG).all()
  rates = {}
  for name in sides:
    seconds = C.median(times[name])
    rates[name] = useful / seconds
    print(f"{name:>10}: {seconds:.2f} s/call (runs {', '.join(f'{t:.2f}' for t in times[name])}), "
          f"{rates[name]:.0f} useful tokens/s, useful-slot fraction "
          f"{decode_useful / row_steps[name]:.1%} ({decode_useful} of {row_steps[name]} row-steps), "
          f"largest program {largest_program_bytes(sides[name]) / 2**20:.1f} MiB")
  peak = C.device_peak_bytes()
  peak_text = (f"device peak {peak / 2**30:.2f} GiB" if peak is not None else
               f"process peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")
  share, saved = prompt_reads(lp_P, lengths_PxG, sides["continuous"].live_prompts)
  print(f"decode attention, valid-slot reads: prompts {share:.1%}; each prompt's slots read once "
        f"per step for its live rows (continuous schedule) would save {saved:.1%}")
  print(f"continuous / static: {rates['continuous'] / rates['static']:.2f}x useful tokens/s; "
        f"compiled while timed: {compiles.count}; {peak_text}\nsame completions: {same}")
  if args.shared_prompt_cache:
    print(f"shared prompt cache / static: {rates['shared'] / rates['static']:.2f}x useful tokens/s; "
          f"same completions as static: {agreement(a, outs['shared'])}")
  if args.profile:
    cut_PxG = np.minimum(lengths_PxG, args.profile_tokens)
    bandwidth = prof.hbm_bandwidth(jax.devices()[0].device_kind, args.hbm_gbps)
    weights = weight_bytes(model)
    floor = weights / bandwidth if bandwidth else None
    print(f"profile: completions cut to {args.profile_tokens} tokens; weights read per decode step "
          f"{weights / 1e6:.3f} MB" + (f" at {bandwidth / 1e9:g} GB/s" if bandwidth else ""))
    for name, sampler in sides.items():
      split = prof.time_by_part(lambda: sampler.sample(graph, prompts, g, key, stop_after=cut_PxG),
                                prof.op_parts(sampler._programs.values(), decode_parts), "outside")
      if name != "continuous":  # the static sampler, either cache
        steps = static_row_steps(cut_PxG, args.stop_check_every) // cut_PxG.size
        rows = float(cut_PxG.size)
      else:
        steps = len(sampler.live_prompts) * args.refill_every
        rows = sampler.decode_row_steps / max(steps, 1)
      print(profile_summary(name, split, steps, rows, floor))
  print(C.machine_line())


if __name__ == "__main__":
  main()
