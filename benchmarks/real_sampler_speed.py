"""Real-shape sampling speed (issue 23, item 3): our sampler vs transformers on a real checkpoint.

Runs two existing benchmarks with the issue's settings on `--model` (default
$EPGRPO_REAL_MODEL), each in its own process:

1. `sampler_vs_hf.py --model DIR --shapes 2x8,8x8 --new-tokens 256 --dtype float32,bfloat16`
   (T 1.0, top-p 0.95, 32-token prompts, no stop token): tokens/s of ours and of
   transformers `generate`, timed alternating; our compile time; peak RSS of each.
2. `decode_breakdown.py --model DIR --dtype float32 --prompts 8 --samples 8 --new-tokens 256
   --variants full,no-attention,greedy`: where a decode step of 64 rows goes at the
   model's vocabulary: the head matmul alone, temperature + top-p + draw (full minus
   greedy) and attention (full minus a stand-in that reads no cache).

  python benchmarks/real_sampler_speed.py [--model DIR] [--runs 3] [--shapes 2x8,8x8]
      [--new-tokens 256] [--dtype float32,bfloat16] [--skip-breakdown] [--skip-hf]

Run it with OMP_WAIT_POLICY=PASSIVE on a loaded machine (see sampler_vs_hf.py).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main():
  from epgrpo_jax.io.paths import path_flag  # `~` in a path flag, as in the commands
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--model", type=path_flag, default=os.environ.get("EPGRPO_REAL_MODEL"))
  ap.add_argument("--runs", type=int, default=3)
  ap.add_argument("--shapes", default="2x8,8x8")
  ap.add_argument("--new-tokens", type=int, default=256)
  ap.add_argument("--dtype", default="float32,bfloat16")
  ap.add_argument("--skip-breakdown", action="store_true")
  ap.add_argument("--skip-hf", action="store_true")
  args = ap.parse_args()
  if not args.model:
    ap.error("--model: required (or set EPGRPO_REAL_MODEL)")
  common = ["--model", args.model, "--runs", str(args.runs), "--new-tokens", str(args.new_tokens)]
  hf = ["--skip-hf"] if args.skip_hf else []
  runs = [["sampler_vs_hf.py", *common, "--shapes", args.shapes, "--dtype", args.dtype,
           "--top-p", "0.95", "--temperature", "1.0", *hf]]
  if not args.skip_breakdown:
    runs.append(["decode_breakdown.py", *common, "--dtype", "float32", "--prompts", "8",
                 "--samples", "8", "--variants", "full,no-attention,greedy", "--skip-hf"])
  for argv in runs:
    print("$ python benchmarks/" + " ".join(argv), flush=True)
    code = subprocess.run([sys.executable, *argv], cwd=HERE).returncode
    if code:
      return code
  return 0


if __name__ == "__main__":
  sys.exit(main())
