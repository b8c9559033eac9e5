"""Whole RL steps per second, synchronous (rollout.max_staleness 0) against one step stale (1),
on 8 fake CPU devices and on one device, all sides in one run.

A random `--preset` model (bench-tiny: vocab 1024, hidden 256, 4 layers) trains with LoRA on P
prompts x G completions. Prompt lengths are training questions as training renders them and
completion lengths MATH solution lengths, both in Qwen2.5 tokens (`packing.math_lengths`, as
benchmarks/rollout.py), capped at `--new-tokens`; each sampling call draws its lengths from that
distribution (the same sequence of draws on every side) and imposes them on the random model by a
stop schedule (`Sampler.sample(..., stop_after=)`). The static sampler, every prompt padded to
`--max-prompt-tokens` (one program, whatever the batch: no compilation while timed).

Sides (k=1: `rollout.max_staleness=1` with `loss.rollout_correction=token`):
  8 devices, k=0     sampler and update on one mesh of 8 (data-parallel)
  8 devices, k=1     sampler on a rollout mesh of 4, update on a training mesh of the other 4
  1 device,  k=0     sampler and update on one device
  1 device,  k=1     the same device; the worker thread samples the next batch meanwhile
With fewer than 8 devices (one GPU) the 8-device sides are left out.

Each side warms up (`--warmup` steps: compilation, the pipeline filled), then runs `--steps`
timed steps; a timed block ends once the batch sampled during it is done too (so k=1 is not
credited for work left in flight). Blocks run in the order A B C D D C B A (`--rounds` 2) so every
side sees the same machine load; the median block gives steps/s. Each side also prints the
process's CPU time a step and the cores it kept busy. On a CPU host the devices' work is CPU
time, so a k=1 block cannot take less than its CPU time spread over every core: the pair's
line prints the gain that floor allows beside the gain measured. (CPU time includes the thread
pools' waiting spins, which shrink as the cores fill, so the floor is a guide, not a proof.)

  XLA_FLAGS is set here (8 host devices). python benchmarks/async.py [--prompts 8] [--samples 8]
      [--new-tokens 512] [--steps 3] [--warmup 2] [--rounds 2] [--preset bench-tiny]
      [--dtype float32] [--only "1 device"] [--set sampling.continuous=true ...]
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

import _common as C  # noqa: E402


# The k = 1 sides: one step stale, with the token-level truncated correction (docs/async.md).
STALE = ["rollout.max_staleness=1", "loss.rollout_correction=token"]


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  C.batch_shape_args(ap, prompts=8, samples=8, new_tokens=512, max_prompt_tokens=256)
  ap.add_argument("--steps", type=int, default=3, help="timed steps per block")
  ap.add_argument("--warmup", type=int, default=2, help="untimed steps before a side's first block")
  ap.add_argument("--rounds", type=int, default=2, help="timed blocks per side")
  ap.add_argument("--preset", default="bench-tiny")
  ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  ap.add_argument("--only", default="", help="comma-separated side names (default: all four)")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                  help="config overrides for every side (e.g. sampling.continuous=true)")
  return ap.parse_args(argv)


def with_lengths(sampler, lengths: np.ndarray, seed: int):
  """`sampler.sample` drawing each call's completion lengths [P, G] from `lengths` (a seeded
  sequence of draws: every side gets the same)."""
  rng = np.random.default_rng(seed)
  sample = sampler.sample

  def wrapped(model, prompts, num_samples, key, **kw):
    stop_after = rng.choice(lengths, (len(prompts), num_samples)).astype(np.int32)
    return sample(model, prompts, num_samples, key, stop_after=stop_after, **kw)
  return wrapped


def main(argv=None) -> None:
  args = parse_args(argv)
  import jax

  from epgrpo_jax.parallel.sharding import MeshConfig, make_mesh
  from epgrpo_jax.training.config import TrainConfig
  from epgrpo_jax.training.trainer import Trainer
  from packing import math_lengths

  print(C.machine_line())
  print("jax", jax.__version__, jax.device_count(), "x", jax.devices()[0].device_kind)
  prompt_lengths, completion_lengths = math_lengths(args.max_prompt_tokens, 2000, args.seed)
  completion_lengths = np.minimum(completion_lengths, args.new_tokens)
  rng = np.random.default_rng(args.seed)
  tmp = Path(tempfile.mkdtemp(prefix="async-bench-"))
  model_dir = C.build_model_dir(tmp / "model", args.preset, dtype=args.dtype)
  texts = [C.prompt_texts(1, int(n), seed=i)[0] for i, n in enumerate(rng.choice(prompt_lengths, 64))]
  train_file = C.write_prompts(tmp / "train.jsonl", texts)
  shape = C.Shape(prompts=args.prompts, samples=args.samples, prompt_len=args.max_prompt_tokens,
                  new_tokens=args.new_tokens)
  print(f"{args.preset} {args.dtype} LoRA, P x G = {args.prompts} x {args.samples}, max_new_tokens "
        f"{args.new_tokens}; prompt lengths {prompt_lengths.min()}-{prompt_lengths.max()}, completion "
        f"lengths mean {completion_lengths.mean():.0f} median {np.median(completion_lengths):.0f} "
        f"(capped at {args.new_tokens}); overrides {' '.join(args.set) or 'none'}")

  devices = jax.devices()
  sides = {  # name: (overrides, mesh override)
      "8 devices, k=0": ([], None),
      "8 devices, k=1 (4 + 4)": ([*STALE, "rollout.devices=4"], None),
      "1 device, k=0": ([], make_mesh(MeshConfig(), devices[:1])),
      "1 device, k=1": (STALE, make_mesh(MeshConfig(), devices[:1])),
  }
  if args.only:
    wanted = [s.strip() for s in args.only.split(",")]
    sides = {name: v for name, v in sides.items() if any(name.startswith(w) for w in wanted)}
  if len(devices) < 8 and any(name.startswith("8 devices") for name in sides):
    print(f"{len(devices)} {devices[0].platform} device(s): the 8-device sides are left out")
    sides = {name: v for name, v in sides.items() if not name.startswith("8 devices")}
  runs = {}
  for i, (name, (extra, mesh)) in enumerate(sides.items()):
    overrides = C.trainer_overrides(model_dir, train_file, tmp / f"run{i}", shape, *extra,
                                    "checkpoint.every=0",
                                    f"sampling.prompt_buckets=[{args.max_prompt_tokens}]",
                                    *C.dtype_overrides(args.dtype), *args.set)
    trainer = Trainer(TrainConfig().override(*overrides), mesh=mesh)
    trainer.sampler.sample = with_lengths(trainer.sampler, completion_lengths, args.seed)
    state = trainer.restore_or_init()
    start = time.perf_counter()
    for _ in range(args.warmup):
      state, _, _ = trainer.step(state)
    settle(trainer, state)
    print(f"{name}: warm-up {args.warmup} steps {time.perf_counter() - start:.1f} s "
          f"(training devices {trainer.mesh.size}, sampler devices {trainer.rollout_mesh.size})",
          flush=True)
    runs[name] = {"trainer": trainer, "state": state, "times": [], "cpu": [], "metrics": []}

  def block(name):
    run = runs[name]
    trainer, state = run["trainer"], run["state"]
    start, cpu = time.perf_counter(), C.cpu_seconds()
    for _ in range(args.steps):
      state, m, _ = trainer.step(state)
      run["metrics"].append(m)
    settle(trainer, state)
    run["times"].append(time.perf_counter() - start)
    run["cpu"].append(C.cpu_seconds() - cpu)
    run["state"] = state

  order = list(runs)
  with C.CompileCounter() as compiles:
    for r in range(args.rounds):
      for name in (order if r % 2 == 0 else order[::-1]):
        block(name)
  rates, busy, cores = {}, {}, C.usable_cores()
  for name, run in runs.items():
    seconds = C.median(run["times"])
    rates[name] = args.steps / seconds
    busy[name] = sum(run["cpu"]) / sum(run["times"])
    ms = run["metrics"]
    staleness = [m.get("rollout/staleness", 0.0) for m in ms]
    wait = C.median([m.get("rollout/wait_time", m["sample_time"]) for m in ms])
    print(f"{name:>24}: {rates[name]:.3f} steps/s ({seconds:.2f} s per {args.steps} steps; blocks "
          f"{', '.join(f'{t:.2f}' for t in run['times'])}); median sample/wait "
          f"{wait:.2f} s, update {C.median([m['update_time'] for m in ms]):.2f} s; staleness "
          f"{min(staleness):.0f}-{max(staleness):.0f}, |dlogp| mean "
          f"{np.mean([m['sampling/sampling_logp_difference/mean'] for m in ms]):.1e}; CPU "
          f"{sum(run['cpu']) / len(run['cpu']) / args.steps:.2f} s a step, {busy[name]:.2f} of "
          f"{cores} cores busy")
  for devices_text in ("8 devices", "1 device"):
    pair = [n for n in rates if n.startswith(devices_text + ",")]
    if len(pair) == 2:
      bound = ""
      if jax.default_backend() == "cpu":  # the devices' work is CPU time too
        bound = f"; {cpu_bound(runs[pair[0]], runs[pair[1]], cores)}"
      print(f"{devices_text}: k=1 / k=0 = {rates[pair[1]] / rates[pair[0]]:.2f}x steps/s{bound}")
  print(f"compiled while timed: {compiles.count}")
  for run in runs.values():
    run["trainer"].close()
  print(C.machine_line())


def cpu_bound(sync: dict, stale: dict, cores: int) -> str:
  """The gain over k=0 that k=1's CPU time allows on a CPU host, where the devices' work runs on
  the same cores: a k=1 block cannot take less than its CPU time spread over every core."""
  block_floor = C.median(stale["cpu"]) / cores  # seconds a k=1 block needs at the least
  return (f"k=1's CPU time over {cores} cores, every core busy: at most "
          f"{C.median(sync['times']) / block_floor:.2f}x")


def settle(trainer, state) -> None:
  """Waits for the device work of the steps so far and for the batches in flight."""
  import jax
  jax.block_until_ready(state.trainable)
  if trainer.rollouts is not None:
    trainer.rollouts.wait()


if __name__ == "__main__":
  main()
