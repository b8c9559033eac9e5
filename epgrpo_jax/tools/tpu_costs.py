"""TPU slices for ahead-of-time compiles, and what a compiled program costs on them.

`topology_devices` returns the compile-only devices of a named TPU slice (libtpu, the `tpu`
extra, describes them on any host); `measure` reads XLA's memory and cost analyses of a
compiled program and sets them against the chip's public figures (`CHIPS`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
from typing import Any

import jax

from epgrpo_jax.io.errors import UserError

GiB = 1024 ** 3


@dataclasses.dataclass(frozen=True)
class Chip:
  """A TPU chip's public figures: HBM per chip, peak dense bf16 FLOP/s, HBM bandwidth."""

  name: str
  hbm_bytes: int
  peak_flops: float
  hbm_bandwidth: float  # bytes/s


# By `device_kind` (Google Cloud's published per-chip specifications).
CHIPS = {
    "TPU v4": Chip("v4", 32 * GiB, 275e12, 1228e9),
    "TPU v5 lite": Chip("v5e", 16 * GiB, 197e12, 819e9),
    "TPU v5": Chip("v5p", 95 * GiB, 459e12, 2765e9),
    "TPU v6 lite": Chip("v6e", 32 * GiB, 918e12, 1640e9),
}


def libtpu_installed() -> bool:
  return importlib.util.find_spec("libtpu") is not None


def check_libtpu() -> None:
  if not libtpu_installed():
    raise UserError("--topology: libtpu is not installed; install the `tpu` extra "
                    "(pip install -e \".[tpu]\") to compile for TPU slices on this host")


def topology_devices(name: str, chips_per_host: str | None = None) -> list:
  """The devices of TPU slice `name` (e.g. "v5e:2x4"); `chips_per_host` "AxB[xC]" sets how
  many chips each host holds (libtpu's default: 2x2x1, i.e. 4)."""
  check_libtpu()
  # Compiling touches no chip: let two checks (or a check and a test) load libtpu at once.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from jax.experimental import topologies  # loads the TPU plugin: only for a compile check
  kw: dict[str, Any] = {}
  if chips_per_host:
    try:
      dims = [int(d) for d in chips_per_host.lower().split("x")]
    except ValueError:
      raise UserError(f"--chips-per-host: expected AxB or AxBxC, got {chips_per_host!r}") from None
    if not 2 <= len(dims) <= 3 or min(dims) < 1:
      raise UserError(f"--chips-per-host: expected AxB or AxBxC, got {chips_per_host!r}")
    kw["chips_per_host_bounds"] = tuple(dims + [1] * (3 - len(dims)))
  if name.lower().startswith("v4"):
    kw["chip_config_name"] = "megacore"  # one device per chip, as v5p and v4 run by default
  try:
    devices = topologies.get_topology_desc(platform="tpu", topology_name=name, **kw).devices
  except Exception as e:  # libtpu raises JaxRuntimeError (INVALID_ARGUMENT) for a bad name
    text = " ".join(str(e).split())
    raise UserError(f"--topology: {name!r}: {text.removeprefix('INVALID_ARGUMENT: ')[:300]}") from None
  if devices[0].device_kind not in CHIPS:
    raise UserError(f"--topology: {name!r}: no figures for {devices[0].device_kind!r}; "
                    f"known: {', '.join(sorted(c.name for c in CHIPS.values()))}")
  return list(devices)


def chip_of(devices) -> Chip:
  return CHIPS[devices[0].device_kind]


def hosts_of(devices) -> int:
  return len({d.process_index for d in devices})


@dataclasses.dataclass(frozen=True)
class Measured:
  """One compiled program on one device: memory (bytes), cost and what it implies."""

  name: str
  argument: int
  output: int
  alias: int
  temp: int
  flops: float
  bytes_accessed: float
  seconds: float  # the compiler's `optimal_seconds`
  chip: Chip
  runs: float = 1.0  # times per RL step
  note: str = ""
  loops: int = 0  # while loops in the program: XLA's cost analysis counts each body once
  gathered: float = 0.0  # bytes all-gathered per device, loops by their trip counts
  hbm: float = 0.0  # HBM bytes read and written per device, instruction by instruction
  hlo: str = dataclasses.field(default="", repr=False)  # the optimised module's text

  @property
  def total(self) -> int:
    """Live at once: arguments, outputs not aliased onto (donated) arguments, temporaries."""
    return self.argument + self.output - self.alias + self.temp

  @property
  def mfu(self) -> float:
    return self.flops / (self.seconds * self.chip.peak_flops) if self.seconds > 0 else 0.0

  @property
  def bandwidth_use(self) -> float:
    """The HBM bytes (per instruction, else XLA's bytes accessed) over the estimated time."""
    moved = self.hbm or self.bytes_accessed
    return moved / (self.seconds * self.chip.hbm_bandwidth) if self.seconds > 0 else 0.0

  @property
  def fits(self) -> bool:
    return self.total <= self.chip.hbm_bytes


