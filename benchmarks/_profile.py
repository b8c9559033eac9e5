"""Device op time of a `jax.profiler` trace, split by the JAX name scope of each op.

Every compiled program's HLO names its instructions and records, per instruction, the name
scope it was traced under (`op_name` metadata, e.g. "jit(f)/while/body/attention/dot_general"
or "transpose(jvp(lm_head))/..."). `op_parts` maps each instruction of the given programs to
a part ("" for loops and calls, whose events span their bodies' ops, and for what a caller
leaves out); `device_time_by_part` sums the durations of the trace's op events by part: the
device planes' "XLA Ops" lines where there are such (GPU, TPU), else every event that names
an HLO op (XLA:CPU runs them on host threads, plane "/host:CPU"). Events carry the id of the
program they ran in (the compiled module's id, read from its serialized proto), so two
programs that use one instruction name are told apart. A program loaded from the persistent
compilation cache runs under another id: its events are matched by module name and
instruction name (the first of the module's programs that names the instruction decides,
so variants of one function at other shapes may lend each other their parts); where an event
has neither, its name alone decides. Such a program also keeps the `op_name`s of the code
that first compiled it (the cache's key leaves metadata out): rollout.py --profile turns the
cache off.

Used by update_gpu.py (attention, LM head, the rest of the update) and rollout.py --profile
(the parts of a decode step).
"""

from __future__ import annotations

import collections
import glob
import re
from typing import Callable, Sequence

CONTAINERS = ("while", "conditional", "call")  # their events span their bodies' ops
INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*? ([a-z][a-z\-]*)\((.*)$")
COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")


def in_scope(op_name: str, scope: str) -> bool:
  """Whether `op_name` was traced under the name scope `scope`, also inside transformations
  ("jvp(attention)", "transpose(jvp(lm_head))")."""
  return re.search(rf"(^|[/(]){re.escape(scope)}([)/]|$)", op_name) is not None


def first_scope(op_name: str | None, scopes: Sequence[str], default: str = "rest") -> str:
  """The first of `scopes` that `op_name` lies in, else `default`."""
  return next((sc for sc in scopes if op_name and in_scope(op_name, sc)), default)


def _varint(data: bytes, i: int) -> tuple[int, int]:
  value = shift = 0
  while True:
    byte = data[i]
    i += 1
    value |= (byte & 0x7F) << shift
    shift += 7
    if byte < 0x80:
      return value, i


def module_id(serialized: bytes) -> int | None:
  """The `id` (field 5) of a serialized HloModuleProto: the program id its trace events carry."""
  i = 0
  while i < len(serialized):
    key, i = _varint(serialized, i)
    field, wire = key >> 3, key & 7
    if wire == 0:
      value, i = _varint(serialized, i)
      if field == 5:
        return value
    elif wire == 2:
      size, i = _varint(serialized, i)
      i += size
    elif wire in (1, 5):
      i += 8 if wire == 1 else 4
    else:  # groups: not in an HloModuleProto
      return None
  return None


def hlo_instructions(hlo_text: str) -> list[tuple[str, str, str | None, str]]:
  """(name, opcode, op_name metadata or None, computation) of each instruction of an HLO text."""
  out, computation = [], ""
  for line in hlo_text.splitlines():
    m = COMPUTATION.match(line)
    if m:
      computation = m.group(1)
      continue
    m = INSTRUCTION.match(line)
    if m:
      op_name = re.search(r'op_name="([^"]*)"', m.group(3))
      out.append((m.group(1), m.group(2), op_name.group(1) if op_name else None, computation))
  return out


PartOf = Callable[[list], list]  # the instructions of one program -> the part of each


def by_scope(scopes: Sequence[str]) -> PartOf:
  """Each instruction's part: the first of `scopes` its op_name lies in, else "rest"."""
  return lambda instructions: [first_scope(op_name, scopes) for _, _, op_name, _ in instructions]


def op_parts(programs, part_of: PartOf) -> dict:
  """Each instruction's part over compiled `programs` (`jax.stages.Compiled`), `part_of`
  deciding it (loops and calls get "", not counted), keyed three ways: "by_id" {(program id,
  instruction): part}; "by_module" {(module name, instruction): part} and "by_name"
  {instruction: part}, the first program that names it deciding (for events of a program
  under another id, or without one)."""
  by_id, by_module, by_name = {}, {}, {}
  for program in programs:
    module = program.runtime_executable().hlo_modules()[0]
    pid = module_id(module.as_serialized_hlo_module_proto())
    instructions = hlo_instructions(program.as_text())
    for (name, opcode, _, _), part in zip(instructions, part_of(instructions)):
      part = "" if opcode in CONTAINERS else part
      by_id[(pid, name)] = part
      by_module.setdefault((module.name, name), part)
      by_name.setdefault(name, part)
  return {"by_id": by_id, "ids": {pid for pid, _ in by_id}, "by_module": by_module, "by_name": by_name}


def part_of_event(stats: dict, op: str, parts: dict, default: str) -> str:
  """The part (`op_parts`) of an op event with `stats`: by program id where the id is one of
  the programs', else by module name where the event has one, else by instruction name."""
  pid = stats.get("program_id")
  if pid is not None and int(pid) in parts["ids"]:
    return parts["by_id"].get((int(pid), op), default)
  if "hlo_module" in stats:
    return parts["by_module"].get((stats["hlo_module"], op), default)
  return parts["by_name"].get(op, default)


def op_lines(trace_dir: str):
  """The profile's lines of op events: the device planes' "XLA Ops" lines, else every line."""
  import jax
  files = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
  data = jax.profiler.ProfileData.from_file(files[0])
  lines = [ln for p in data.planes if p.name.startswith("/device:") for ln in p.lines
           if ln.name == "XLA Ops"]
  return lines or [ln for p in data.planes for ln in p.lines]


def device_time_by_part(trace_dir: str, parts: dict, default: str = "rest") -> dict[str, float]:
  """Seconds of op events in the profile under `trace_dir` by part (`op_parts`); an op of a
  program not in `parts` counts as `default` ("" or None: not counted)."""
  total: dict[str, float] = collections.defaultdict(float)
  for line in op_lines(trace_dir):
    for event in line.events:
      stats = dict(event.stats)
      op = stats.get("hlo_op") or (event.name if line.name == "XLA Ops" else None)
      if not op:
        continue
      part = part_of_event(stats, op, parts, default)
      if part:
        total[part] += event.duration_ns * 1e-9
  return dict(total)


def time_by_part(fn: Callable[[], object], parts: dict, default: str = "rest") -> dict[str, float]:
  """`device_time_by_part` of one call of `fn`, traced with `jax.profiler`."""
  import tempfile

  import jax
  with tempfile.TemporaryDirectory() as trace_dir:
    jax.profiler.start_trace(trace_dir)
    try:
      jax.block_until_ready(fn())
    finally:
      jax.profiler.stop_trace()
    return device_time_by_part(trace_dir, parts, default)


# Public HBM bandwidths (bytes/s) of GPUs by device kind, most specific name first.
HBM_BANDWIDTH = (("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100 NVL", 3.9e12), ("H100", 3.35e12))


def hbm_bandwidth(device_kind: str, override_gbps: float = 0.0) -> float | None:
  """The memory bandwidth in bytes/s: `override_gbps` x 1e9 when set, else by `device_kind`
  (`HBM_BANDWIDTH`); None when unknown (a CPU)."""
  if override_gbps > 0:
    return override_gbps * 1e9
  return next((bw for name, bw in HBM_BANDWIDTH if name in device_kind), None)
