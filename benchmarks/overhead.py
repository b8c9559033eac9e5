"""EP-GRPO vs GRPO: whole-step time (same seeds, same shapes) and the share of each phase.

Two Trainers on the same random bench-tiny Qwen2 and prompts, identical but for
`advantage.*` (EP-GRPO: entropy gate, progress signal, zero-variance anchor;
GRPO: all off). Each round runs one `Trainer.step` of each (order alternating),
then one phase-synchronised step of each (`_common.PhasedStep`) for the phase
shares. The scoring pass computes entropies for both (the trainer always logs
them), so the only extra work of EP-GRPO is in the advantage program; that
program is also timed alone, `--adv-reps` times each on the same inputs,
interleaved, which resolves differences far below the whole-step noise.

  python benchmarks/overhead.py [--rounds 3] [--new-tokens 128] [--adv-reps 50]

`--rounds 0` skips the steps (on a saturated CPU they take minutes each): only
the advantage programs are timed, and the ratio is taken over `--step-seconds`
(a GRPO step time measured elsewhere, e.g. by step_vs_trl.py --advantage grpo).
"""

from __future__ import annotations

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import tempfile
import time
from pathlib import Path

import _common as C


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--rounds", type=int, default=3, help="timed rounds (each: 2 steps per variant)")
  ap.add_argument("--prompts", type=int, default=8)
  ap.add_argument("--samples", type=int, default=8)
  ap.add_argument("--prompt-len", type=int, default=32)
  ap.add_argument("--new-tokens", type=int, default=128)
  ap.add_argument("--preset", default="bench-tiny")
  ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  ap.add_argument("--adv-reps", type=int, default=50, help="advantage-program calls per variant")
  ap.add_argument("--step-seconds", type=float, default=0.0,
                  help="with --rounds 0: the GRPO step time the advantage cost is set against")
  return ap.parse_args(argv)


def variant_overrides(name: str, dtype: str) -> list[str]:
  from epgrpo_jax.core.advantages import VARIANTS
  return ([f"advantage.{k}={str(v).lower()}" for k, v in VARIANTS[name].items()]
          + C.dtype_overrides(dtype))