def measure(name: str, compiled, chip: Chip, *, runs: float = 1.0, note: str = "") -> Measured:
  """XLA's per-device memory and cost analyses of `compiled`, with loops counted by their trip
  counts. XLA's cost analysis costs each `while` body once; the FLOPs here are the module's
  dot FLOPs with every loop body times its trip count (`models.flops.hlo_counts`), and the
  compiler's time and bytes are scaled by the same factor (loop-aware / once-per-body dot
  FLOPs), which takes a loop's share of time and bytes to be its share of the FLOPs. The HBM
  bytes are counted instruction by instruction in the compiled HLO (`models.hlo_bytes`:
  operands and results in HBM, slices and in-place updates by their size, loops by trip
  count). Where the compiler gives no time estimate (a negative
  `optimal_seconds`), the roofline max(flops / peak, HBM bytes / bandwidth) stands in, and
  the note says so."""
  from epgrpo_jax.models.flops import hlo_counts
  from epgrpo_jax.models.hlo_bytes import hlo_hbm_bytes
  mem = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else (cost or {})
  text = compiled.as_text()
  flops, moved = float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))
  seconds = float(cost.get("optimal_seconds", -1.0))
  counts = hlo_counts(text)
  dots, once = counts["dot_flops"], hlo_counts(text, loops=False)["dot_flops"]
  repeat = dots / once if once > 0 else 1.0
  flops, moved = (dots if dots > 0 else flops), moved * repeat
  hbm = hlo_hbm_bytes(text)
  if seconds > 0:
    seconds *= repeat
  else:
    seconds = max(flops / chip.peak_flops, (hbm or moved) / chip.hbm_bandwidth)
    note = "; ".join(filter(None, [note, "no compiler estimate: roofline time"]))
  foreign = foreign_calls(text)
  if foreign:
    note = "; ".join(filter(None, [note, f"FOREIGN CUSTOM CALLS {sorted(foreign)}"]))
  loops = len(while_loops(text))
  if repeat > 1.0001:
    note = "; ".join(filter(None, [note, f"loop bodies x trip counts: {repeat:.1f}x the "
                                         f"once-per-body cost"]))
  return Measured(name, mem.argument_size_in_bytes, mem.output_size_in_bytes,
                  mem.alias_size_in_bytes, mem.temp_size_in_bytes, flops, moved, seconds, chip,
                  runs, note, loops, counts["all_gather_bytes"], hbm, text)


def while_loops(hlo_text: str) -> list[str]:
  """The while instructions of a compiled module's HLO text."""
  return re.findall(r"^\s*(?:ROOT )?%(\S+) = .* while\(", hlo_text, flags=re.M)


def custom_call_targets(hlo_text: str) -> set[str]:
  """The `custom_call_target`s a compiled module's HLO calls."""
  return set(re.findall(r'custom_call_target="([^"]+)"', hlo_text))


# Custom calls that belong to other backends: the project's C++ CPU kernels (FFI targets
# `epgrpo_*`, `kernels/cpu/`), cuDNN and cuBLAS, GPU Triton / Pallas kernels.
FOREIGN_CALLS = re.compile(r"^(epgrpo_|__cudnn|__cublas|__gpu|cu_|triton|__triton)|triton")


def foreign_calls(hlo_text: str) -> set[str]:
  """Custom calls in a TPU program that only another backend implements."""
  return {t for t in custom_call_targets(hlo_text) if FOREIGN_CALLS.search(t)}


def per_device_bytes(tree) -> int:
  """Bytes one device holds of a pytree of sharded `ShapeDtypeStruct`s (the largest shard)."""
  total = 0
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
    total += math.prod(shape) * x.dtype.itemsize
  return total


def one_line(e: BaseException) -> str:
  """A compiler error's message on one line, without its status prefix."""
  return " ".join(str(e).split()).removeprefix("RESOURCE_EXHAUSTED: ")[:300]


def gib(n: float) -> str:
  return f"{n / GiB:.2f}"


HEADER = (f"{'program':<28} {'args':>7} {'out':>7} {'temp':>7} {'total':>7} {'HBM':>5} "
          f"{'GFLOP':>10} {'GB acc':>8} {'GB HBM':>8} {'GB AG':>7} {'est ms':>9} {'MFU':>6} "
          f"{'BW':>5}  note")


def row(m: Measured) -> str:
  """One program's line: memory in GiB per device (against the chip's HBM), cost (FLOPs, XLA's
  bytes accessed, the HBM bytes counted per instruction, bytes all-gathered), the estimated
  time and the MFU and HBM bandwidth use it implies."""
  return (f"{m.name:<28} {gib(m.argument):>7} {gib(m.output):>7} {gib(m.temp):>7} "
          f"{gib(m.total):>7} {m.total / m.chip.hbm_bytes:>5.0%} {m.flops / 1e9:>10.1f} "
          f"{m.bytes_accessed / 1e9:>8.2f} {m.hbm / 1e9:>8.2f} {m.gathered / 1e9:>7.3f} {m.seconds * 1e3:>9.3f} {m.mfu:>6.1%} "
          f"{m.bandwidth_use:>5.0%}  {'' if m.fits else 'DOES NOT FIT; '}{m.note}")
