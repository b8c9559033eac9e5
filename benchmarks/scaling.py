"""Step time and memory as the group size G, the response length N and the prompt batch P grow.

From a base shape, each axis is doubled `--doublings` times with the others at
base. For each shape: a fresh Trainer (EP-GRPO, LoRA r 32 on all linear
layers, completions of exactly N tokens) on the random `--preset` Qwen2, one
warm-up step, then the median of `--steps` phase-synchronised steps
(`_common.PhasedStep`). Memory is XLA's compiled footprint of the update
program (arguments + outputs + temporaries - aliased, from
`memory_analysis()`), the largest program of a step; on an accelerator the
device's running peak (`memory_stats()["peak_bytes_in_use"]`) is printed too.
The growth per doubling is fitted over each axis (log-log least squares):
2.00x means linear.

  python benchmarks/scaling.py [--base 8,8,128] [--doublings 2] [--steps 2]
"""

from __future__ import annotations

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import math
import tempfile
from pathlib import Path

import _common as C

GIB = 2 ** 30


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--base", default="8,8,128", help="P,G,N: prompts, samples per prompt, new tokens")
  ap.add_argument("--doublings", type=int, default=2)
  ap.add_argument("--steps", type=int, default=2, help="timed steps per shape")
  ap.add_argument("--prompt-len", type=int, default=32)
  ap.add_argument("--preset", default="bench-tiny")
  ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  ap.add_argument("--remat", action="store_true")
  return ap.parse_args(argv)


def update_memory(trainer, state, batch) -> int:
  """Compiled bytes of the update program(s): arguments + outputs + temporaries - aliased."""
  import jax

  spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
  args = jax.tree.map(spec, (state.trainable, state.opt_state, trainer.policy.frozen, batch))
  return max(C.peak_bytes(m) for m in trainer.fns.update_memory(*args))


def device_peak() -> float | None:
  import jax
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use")


def growth(xs: list[float], ys: list[float]) -> float:
  """Fitted factor of y per doubling of x (least squares of log2 y on log2 x)."""
  lx, ly = [math.log2(x) for x in xs], [math.log2(y) for y in ys]
  mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
  var = sum((a - mx) ** 2 for a in lx)
  slope = sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / var if var else float("nan")
  return 2 ** slope


def main(argv=None):
  args = parse_args(argv)
  import jax

  from epgrpo_jax.io import commandline
  commandline.enable_compilation_cache()  # as `epgrpo-train`: warm-up compiles once per machine

  p0, g0, n0 = (int(v) for v in args.base.split(","))
  tmp = Path(tempfile.mkdtemp(prefix="scaling-"))
  model_dir = C.build_model_dir(tmp / "model", args.preset, dtype=args.dtype)
  largest_p = p0 * 2 ** args.doublings
  train_file = C.write_prompts(tmp / "prompts.jsonl",
                               C.prompt_texts(max(64, 4 * largest_p), args.prompt_len))
  print(f"machine: {C.machine_line()}; jax {jax.__version__} on {jax.devices()[0].device_kind}; "
        f"{args.preset} {args.dtype}{' remat' if args.remat else ''}", flush=True)
  extra = C.dtype_overrides(args.dtype)
  if args.remat:
    extra.append("model.remat=true")

  shapes = [(p0, g0, n0)]
  for axis in range(3):
    for d in range(1, args.doublings + 1):
      s = [p0, g0, n0]
      s[axis] *= 2 ** d
      shapes.append(tuple(s))
  results = {}
  print(f"{'P':>4}{'G':>4}{'N':>6}{'step s':>9}{'sample':>8}{'score':>8}{'ref':>8}{'update':>8}"
        f"{'tok/s':>8}{'update GiB':>11}{'device peak GiB':>16}{'load':>6}", flush=True)
  for i, (p, g, n) in enumerate(shapes):
    shape = C.Shape(prompts=p, samples=g, prompt_len=args.prompt_len, new_tokens=n)
    trainer = C.make_trainer(model_dir, train_file, tmp / f"run{i}", shape, *extra)
    state = trainer.initial_state()
    step = C.PhasedStep(trainer)
    state, _ = step(state)  # warm-up: compilation
    timed = []
    for _ in range(args.steps):
      state, t = step(state)
      timed.append(t)
    med = {k: C.median([t[k] for t in timed]) for k in (*C.PHASES, "step")}
    mem = update_memory(trainer, state, step.last_batch)
    peak = device_peak()
    trainer.close()
    results[(p, g, n)] = (med["step"], mem)
    peak_txt = f"{peak / GIB:.3f}" if peak else "n/a"
    print(f"{p:>4}{g:>4}{n:>6}{med['step']:>9.3f}{med['sample']:>8.3f}{med['scoring']:>8.3f}"
          f"{med['reference']:>8.3f}{med['update']:>8.3f}{p * g * n / med['step']:>8.0f}"
          f"{mem / GIB:>11.3f}{peak_txt:>16}{C.load1():>6.2f}", flush=True)

  print("\nfitted growth per doubling (time, update-program memory):")
  for axis, name in enumerate(("P prompts", "G samples", "N new tokens")):
    pts = [s for s in shapes if all(s[j] == (p0, g0, n0)[j] for j in range(3) if j != axis)]
    xs = [s[axis] for s in pts]
    print(f"  {name:<14} time x{growth(xs, [results[s][0] for s in pts]):.2f}, "
          f"memory x{growth(xs, [results[s][1] for s in pts]):.2f}  ({len(pts)} points)")
  print(f"machine at end: {C.machine_line()}")


if __name__ == "__main__":
  main()
