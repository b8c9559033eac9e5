"""Model FLOPs of the RL step's passes, counted in the program where each pass runs: the one
count behind every benchmark's MFU and the trainer's `perf/mfu` metric.

Model FLOPs, not hardware FLOPs: 2 per multiply-add of the model's matrix products on the
tokens that matter (each sequence's prompt and completion tokens but the last, which needs no
forward; the LM head only where a completion token is predicted), whatever padding, packing
slots, rematerialisation or LoRA's small adapter products add on the device. So padding and
recomputation lower the MFU instead of raising it.

- linear: the decoder layers' projections (q, k, v, o, gate, up, down): `layer_params` per
  layer and token.
- attention: q.k and p.v, 2 x num_heads x head_dim multiply-adds per (query, visible key)
  pair and layer, over the causal half only: a sequence of n tokens has n (n + 1) / 2 pairs.
- head: hidden_size x vocab_size per predicted token (the embedding lookup is free).

Backward: activation gradients cost one forward of every product; weight gradients one more
forward of the trained products only: the linear layers and (untied or tied) head under full
fine-tuning, neither under LoRA (its base weights and head are frozen). Attention has no
weights; its backward is 2 forwards (dq, dk, dv, dp).

Where the passes run: the sampler (prefill once per prompt, then one token per row and step);
the scoring program (the policy's forward and the reference forward), unless the update is
fused (`train.fused_update`): then the update program runs the reference forward and its own
differentiated forward stands in for the scoring pass.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Flops:
  """FLOPs of some passes split by where they go."""

  linear: float = 0.0
  attention: float = 0.0
  head: float = 0.0

  @property
  def total(self) -> float:
    return self.linear + self.attention + self.head

  def __add__(self, other: "Flops") -> "Flops":
    return Flops(self.linear + other.linear, self.attention + other.attention,
                 self.head + other.head)

  def scaled(self, linear: float, attention: float, head: float) -> "Flops":
    return Flops(self.linear * linear, self.attention * attention, self.head * head)


def layer_params(cfg) -> int:
  """Weights one token multiplies through in one decoder layer (biases and norms, Qwen3's q/k
  norms included, left out); q, k, v and o by num_heads x head_dim, which need not equal the
  hidden size."""
  d, f, h, k, hd = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                    cfg.head_dim)
  return d * h * hd + 2 * d * k * hd + h * hd * d + 3 * d * f


def causal_pairs(lengths: Sequence[int]) -> int:
  """(query, visible key) pairs of causal attention over sequences of these lengths."""
  n = np.asarray(lengths, np.int64)
  return int(np.sum(n * (n + 1) // 2))


def forward(cfg, lengths: Sequence[int], head_tokens: int) -> Flops:
  """One forward over sequences of `lengths` tokens (each attending causally within itself),
  the head at `head_tokens` of them."""
  tokens = int(np.sum(np.asarray(lengths, np.int64)))
  return Flops(linear=2.0 * cfg.num_layers * layer_params(cfg) * tokens,
               attention=4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * causal_pairs(lengths),
               head=2.0 * cfg.hidden_size * cfg.vocab_size * head_tokens)


def backward(fwd: Flops, *, full_finetune: bool) -> Flops:
  """The backward pass of the forward `fwd`: activation gradients everywhere, weight gradients
  of the trained products (full fine-tuning: linear layers and head)."""
  weights = 1.0 if full_finetune else 0.0
  return fwd.scaled(linear=1.0 + weights, attention=2.0, head=1.0 + weights)


def sampling(cfg, prompt_lengths: Sequence[int], completion_lengths: Sequence[int],
             samples: int) -> Flops:
  """The sampler: each of P prompts (`prompt_lengths`) prefilled once (the head at its last
  token, whose logits give its G rows' first tokens), then its `samples` rows
  (`completion_lengths`, P x G in row order) fed one completion token a step but the last
  (the head at each)."""
  prompts = np.asarray(prompt_lengths, np.int64)
  completions = np.asarray(completion_lengths, np.int64)
  rows_prompt = np.repeat(prompts, samples)
  fed = rows_prompt + np.maximum(completions - 1, 0)  # the last token is never fed
  # per row: the pairs of its whole sequence less those of the shared prompt, counted once
  pairs = causal_pairs(fed) - causal_pairs(rows_prompt) + causal_pairs(prompts)
  tokens = int(prompts.sum() + (fed - rows_prompt).sum())
  return Flops(linear=2.0 * cfg.num_layers * layer_params(cfg) * tokens,
               attention=4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * pairs,
               head=2.0 * cfg.hidden_size * cfg.vocab_size * (len(prompts) + int((fed - rows_prompt).sum())))


def step(cfg, prompt_lengths: Sequence[int], completion_lengths: Sequence[int], samples: int, *,
         full_finetune: bool = False, fused: bool = False, iterations: int = 1) -> dict[str, Flops]:
  """Model FLOPs of one RL step by the program they run in: "sampling", "scoring" (the
  policy's and the reference forward; nothing when `fused`), "update" (forward + backward per
  iteration, plus the reference forward when `fused`) and "total". Lengths: the P prompts'
  and the P x G completions' real tokens (row order)."""
  prompts = np.repeat(np.asarray(prompt_lengths, np.int64), samples)
  completions = np.asarray(completion_lengths, np.int64)
  lengths = np.where(completions > 0, prompts + completions - 1, 0)
  one = forward(cfg, lengths, int(completions.sum()))
  train = one + backward(one, full_finetune=full_finetune)
  update = Flops()
  for _ in range(iterations):
    update = update + train
  scoring = one + one  # the policy's forward and the reference forward
  if fused:
    update, scoring = update + one, Flops()
  out = {"sampling": sampling(cfg, prompt_lengths, completion_lengths, samples),
         "scoring": scoring, "update": update}
  out["total"] = out["sampling"] + out["scoring"] + out["update"]
  return out


# Dense bf16 peak FLOP/s per chip by `jax.Device.device_kind` (vendors' data sheets, no
# sparsity); the first key that the device kind contains wins.
PEAK_BF16 = (("H200", 989e12), ("H100", 989e12), ("GH200", 989e12), ("B200", 2250e12),
             ("A100", 312e12), ("L40S", 362e12), ("TPU v6", 918e12), ("TPU v5p", 459e12),
             ("TPU v5 lite", 197e12), ("TPU v5e", 197e12), ("TPU v4", 275e12))


def peak_flops(device_kind: str, override_tflops: float = 0.0) -> float | None:
  """The chip's dense bf16 peak FLOP/s: `override_tflops` x 1e12 when set, else by
  `device_kind` (`PEAK_BF16`); None when unknown (a CPU)."""
  if override_tflops > 0:
    return override_tflops * 1e12
  return next((peak for name, peak in PEAK_BF16 if name in device_kind), None)


def mfu(flops: float, seconds: float, peak: float | None, chips: int = 1) -> float | None:
  """Model FLOPs utilisation: `flops` done in `seconds` over `chips` chips of `peak` FLOP/s."""
  if not peak or seconds <= 0:
    return None
  return flops / seconds / (peak * chips)


def update_performance(cfg, prompt_lengths, completion_lengths, samples: int, seconds: float, *,
                       full_finetune: bool, fused: bool, iterations: int, peak: float | None,
                       chips: int) -> dict[str, float]:
  """The trainer's `perf/*` metrics of one step's update program(s), run in `seconds`:
  `perf/update_tflops` (model TFLOP/s over all chips) and, with a known `peak`, `perf/mfu`."""
  done = step(cfg, prompt_lengths, completion_lengths, samples, full_finetune=full_finetune,
              fused=fused, iterations=iterations)["update"].total
  out = {"perf/update_tflops": done / max(seconds, 1e-9) / 1e12}
  used = mfu(done, seconds, peak, chips)
  if used is not None:
    out["perf/mfu"] = used
  return out


# -- what XLA compiled ------------------------------------------------------------------------

_SHAPE = re.compile(r"=\s*[a-z]+[0-9]*\[([0-9,]*)\]")
_CALLEES = re.compile(r"(?:calls|body|to_apply|branch_computations)=\{?%?([\w.\-]+)")


def _computations(hlo_text: str) -> dict[str, list[str]]:
  """{computation name ("ENTRY" for the entry): its instruction lines} of an HLO module's text."""
  comps: dict[str, list[str]] = {}
  name = None
  for line in hlo_text.splitlines():
    head = re.match(r"^(ENTRY )?%?([\w.\-]+) \(.*\{$", line)
    if head:
      name = "ENTRY" if head.group(1) else head.group(2)
      comps[name] = []
    elif name is not None and line.strip() not in ("", "}"):
      comps[name].append(line.strip())
  return comps


def _dims(text: str) -> list[int]:
  return [int(x) for x in text.split(",") if x]


def _operand_dims(lines: list[str], operand: str, hlo_text: str) -> list[int]:
  """Dimensions of `operand`: an instruction of the computation, else a parameter."""
  for ins in lines:
    if ins.startswith(f"%{operand} =") or ins.startswith(f"{operand} ="):
      return _dims(_SHAPE.search(ins).group(1))
  return _dims(re.search(rf"\b{re.escape(operand)}: [a-z]+[0-9]*\[([0-9,]*)\]", hlo_text).group(1))


def _window(ins: str, key: str, spatial: int, default: int) -> list[int]:
  """One field of a convolution's `window={...}` per spatial dimension (`pad` as its low side)."""
  window = re.search(r"window=\{([^}]*)\}", ins)
  found = window and re.search(rf"\b{key}=([0-9_x\-]+)", window.group(1))
  if not found:
    return [default] * spatial
  return [int(v.split("_")[0]) for v in found.group(1).split("x")]


def _taps(n: int, k: int, out: int, stride: int, pad: int, lhs_dilate: int, rhs_dilate: int) -> int:
  """(output, window position) pairs of one spatial dimension that meet a real input element
  (not padding, not a hole of the input's dilation)."""
  x = (np.arange(out)[:, None] * stride + np.arange(k)[None, :] * rhs_dilate) - pad
  return int(np.sum((x >= 0) & (x % lhs_dilate == 0) & (x // lhs_dilate < n)))


def _conv_flops(ins: str, lines: list[str], hlo_text: str, out: list[int]) -> float:
  """2 x the multiply-adds of a `convolution` (the TPU compiler writes dots as convolutions,
  batching some through windows over padded or dilated inputs): each output element sums over
  the kernel's input features, and each spatial dimension adds the window positions that meet
  real input (`_taps`)."""
  lhs_name, rhs_name = re.search(r"convolution\(%?([\w.\-]+), %?([\w.\-]+)\)", ins).groups()
  lhs = _operand_dims(lines, lhs_name, hlo_text)
  rhs = _operand_dims(lines, rhs_name, hlo_text)
  lhs_labels, rhs_labels, out_labels = re.search(r"dim_labels=([^_]*)_([^-]*)->(\S+?)[,\s]",
                                                 ins + " ").groups()
  spatial = sum(label.isdigit() for label in rhs_labels)
  field = {key: _window(ins, key, spatial, default) for key, default in
           (("stride", 1), ("pad", 0), ("lhs_dilate", 1), ("rhs_dilate", 1))}
  flops = 2.0 * math.prod(out) * rhs[rhs_labels.index("i")]
  for d in range(spatial):
    label = str(d)
    o = out[out_labels.index(label)]
    flops *= _taps(lhs[lhs_labels.index(label)], rhs[rhs_labels.index(label)], o,
                   field["stride"][d], field["pad"][d], field["lhs_dilate"][d],
                   field["rhs_dilate"][d]) / o
  return flops


def _defining(lines: list[str], name: str) -> str | None:
  """The instruction of `lines` that defines `name`, else None."""
  return next((c for c in lines if c.startswith(f"%{name} =") or c.startswith(f"{name} =")
               or c.startswith(f"ROOT %{name} =")), None)


def _constant(lines: list[str], name: str) -> int | None:
  found = re.search(r"constant\((-?[0-9]+)\)", _defining(lines, name) or "")
  return int(found.group(1)) if found else None


def _counter_step(ins: str, comps: dict[str, list[str]], index: int) -> int:
  """How much a loop's body adds to tuple element `index` (its counter) each trip: the
  constant of a root element `add(counter, constant)` (the TPU compiler's windowed products
  step by 2), else 1."""
  body = comps.get(re.search(r"body=%?([\w.\-]+)", ins).group(1), [])
  root = next((c for c in body if c.startswith("ROOT") and " tuple(" in c), None)
  if root is None:
    return 1
  parts = [p.strip().lstrip("%") for p in
           re.sub(r"/\*[^*]*\*/", "", root.split(" tuple(", 1)[1].rsplit(")", 1)[0]).split(",")]
  update = _defining(body, parts[index]) if index < len(parts) else None
  operands = re.search(r" add\(%?([\w.\-]+), %?([\w.\-]+)\)", update or "")
  if not operands:
    return 1
  for a, b in (operands.groups(), operands.groups()[::-1]):
    counter = re.search(rf"get-tuple-element\(.*index={index}\b", _defining(body, a) or "")
    step = _constant(body, b)
    if counter and step and step > 0:
      return step
  return 1


def _trip_count(ins: str, comps: dict[str, list[str]]) -> int:
  """A while loop's trip count: XLA's `known_trip_count` where the compiler wrote it (CPU,
  GPU), else read from its condition `counter < constant` (the TPU compiler's text; the
  counter of jax's loops starts at 0) and the step the body adds to the counter
  (`_counter_step`). 1 when neither is there."""
  known = re.search(r'known_trip_count":\{"n":"([0-9]+)"', ins)
  if known:
    return int(known.group(1))
  cond = comps.get(re.search(r"condition=%?([\w.\-]+)", ins).group(1), [])
  root = next((c for c in cond if c.startswith("ROOT") and " compare(" in c and "direction=LT" in c),
              None)
  if root is None:
    return 1
  counter, bound = re.search(r"compare\(%?([\w.\-]+), %?([\w.\-]+)\)", root).groups()
  value = _constant(cond, bound)
  if value is None:
    return 1
  element = re.search(r"get-tuple-element\(.*index=([0-9]+)", _defining(cond, counter) or "")
  step = _counter_step(ins, comps, int(element.group(1))) if element else 1
  return max(-(-value // step), 1)


_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4,
          "u32": 4, "f64": 8, "s64": 8, "u64": 8}


def _gathered_bytes(ins: str) -> float:
  """Bytes an all-gather (or its async start) writes: its result's largest array (a start's
  result tuple holds its operand and its result)."""
  result = ins.split(" all-gather", 1)[0]
  return max((_BYTES.get(t, 4) * math.prod(_dims(d))
              for t, d in re.findall(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]", result)), default=0)


@dataclasses.dataclass(frozen=True)
class Gathered:
  """One all-gather of a compiled module: the trip counts of the while loops around it
  (outermost first; () outside every loop), its result's dimensions and its bytes per device."""

  loops: tuple[int, ...]
  dims: tuple[int, ...]
  bytes: float

  @property
  def total(self) -> float:
    """Its bytes times every enclosing loop's trip count."""
    return self.bytes * math.prod(self.loops)


def all_gathers(hlo_text: str) -> list[Gathered]:
  """The all-gathers of an optimized HLO module's text, each where it runs (the while loops
  around it). The TPU compiler splits one all-gather into an asynchronous start, continuation
  fusions that overlap it with other work and a done, each holding a copy of the instruction
  with the same `channel_id`: counted once per loop context (the same channel in the same
  loops). Without a channel id, each instruction counts."""
  comps = _computations(hlo_text)
  found: dict[tuple, Gathered] = {}

  def walk(comp: str, loops: tuple[int, ...], context: tuple[str, ...], seen: frozenset):
    for ins in comps.get(comp, []):
      if re.search(r" all-gather(-start)?\(", ins):
        channel = re.search(r"channel_id=([0-9]+)", ins)
        name = ins.split(" =", 1)[0].removeprefix("ROOT ").lstrip("%")
        key = (channel.group(1) if channel else name, context)
        shape = ins.split(" all-gather", 1)[0]
        dims = max((_dims(d) for _, d in re.findall(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]", shape)),
                   key=math.prod, default=[])
        found.setdefault(key, Gathered(loops, tuple(dims), _gathered_bytes(ins)))
      loop = " while(" in ins
      here = ins.split(" =", 1)[0].removeprefix("ROOT ").lstrip("%")
      for callee in _CALLEES.findall(ins):
        if callee not in seen:
          walk(callee, loops + ((_trip_count(ins, comps),) if loop else ()),
               context + ((here,) if loop else ()), seen | {callee})

  walk("ENTRY", (), (), frozenset())
  return list(found.values())


def hlo_counts(hlo_text: str, loops: bool = True) -> dict[str, float]:
  """{"dot_flops", "exp", "all_gather_bytes"} of an optimized HLO module's text
  (`compiled.as_text()`): 2 x the multiply-adds of every dot (or convolution, as the TPU
  compiler writes dots), the elements of every exponential and the bytes every all-gather
  writes (per device; `all_gathers`: one split into asynchronous parts counted once), each
  loop body counted its trip count times (XLA's `cost_analysis()` counts a loop's body once),
  or once with `loops=False`."""
  comps = _computations(hlo_text)
  done: dict[str, np.ndarray] = {}

  def count(comp: str) -> np.ndarray:
    if comp not in done:
      done[comp] = body(comp)
    return done[comp]

  def body(comp: str) -> np.ndarray:
    flops = exps = 0.0
    inner = np.zeros(2)
    for ins in comps.get(comp, []):
      out = _SHAPE.search(ins)
      if " dot(" in ins and out:
        lhs = _operand_dims(comps[comp], re.search(r"dot\(%?([\w.\-]+)", ins).group(1), hlo_text)
        contract = _dims(re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", ins).group(1))
        flops += 2.0 * math.prod(_dims(out.group(1))) * math.prod(lhs[i] for i in contract)
      elif " convolution(" in ins and out:
        flops += _conv_flops(ins, comps[comp], hlo_text, _dims(out.group(1)))
      elif " exponential(" in ins and out:
        exps += math.prod(_dims(out.group(1)))
      trips = _trip_count(ins, comps) if " while(" in ins and loops else 1
      for callee in _CALLEES.findall(ins):
        inner += trips * count(callee)
    return inner + (flops, exps)

  flops, exps = count("ENTRY")
  gathered = sum(g.total if loops else g.bytes for g in all_gathers(hlo_text))
  return {"dot_flops": float(flops), "exp": float(exps), "all_gather_bytes": float(gathered)}
