"""The supervised warm start of the embedded default (`epgrpo_jax.supervised.sft`), run once and
cached beside the task's assets."""

from __future__ import annotations

import dataclasses
import json
import random
import time
from pathlib import Path
from typing import Any, Sequence

from epgrpo_jax.supervised.sft import SFTConfig, sft
from epgrpo_jax.tasks.arithmetic.assets import Assets, _digest, _write_jsonl, atomic_build
from epgrpo_jax.tasks.arithmetic.problems import VERSION, solution_text, solve

# The supervised warm start of the embedded default (`EmbeddedConfig` in
# `epgrpo_jax/training/config.py` repeats steps, batch size, rate and slip). It stops just
# after the model learns to copy operands, and its demonstrations slip (a near-miss step
# result) at a rate of 0.1: at seed 0 (one CPU's rounding) its accuracy on the 257 held-out
# problems is about 30% sampled at T = 1 and 38% greedy, 70% and 50% on levels 1-2, under 5%
# on levels 5-6; exact demonstrations gave 38% and 46% (docs/results.md, "The default run").
WARM_START: dict[str, Any] = dict(steps=800, batch_size=16, lr=3e-3, warmup_ratio=0.05,
                                  schedule="constant", weight_decay=0.01, log_every=100)
WARM_START_SLIP = 0.1  # share of demonstration steps with a near-miss result (0: exact)


def slipped_rows(rows: Sequence[dict[str, Any]], slip: float, seed: int) -> list[dict[str, Any]]:
  """`rows` whose solutions come from an imperfect demonstrator (see `solve`)."""
  rng = random.Random(f"{seed}:{VERSION}:slip")
  return [dict(r, solution=solution_text(*solve(r["expression"], slip, rng))) for r in rows]


def sft_config(assets: Assets, out: str | Path | None = None, **overrides):
  """The `SFTConfig` of the warm start on `assets` (train split, `WARM_START`)."""
  kw = {**WARM_START, "seed": assets.seed, **overrides}
  return SFTConfig(model=str(assets.model_dir), data=str(assets.train_file),
                   out=None if out is None else str(out), **kw)


def warm_start(assets: Assets, *, steps: int | None = None, learning_rate: float | None = None,
               batch_size: int | None = None, seed: int | None = None, progress: bool = True,
               slip: float = WARM_START_SLIP, **overrides) -> Path:
  """The warm-started model directory: SFT on the train split, run once and cached.

  Unset arguments take `WARM_START`'s values (seed: the assets' seed); other
  `SFTConfig` fields may be overridden by name. `slip` > 0 trains on
  demonstrations with that share of near-miss step results (`slipped_rows`).
  Cached under `assets.root/sft-{hash of the settings}/` with the same atomic
  rename as `build_assets`; `sft.json` there records the loss history and time.
  """
  if not 0.0 <= slip < 1.0:
    raise ValueError(f"slip: must be in [0, 1), got {slip}")
  named = dict(steps=steps, lr=learning_rate, batch_size=batch_size, seed=seed)
  overrides.update({k: v for k, v in named.items() if v is not None})
  cfg = sft_config(assets, verbose=progress, **overrides)
  key = {k: v for k, v in dataclasses.asdict(cfg).items()
         if k not in ("model", "data", "out", "verbose", "log_every")}
  key["slip"] = slip
  final = assets.root / f"sft-{_digest(key)}"

  def build(tmp: Path) -> None:
    run = dataclasses.replace(cfg, out=str(tmp))
    data = tmp / "sft_data.jsonl"
    if slip:
      _write_jsonl(data, slipped_rows(assets.train_rows(), slip, cfg.seed))
      run = dataclasses.replace(run, data=str(data))
    result = sft(run)
    data.unlink(missing_ok=True)
    (tmp / "sft.json").write_text(json.dumps(
        {"config": key, "seconds": round(result.seconds, 2), "losses": result.losses,
         "skipped": result.skipped}) + "\n")

  t0 = time.time()
  if atomic_build(final, build) and progress:
    print(f"[arithmetic] warm start done in {time.time() - t0:.1f}s: {final}", flush=True)
  return final
