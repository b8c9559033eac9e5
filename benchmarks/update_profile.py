"""Where our step's time goes on the CPU, per XLA op: one profiled step of step_vs_trl's workload.

Builds the bench workload of `step_vs_trl.py` (ours only), runs `--warmup` steps, then
traces one step with `jax.profiler` and reads XLA:CPU's per-op events. For each program
that took at least 5% of the step (the sampler, the fused update, ...): its dot fusions
grouped by the shapes of their dots, with GFLOP (from the optimised HLO, dumped for the
purpose) and GFLOP/s, then its other ops grouped by kind; and for how much of the
program's wall time 0, 1 or 2+ ops were running on XLA's threads.

  python benchmarks/update_profile.py [--warmup 3] [--top 20] [--separate-programs] [--remat]
      [--dtype bfloat16]
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

DUMP = Path(tempfile.mkdtemp(prefix="update_profile-hlo-"))
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={DUMP} "
                           "--xla_dump_hlo_as_text --xla_dump_hlo_pass_re=^$").strip()

import argparse  # noqa: E402
import collections  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402

import _common as C  # noqa: E402

INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\w+)\[([\d,]*)\]")
DOT = re.compile(r"dot\(%([\w.\-]+), %([\w.\-]+)\).*?lhs_contracting_dims=\{([\d,]*)\}")
COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--warmup", type=int, default=3, help="untraced steps first")
  ap.add_argument("--top", type=int, default=20, help="rows of each table")
  ap.add_argument("--separate-programs", action="store_true", help="train.fused_update=false")
  ap.add_argument("--remat", action="store_true", help="model.remat=true")
  ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                  help="weights and compute, as step_vs_trl.py --dtype")
  return ap.parse_args(argv)


class Hlo:
  """Shapes of the instructions of an optimised HLO module and the dots each fusion calls."""

  def __init__(self, text: str):
    self.computations: dict[str, list[str]] = {}
    self.shapes: dict[str, list[int]] = {}
    self.calls: dict[str, str] = {}
    current = None
    for line in text.splitlines():
      m = COMPUTATION.match(line)
      if m:
        current = m.group(1)
        self.computations[current] = []
        continue
      if current is None:
        continue
      self.computations[current].append(line)
      m = INSTR.match(line)
      if m:
        self.shapes[m.group(1)] = [int(d) for d in m.group(3).split(",") if d]
        called = re.search(r"calls=%([\w.\-]+)", line)
        if called:
          self.calls[m.group(1)] = called.group(1)

  def dots(self, computation: str) -> list[tuple[str, float]]:
    """(description, FLOPs) of each dot in `computation` and the computations it calls."""
    out = []
    for line in self.computations.get(computation, []):
      m, dot = INSTR.match(line), DOT.search(line)
      if m and dot:
        lhs, rhs = self.shapes[dot.group(1)], self.shapes[dot.group(2)]
        contracted = math.prod(lhs[int(c)] for c in dot.group(3).split(",") if c)
        result = self.shapes[m.group(1)]
        out.append((f"{result} <- {lhs} x {rhs}", 2.0 * math.prod(result) * contracted))
      for sub in re.findall(r"calls=%([\w.\-]+)", line):
        out += self.dots(sub)
    return out


def hlo_of(program_id: int) -> Hlo | None:
  files = sorted(DUMP.glob(f"module_{program_id:04d}.*after_optimizations.txt"))
  return Hlo(files[0].read_text()) if files else None


def coverage(intervals: list[tuple[int, int]]) -> list[float]:
  """Seconds with 0, 1 and 2 or more of `intervals` open, between the first start and last end."""
  points = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
  seconds, level, last = [0.0, 0.0, 0.0], 0, points[0][0]
  for t, step in points:
    seconds[min(level, 2)] += (t - last) / 1e9
    last, level = t, level + step
  return seconds


def report(module: str, events: list, top: int) -> None:
  program_id = int(dict(events[0].stats)["program_id"])
  hlo = hlo_of(program_id)
  wall = (max(e.end_ns for e in events) - min(e.start_ns for e in events)) / 1e9
  idle, one, more = coverage([(e.start_ns, e.end_ns) for e in events])
  busy = sum(e.duration_ns for e in events) / 1e9
  print(f"\n== {module} (program {program_id}): {wall:.3f} s from its first op to its last; op "
        f"time {busy:.3f} s; 0 / 1 / 2+ ops running: {idle:.3f} / {one:.3f} / {more:.3f} s")
  dots: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
  others: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
  for e in events:
    seconds = e.duration_ns / 1e9
    found = hlo.dots(hlo.calls.get(e.name, "")) if hlo else []
    if found:
      key = " + ".join(sorted({d for d, _ in found}))
      row = dots[key]
      row[0] += seconds
      row[1] += sum(f for _, f in found)
      row[2] += 1
    else:
      kind = re.sub(r"\.\d+$", "", e.name)
      others[kind][0] += seconds
      others[kind][1] += 1
  seconds = sum(r[0] for r in dots.values())
  flops = sum(r[1] for r in dots.values())
  if dots:
    print(f"ops with dots: {seconds:.3f} s, {flops / 1e9:.1f} GFLOP, "
          f"{flops / 1e9 / max(seconds, 1e-9):.0f} GFLOP/s")
    print(f"{'seconds':>8} {'GFLOP':>7} {'GFLOP/s':>7} {'ops':>4}  dots (result <- lhs x rhs)")
    for key, (s, f, n) in sorted(dots.items(), key=lambda kv: -kv[1][0])[:top]:
      print(f"{s:8.3f} {f / 1e9:7.2f} {f / 1e9 / max(s, 1e-9):7.0f} {n:4d}  {key[:140]}")
  rest = sum(r[0] for r in others.values())
  print(f"other ops: {rest:.3f} s")
  for kind, (s, n) in sorted(others.items(), key=lambda kv: -kv[1][0])[:top]:
    print(f"{s:8.3f} {n:12d}  {kind}")


def main(argv=None):
  args = parse_args(argv)
  import jax

  extra = ["train.fused_update=false"] if args.separate_programs else []
  if args.remat:
    extra.append("model.remat=true")
  if args.dtype != "float32":
    extra += C.dtype_overrides(args.dtype)
  shape = C.Shape()
  tmp = Path(tempfile.mkdtemp(prefix="update_profile-"))
  model_dir = C.build_model_dir(tmp / "model", "bench-tiny", dtype=args.dtype)
  train_file = C.write_prompts(tmp / "prompts.jsonl", C.prompt_texts(64, shape.prompt_len))
  print(f"machine: {C.machine_line()}; jax {jax.__version__}", flush=True)
  trainer = C.make_trainer(model_dir, train_file, tmp / "ours", shape, *extra)
  step = C.PhasedStep(trainer)
  state = trainer.initial_state()
  for _ in range(args.warmup):
    state, _ = step(state)
  start = time.perf_counter()
  with jax.profiler.trace(str(tmp / "trace")):
    state, times = step(state)
  print(f"traced step: {time.perf_counter() - start:.3f} s; phases "
        + ", ".join(f"{k} {v:.3f}" for k, v in times.items() if v))
  trainer.close()

  trace = next((tmp / "trace").rglob("*.xplane.pb"))
  plane = jax.profiler.ProfileData.from_file(str(trace)).find_plane_with_name("/host:CPU")
  by_module: dict[str, list] = collections.defaultdict(list)
  for line in plane.lines:
    for e in line.events:
      stats = dict(e.stats)
      if "hlo_module" in stats and "program_id" in stats and not e.name.startswith("end:"):
        by_module[stats["hlo_module"]].append(e)
  total = sum(e.duration_ns for evs in by_module.values() for e in evs)
  for module, events in sorted(by_module.items(), key=lambda kv: -sum(e.duration_ns for e in kv[1])):
    if sum(e.duration_ns for e in events) >= 0.05 * total:
      report(module, events, args.top)


if __name__ == "__main__":
  main()
