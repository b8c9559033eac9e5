"""HBM bytes of a compiled program, counted instruction by instruction in its optimized HLO
text (the TPU compiler's): what `tools/tpu_costs.py` sets against a chip's bandwidth. XLA's
own `bytes accessed` counts a whole buffer wherever an instruction touches a slice of it; this
count reads slices and in-place updates by their size and leaves out arrays the compiler
placed in on-core memory, loops by their trip counts (`models.flops`' reading of the text)."""

from __future__ import annotations

import math
import re

from epgrpo_jax.models.flops import _BYTES, _computations, _dims, _trip_count

# Instructions that move no bytes of their own: bookkeeping, views, control flow (a loop's or a
# branch's body is counted where it runs), the second halves of asynchronous pairs (their
# starts are counted) and the TPU compiler's buffer and bitcast custom calls.
_NO_TRAFFIC = re.compile(r"^(parameter|constant|get-tuple-element|tuple|bitcast|while|conditional|"
                         r"call|partition-id|replica-id|after-all|opt-barrier|add-dependency|"
                         r".*-done)$")
_VIEWS = ("AllocateBuffer", "ConcatBitcast", "AssumeGatherIndicesInBound", "AsyncCollectiveDone")
_ARRAY = re.compile(r"\b([a-z]+[0-9]*)\[([0-9,]*)\](\{[^}]*\})?")
_INSTRUCTION = re.compile(r"^(?:ROOT )?%?([\w.\-]+) = (.*?)\s([a-z][a-z0-9\-]*)\(([^)]*)\)")
_RUNS = re.compile(r"(?:body|condition|branch_computations|true_computation|false_computation)="
                   r"\{?%?([\w.\-]+)")


def _hbm_bytes(shape_text: str, everywhere: bool = False) -> float:
  """Bytes of the arrays in a shape (a tuple's summed) that live in HBM: memory space 0 (a
  layout's `S(n)`, n > 0, puts an array in a chip's on-core memories); all with `everywhere`."""
  total = 0.0
  for dtype, dims, layout in _ARRAY.findall(shape_text):
    space = re.search(r"S\(([0-9]+)\)", layout or "")
    if everywhere or not space or space.group(1) == "0":
      total += _BYTES.get(dtype, 4) * math.prod(_dims(dims))
  return total


def _fused_io(comp: str, comps: dict[str, list[str]],
              memo: dict[str, tuple[dict[int, float], float | None]]):
  """What a fusion's computation `comp` reads of its operands and writes: {parameter index:
  bytes} for parameters only sliced (`slice`, `dynamic-slice`, through bitcasts and nested
  fusions: read as their slices) or updated in place (the buffer of a root
  `dynamic-update-slice`: not read), and the bytes written by a root of in-place updates
  (their updates), else None (its result)."""
  if comp in memo:
    return memo[comp]
  lines = comps.get(comp, [])
  shapes, params, users, ops = {}, {}, {}, {}
  root = None
  for ins in lines:
    m = _INSTRUCTION.match(ins)
    if not m:
      continue
    name, shape, op, operands = m.groups()
    shapes[name], ops[name] = shape, (op, ins, re.findall(r"%([\w.\-]+)", operands))
    if op == "parameter":
      params[name] = int(re.search(r"parameter\(([0-9]+)\)", ins).group(1))
    for k, operand in enumerate(ops[name][2]):
      users.setdefault(operand, []).append((k, name))
    if ins.startswith("ROOT"):
      root = name
  parts = ops[root][2] if root and ops[root][0] == "tuple" else ([root] if root else [])
  updates = [ops[n][2][:2] for n in parts if n in ops and ops[n][0] == "dynamic-update-slice"]
  in_place = {buffer for buffer, _ in updates}

  def sliced(name: str) -> float | None:
    """Bytes read of `name` where every use reads a slice of it, else None."""
    total = 0.0
    for k, user in users.get(name, []):
      op, ins, _ = ops[user]
      if op in ("slice", "dynamic-slice") and k == 0:
        total += _hbm_bytes(shapes[user], everywhere=True)
      elif op == "bitcast":
        inner = sliced(user)
        if inner is None:
          return None
        total += inner
      elif op == "fusion":
        inner = _fused_io(re.search(r"calls=%?([\w.\-]+)", ins).group(1), comps, memo)[0].get(k)
        if inner is None:
          return None
        total += inner
      else:
        return None
    return total if users.get(name) else None

  reads = {}
  for name, index in params.items():
    if name in in_place and len(users.get(name, [])) == 1:
      reads[index] = 0.0
    else:
      part = sliced(name)
      if part is not None:
        reads[index] = part
  written = sum(_hbm_bytes(shapes.get(update, "")) for _, update in updates) if updates else None
  memo[comp] = (reads, written)
  return memo[comp]


