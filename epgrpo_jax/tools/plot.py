"""Training curves of one or more runs, in the style of the paper's Figs 2c, 4 and 5.

    python -m epgrpo_jax.tools.plot RUN_DIR [RUN_DIR ...] [--out DIR] [--names a,b] [--alpha 0.2]

Reads each RUN_DIR/metrics.jsonl and writes one PNG per metric (reward,
entropy, grad norm, KL, held-out accuracy, zero-variance fraction) and a grid
of all of them (`curves.png`). Training metrics are drawn EMA-smoothed (the
new point weighs `alpha`) over the faint raw curve; held-out evaluations are
drawn as points. Runs are overlaid in one colour each, labelled by `--names`
or their directory names. A metric that no run logged is skipped with a note.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path
from typing import Sequence

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from epgrpo_jax.io import commandline
from epgrpo_jax.io.atomic import check_output_paths, output_dir
from epgrpo_jax.io.errors import MissingFileError, UserError
from epgrpo_jax.io.metrics import read_metrics
from epgrpo_jax.io.paths import path_flag


@dataclasses.dataclass(frozen=True)
class Panel:
  key: str  # metrics.jsonl key
  title: str
  ylabel: str
  smooth: bool = True  # EMA + faint raw; False: points joined by a line (evaluations)
  percent: bool = False  # show a [0, 1] fraction as %


PANELS: tuple[Panel, ...] = (
    Panel("reward", "Training reward", "mean reward"),
    Panel("entropy", "Policy entropy", "mean token entropy (nats)"),
    Panel("grad_norm", "Gradient norm", "global grad norm"),
    Panel("kl", "KL to the reference", "k3 KL per token"),
    Panel("heldout/accuracy", "Held-out accuracy", "accuracy (%)", smooth=False, percent=True),
    Panel("frac_reward_zero_std", "Zero-variance groups", "groups with equal rewards (%)",
          percent=True),
)
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2",
          "#7f7f7f", "#bcbd22", "#17becf")


def ema(values: Sequence[float], alpha: float = 0.2) -> np.ndarray:
  """Exponential moving average `s_t = alpha * x_t + (1 - alpha) * s_{t-1}`, `s_0 = x_0`.

  Non-finite points are skipped (the average carries over them).
  """
  out = np.empty(len(values))
  s = math.nan
  for i, x in enumerate(values):
    if math.isfinite(x):
      s = x if not math.isfinite(s) else alpha * x + (1 - alpha) * s
    out[i] = s
  return out


def series(records: Sequence[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
  """(steps, values) of `key`, one value per step (the last logged: a resumed run re-logs)."""
  by_step: dict[int, float] = {}
  for r in records:
    v = r.get(key)
    if isinstance(v, (int, float)) and not isinstance(v, bool):
      by_step[int(r["step"])] = float(v)
  steps = np.array(sorted(by_step), dtype=np.int64)
  return steps, np.array([by_step[s] for s in steps], dtype=np.float64)


@dataclasses.dataclass
class Run:
  name: str
  path: Path
  records: list[dict]


def load_runs(run_dirs: Sequence[str | Path], names: Sequence[str] | None = None) -> list[Run]:
  runs = []
  for i, d in enumerate(run_dirs):
    d = Path(d)
    if not (d / "metrics.jsonl").is_file():
      raise MissingFileError(f"{d}: no metrics.jsonl (not a run directory?)")
    name = names[i] if names else (d.resolve().name or str(d))
    runs.append(Run(name, d, read_metrics(d)))
  return runs


def _draw(ax, panel: Panel, runs: Sequence[Run], alpha: float) -> bool:
  """Draws one metric for every run into `ax`; False if no run has it."""
  drawn = False
  scale = 100.0 if panel.percent else 1.0
  for i, run in enumerate(runs):
    steps, values = series(run.records, panel.key)
    if not len(steps):
      continue
    drawn = True
    color = COLORS[i % len(COLORS)]
    if panel.smooth and len(steps) > 1:
      ax.plot(steps, values * scale, color=color, alpha=0.25, linewidth=1.0)
      ax.plot(steps, ema(values, alpha) * scale, color=color, linewidth=2.0, label=run.name)
    else:
      ax.plot(steps, values * scale, color=color, linewidth=1.5, marker="o", markersize=4,
              label=run.name)
  if drawn:
    ax.set_title(panel.title, fontsize=11)
    ax.set_xlabel("step")
    ax.set_ylabel(panel.ylabel)
    ax.grid(True, alpha=0.3)
    ax.margins(x=0.02)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.ticklabel_format(axis="y", useOffset=False)
    if panel.percent:  # a fraction: stay within [0, 100] %, with room for flat lines at the edges
      lo, hi = ax.get_ylim()
      ax.set_ylim(max(lo, 0.0) - 1.0, min(hi, 100.0) + 1.0)
  return drawn


def plot_runs(run_dirs: Sequence[str | Path], out_dir: str | Path, *,
              names: Sequence[str] | None = None, alpha: float = 0.2,
              panels: Sequence[Panel] = PANELS, dpi: int = 120) -> dict[str, Path]:
  """Writes `<key>.png` per metric present and `curves.png` (the grid); returns name -> path.

  Missing metrics are reported on stderr and left out of the grid.
  """
  if names is not None and len(names) != len(run_dirs):
    raise UserError(f"--names: {len(names)} names for {len(run_dirs)} runs")
  runs = load_runs(run_dirs, names)
  out_dir = output_dir(out_dir, "--out")
  check_output_paths(out_dir, "--out", files=[f"{p.key.replace('/', '_')}.png" for p in panels]
                     + ["curves.png"])
  smoothing = f"EMA alpha={alpha:g} (raw faint)"
  written: dict[str, Path] = {}
  present = []
  for panel in panels:
    fig = Figure(figsize=(6.4, 4.0))  # no pyplot: no global backend, nothing to close
    ax = fig.subplots()
    if _draw(ax, panel, runs, alpha):
      ax.legend(fontsize=9, loc="best")
      if panel.smooth:
        ax.text(0.99, 0.01, smoothing, transform=ax.transAxes, ha="right", va="bottom",
                fontsize=7, color="0.45")
      fig.tight_layout()
      path = out_dir / f"{panel.key.replace('/', '_')}.png"
      fig.savefig(path, dpi=dpi)
      written[panel.key] = path
      present.append(panel)
    else:
      print(f"note: no run logged {panel.key!r}; skipped", file=sys.stderr)
  if present:
    cols = min(3, len(present))
    rows = math.ceil(len(present) / cols)
    fig = Figure(figsize=(5.0 * cols, 3.6 * rows))
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax, panel in zip(axes.flat, present):
      _draw(ax, panel, runs, alpha)
    for ax in list(axes.flat)[len(present):]:
      ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=min(len(labels), 6), fontsize=10,
               frameon=False, bbox_to_anchor=(0.5, 1.0))
    fig.suptitle(f"Training curves; {smoothing}", y=0.005, va="bottom", fontsize=8,
                 color="0.4")
    fig.tight_layout(rect=(0, 0.02, 1, 0.95))
    path = out_dir / "curves.png"
    fig.savefig(path, dpi=dpi)
    written["curves"] = path
  return written


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  p = commandline.ArgumentParser(prog="python -m epgrpo_jax.tools.plot", description=__doc__.splitlines()[0])
  p.add_argument("runs", nargs="+", type=path_flag, metavar="RUN_DIR",
                 help="run directories (metrics.jsonl)")
  p.add_argument("--out", type=path_flag, help="output directory (default: RUN_DIR/plots for one run, "
                 "./plots for several)")
  p.add_argument("--names", help="comma-separated labels, one per run (default: directory names)")
  p.add_argument("--alpha", type=float, default=0.2, help="EMA weight of the newest point")
  args = p.parse_args(argv)
  args.names = [n.strip() for n in args.names.split(",")] if args.names else None
  if args.names is not None and len(args.names) != len(args.runs):
    p.error(f"--names: {len(args.names)} names for {len(args.runs)} runs")
  if not 0 < args.alpha <= 1:
    p.error(f"--alpha: must be in (0, 1], got {args.alpha}")
  return args


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)

  def run() -> int:
    out = args.out or (Path(args.runs[0]) / "plots" if len(args.runs) == 1 else Path("plots"))
    written = plot_runs(args.runs, out, names=args.names, alpha=args.alpha)
    if not written:
      print("error: none of the runs has a metric to plot", file=sys.stderr)
      return 1
    for path in written.values():
      print(path)
    return 0

  return commandline.run_main(run)


if __name__ == "__main__":
  sys.exit(main())
