"""`python -m epgrpo_jax.train [--config FILE] [--debug] [key=value ...]`

With no arguments: the embedded default (a tiny model warm-started on a
synthetic arithmetic task, then EP-GRPO), offline, on CPU.
"""

from __future__ import annotations

import argparse
import sys

import yaml

from epgrpo_jax.io import commandline, configlib
from epgrpo_jax.io.paths import path_flag


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  p = commandline.ArgumentParser(prog="python -m epgrpo_jax.train", description=__doc__.splitlines()[0])
  p.add_argument("--config", type=path_flag,
                 help="YAML config (may name a `base:` file); default: the built-in defaults "
                 "(configs/default.yaml sets nothing)")
  p.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
  p.add_argument("--print-config", action="store_true",
                 help="print every key of the resolved config with its value (a valid config file) and exit")
  p.add_argument("overrides", nargs="*", metavar="key=value",
                 help="dotted overrides, e.g. train.steps=100 advantage.entropy_gate=false")
  return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  commandline.setup_logging(args.debug)
  commandline.enable_compilation_cache()

  def run() -> int:
    from epgrpo_jax.training.config import load_config  # JAX after parsing: fast `--help`, usage errors
    cfg = load_config(args.config, args.overrides)
    if args.print_config:
      print(yaml.safe_dump(configlib.to_dict(cfg), sort_keys=False))
      return 0
    from epgrpo_jax.training.loop import train  # the trainer only to train: fast `--print-config`
    summary = train(cfg)
    if summary.get("heldout_gain"):
      print(accuracy_line(summary["heldout_before"], summary["heldout_after"], summary["heldout_gain"]))
    print(f"run directory: {summary['output_dir']}")
    return 0

  return commandline.run_main(run, debug=args.debug)


def accuracy_line(before: dict, after: dict, gain: dict) -> str:
  """"held-out accuracy: B% ± se -> A% ± se (+G points ± se)": each ± one standard error over
  the held-out problems (`evaluation.heldout.standard_error`; the gain's paired)."""
  def pct(m: dict) -> str:
    return f"{100 * m['accuracy']:.1f}% ± {100 * m['accuracy_se']:.1f}"
  return (f"held-out accuracy: {pct(before)} -> {pct(after)} "
          f"({100 * gain['accuracy']:+.1f} points ± {100 * gain['accuracy_se']:.1f})")


if __name__ == "__main__":
  sys.exit(main())