def time_advantage(trainers: dict, reps: int) -> dict[str, float]:
  """Median seconds of each trainer's advantage program on the same synthetic inputs."""
  import jax
  import numpy as np

  any_tr = next(iter(trainers.values()))
  t = any_tr.cfg.train
  P, G, N = t.prompts_per_step, t.num_generations, any_tr.cfg.sampling.max_new_tokens
  rng = np.random.default_rng(0)
  rewards = (rng.random((P, G)) < 0.5).astype(np.float32)
  rewards[0] = 1.0  # one zero-variance group, so the anchor path runs
  entropy = rng.gamma(2.0, 1.0, (P, G, N)).astype(np.float32)
  logp_old = -rng.gamma(2.0, 1.0, (P, G, N)).astype(np.float32)
  logp_ref = logp_old + 0.01 * rng.standard_normal((P, G, N)).astype(np.float32)
  mask = (np.arange(N)[None, None] < rng.integers(N // 4, N + 1, (P, G, 1))).astype(np.int32)
  calls = {name: (lambda tr=tr: jax.block_until_ready(tr.advantage_fn(
      rewards, entropy, logp_old, logp_ref, mask, cfg=tr.cfg.advantage)))
      for name, tr in trainers.items()}
  return C.alternating_medians(calls, reps, reverse_odd_rounds=True)


def main(argv=None):
  args = parse_args(argv)
  import jax

  from epgrpo_jax.io import commandline
  commandline.enable_compilation_cache()  # as `epgrpo-train`: warm-up compiles once per machine

  shape = C.Shape(prompts=args.prompts, samples=args.samples, prompt_len=args.prompt_len,
                  new_tokens=args.new_tokens)
  tmp = Path(tempfile.mkdtemp(prefix="overhead-"))
  model_dir = C.build_model_dir(tmp / "model", args.preset, dtype=args.dtype)
  train_file = C.write_prompts(tmp / "prompts.jsonl",
                               C.prompt_texts(max(64, 4 * args.prompts), args.prompt_len))
  print(f"machine: {C.machine_line()}; jax {jax.__version__} on {jax.devices()[0].device_kind}",
        flush=True)
  names = ("epgrpo", "grpo")
  trainers = {n: C.make_trainer(model_dir, train_file, tmp / n, shape,
                                *variant_overrides(n, args.dtype)) for n in names}
  states = {n: trainers[n].initial_state() for n in names}
  phased = {n: C.PhasedStep(trainers[n]) for n in names}

  def full(n: str) -> float:
    start = time.perf_counter()
    states[n], _, _ = trainers[n].step(states[n])
    jax.block_until_ready(states[n].trainable)
    return time.perf_counter() - start

  if args.rounds == 0:
    adv = time_advantage(trainers, args.adv_reps)
    for tr in trainers.values():
      tr.close()
    extra = adv["epgrpo"] - adv["grpo"]
    print(f"\nadvantage program alone, P {shape.prompts} G {shape.samples} N {shape.new_tokens} "
          f"(median of {args.adv_reps}, interleaved): EP-GRPO {adv['epgrpo'] * 1e3:.2f} ms, GRPO "
          f"{adv['grpo'] * 1e3:.2f} ms, extra {extra * 1e3:.2f} ms")
    if args.step_seconds:
      ratio = (args.step_seconds + extra) / args.step_seconds
      print(f"EP-GRPO / GRPO over a {args.step_seconds:.3f} s GRPO step: {ratio:.4f} "
            f"(target <= 1.03: {'met' if ratio <= 1.03 else 'NOT met'})")
    print(f"machine at end: {C.machine_line()}")
    return

  start = time.perf_counter()
  for n in names:  # warm-up: compile both the trainer's step and the phased programs
    full(n)
    states[n], _ = phased[n](states[n])
  print(f"warm-up (compilation) of both variants: {time.perf_counter() - start:.1f} s", flush=True)

  steps = {n: [] for n in names}
  phases = {n: [] for n in names}
  loads = []
  with C.CompileCounter() as compiles:
    for r in range(args.rounds):
      order = names if r % 2 == 0 else names[::-1]
      for n in order:
        steps[n].append(full(n))
      for n in order:
        states[n], times = phased[n](states[n])
        phases[n].append(times)
      loads.append(C.load1())
      print(f"round {r + 1}: step epgrpo {steps['epgrpo'][-1]:.3f} s, grpo {steps['grpo'][-1]:.3f} s,"
            f" load {loads[-1]:.2f}", flush=True)
  adv = time_advantage(trainers, args.adv_reps)
  for tr in trainers.values():
    tr.close()

  med = {n: C.median(steps[n]) for n in names}
  ph = {n: {k: C.median([p[k] for p in phases[n]]) for k in (*C.PHASES, "step")} for n in names}
  print(f"\nshape: {shape.prompts} prompts x {shape.samples} samples, {shape.prompt_len}-token prompts,"
        f" {shape.new_tokens} new tokens (no stop), LoRA r {shape.lora_rank}; {args.rounds} rounds; "
        f"XLA compilations during the rounds: {compiles.count}")
  print(f"{'median seconds':<28}{'EP-GRPO':>10}{'GRPO':>10}{'EP/GRPO':>10}")
  print(f"{'Trainer.step':<28}{med['epgrpo']:>10.3f}{med['grpo']:>10.3f}"
        f"{med['epgrpo'] / med['grpo']:>10.3f}")
  print(f"{'phased step (synchronised)':<28}{ph['epgrpo']['step']:>10.3f}{ph['grpo']['step']:>10.3f}"
        f"{ph['epgrpo']['step'] / ph['grpo']['step']:>10.3f}")
  print(f"{'advantage program alone':<28}{adv['epgrpo']:>10.5f}{adv['grpo']:>10.5f}"
        f"{adv['epgrpo'] / adv['grpo']:>10.2f}")
  extra = adv["epgrpo"] - adv["grpo"]
  ratio = (med["grpo"] + extra) / med["grpo"]
  print(f"EP-GRPO / GRPO from the advantage program's extra {extra * 1e3:.2f} ms over the GRPO step: "
        f"{ratio:.4f} (target <= 1.03: {'met' if ratio <= 1.03 else 'NOT met'})")
  print("\nphase shares of the phased step (median seconds, % of the step):")
  print(f"{'phase':<12}{'EP-GRPO':>10}{'%':>7}{'GRPO':>10}{'%':>7}")
  for k in C.PHASES:
    e, g = ph["epgrpo"][k], ph["grpo"][k]
    print(f"{k:<12}{e:>10.3f}{100 * e / ph['epgrpo']['step']:>7.1f}"
          f"{g:>10.3f}{100 * g / ph['grpo']['step']:>7.1f}")
  print("(scoring and reference run as one fused program in the step; the reference share is a "
        "reference-only program timed alone)")
  print(f"load average over the rounds: {C.median(loads):.2f} (median of 1-min); machine at end: "
        f"{C.machine_line()}")


if __name__ == "__main__":
  main()