def hlo_hbm_bytes(hlo_text: str, loops: bool = True) -> float:
  """Bytes an optimized HLO module (`compiled.as_text()`) reads from and writes to HBM: per
  instruction of the computations that run (the entry, loop bodies and conditions, branches,
  each loop's counted its trip count times, or once with `loops=False`), its operands and its
  result, arrays in HBM only (not those the compiler placed in on-core memory). A fusion reads
  each operand once and writes its result once (its inside stays on the core); slices read
  their slice, an in-place `dynamic-update-slice` (or a fusion rooted in one) reads and writes
  its update, not the whole buffer. Unlike XLA's `bytes accessed`, whole buffers that an
  instruction touches a slice of are not counted whole."""
  comps = _computations(hlo_text)
  shapes = {}  # every instruction's and parameter's shape, by name (names are module-unique)
  for lines in comps.values():
    for ins in lines:
      m = _INSTRUCTION.match(ins)
      if m:
        shapes[m.group(1)] = m.group(2)
  fused: dict[str, tuple[dict[int, float], float | None]] = {}
  done: dict[str, float] = {}

  def one(ins: str) -> tuple[float, list[str]]:
    m = _INSTRUCTION.match(ins)
    if not m:
      return 0.0, []
    _, shape, op, operands = m.groups()
    names = re.findall(r"%([\w.\-]+)", operands)
    runs = _RUNS.findall(ins) if op in ("while", "conditional") else (
        re.findall(r"to_apply=%?([\w.\-]+)", ins) if op == "call" else [])
    target = re.search(r'custom_call_target="([^"]+)"', ins)
    if _NO_TRAFFIC.match(op) or (target and target.group(1) in _VIEWS):
      return 0.0, runs
    out = _hbm_bytes(shape)
    if op.endswith("-start"):  # its result tuple repeats the operands first
      out = max(out - sum(_hbm_bytes(shapes.get(n, "")) for n in names), 0.0)
    if op in ("dynamic-slice", "slice", "slice-start"):  # reads its slice of the source
      size = _hbm_bytes(shape, everywhere=True) - (
          sum(_hbm_bytes(shapes.get(n, ""), everywhere=True) for n in names) if op == "slice-start" else 0)
      return (size if names and _hbm_bytes(shapes.get(names[0], "")) else 0.0) + out, runs
    if op == "dynamic-update-slice":
      return 2 * _hbm_bytes(shapes.get(names[1], "")), runs
    reads = [_hbm_bytes(shapes.get(n, "")) for n in names]
    if op == "fusion":
      callee = re.search(r"calls=%?([\w.\-]+)", ins).group(1)
      partial, written = _fused_io(callee, comps, fused)
      reads = [partial.get(k, r) for k, r in enumerate(reads)]
      out = out if written is None else written
    return sum(reads) + out, runs

  def count(comp: str) -> float:
    if comp not in done:
      total = 0.0
      for ins in comps.get(comp, []):
        moved, runs = one(ins)
        trips = _trip_count(ins, comps) if " while(" in ins and loops else 1
        total += moved + trips * sum(count(c) for c in runs)
      done[comp] = total
    return done[comp]

  return count("ENTRY")
