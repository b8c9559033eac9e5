"""Supervised fine-tuning of an HF model directory on prompt/completion rows.

    python -m epgrpo_jax.sft --model DIR --data FILE.jsonl --out DIR [--steps N] [--lr LR]

The loop is `epgrpo_jax.supervised.sft`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from epgrpo_jax.io import commandline
from epgrpo_jax.io.paths import path_flag
from epgrpo_jax.supervised.sft import SCHEDULES, SFTConfig, check_paths, sft


def _parser() -> argparse.ArgumentParser:
  d = SFTConfig(model="", data="")
  p = commandline.ArgumentParser(prog="python -m epgrpo_jax.sft", description=__doc__.splitlines()[0])
  p.add_argument("--model", required=True, type=path_flag, help="HF model directory (with tokenizer)")
  p.add_argument("--data", required=True, type=path_flag, help="JSONL file with prompt and completion fields")
  p.add_argument("--out", required=True, type=path_flag, help="output HF directory")
  p.add_argument("--steps", type=int, default=d.steps)
  p.add_argument("--lr", type=float, default=d.lr)
  p.add_argument("--batch-size", type=int, default=d.batch_size)
  p.add_argument("--seed", type=int, default=d.seed)
  p.add_argument("--warmup-ratio", type=float, default=d.warmup_ratio)
  p.add_argument("--schedule", choices=SCHEDULES, default=d.schedule)
  p.add_argument("--weight-decay", type=float, default=d.weight_decay)
  p.add_argument("--max-length", type=int, default=d.max_length)
  p.add_argument("--prompt-field", default=d.prompt_field)
  p.add_argument("--completion-field", default=d.completion_field)
  p.add_argument("--prompt-template", default=d.prompt_template,
                 help="user message around the prompt field, e.g. '{problem} Think step by step.'")
  p.add_argument("--lora-rank", type=int, default=d.lora_rank)
  p.add_argument("--log-every", type=int, default=d.log_every)
  return p


def main(argv: Sequence[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  commandline.setup_logging()

  def run() -> int:
    cfg = SFTConfig(model=args.model, data=args.data, out=args.out,
                    steps=args.steps, lr=args.lr,
                    batch_size=args.batch_size, seed=args.seed, warmup_ratio=args.warmup_ratio,
                    schedule=args.schedule, weight_decay=args.weight_decay,
                    max_length=args.max_length, prompt_field=args.prompt_field,
                    completion_field=args.completion_field,
                    prompt_template=args.prompt_template, lora_rank=args.lora_rank,
                    log_every=args.log_every)
    check_paths(cfg)
    sft(cfg)
    return 0

  return commandline.run_main(run)


if __name__ == "__main__":
  sys.exit(main())
