"""`python -m epgrpo_jax.tools.compile_check --config FILE --topology v5e:2x4 [key=value ...]`

Compiles the programs of one RL step for a TPU slice with the real TPU compiler, on any host
(libtpu, the `tpu` extra), with abstract weights: no checkpoint, no TPU. The mesh is the
config's `mesh.*` over the slice's devices; the programs are the trainer's own (the sampler's
weights prepared once a call, its prefill and a decode block of `sampling.stop_check_every`
steps, or with `sampling.continuous` the engine's prefill and block; scoring, the advantage, the
update, fused or separate, packed and micro-batched as configured). For each it prints the per-device memory against the chip's
HBM, the FLOPs, the bytes accessed, the compiler's estimated time (`optimal_seconds`) and the
MFU and HBM bandwidth use that implies; then the estimated time of the step.

Shapes: the model from `--preset NAME` or `model.path`'s config.json; P x G rows of
`--prompt-tokens` prompt tokens and `--completion-tokens` (default: sampling.max_new_tokens,
every completion at the cap: the worst case a step compiles for) completion tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import re
import sys
import time

from epgrpo_jax.io import commandline
from epgrpo_jax.io.paths import path_flag
from epgrpo_jax.io.errors import UserError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  p = commandline.ArgumentParser(prog="python -m epgrpo_jax.tools.compile_check",
                                 description=__doc__.splitlines()[0])
  p.add_argument("--config", type=path_flag, help="YAML config (as for epgrpo_jax.train)")
  p.add_argument("--topology", required=True, help="TPU slice, e.g. v5e:2x4, v6e:2x4, v5p:2x2x1, "
                 "v5e:4x4")
  p.add_argument("--chips-per-host", help="chips per host as AxB[xC] (libtpu's default 2x2x1)")
  p.add_argument("--sampler-mesh", help="the sampler's own mesh over the same chips, as "
                 "axis=size[,axis=size] (e.g. tensor=8: weights split over tensor; data=8: "
                 "replicated); default: the training mesh (FSDP gathers every weight each token)")
  p.add_argument("--preset", help="model preset for the shapes (e.g. qwen2.5-3b) instead of "
                 "model.path's config.json")
  p.add_argument("--num-layers", type=int, default=0, help="compile the model cut to this many "
                 "decoder layers (0: all): per-layer costs and MFU in minutes where the whole "
                 "model takes an hour; memory is not the whole model's")
  p.add_argument("--prompt-tokens", type=int, default=256, help="real tokens per prompt (256)")
  p.add_argument("--completion-tokens", type=int, default=0,
                 help="tokens per completion (0: sampling.max_new_tokens)")
  p.add_argument("--skip", default="", help="comma-separated programs not to compile: prepare, "
                 "sampler, prefill, decode, continuous, score, advantage, update")
  p.add_argument("--hlo-dir", type=path_flag, help="write each compiled program's optimised HLO "
                 "text here (PROGRAM.hlo)")
  p.add_argument("--debug", action="store_true", help="tracebacks and debug logs")
  p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
  return p.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  commandline.setup_logging(args.debug)
  return commandline.run_main(functools.partial(run, args), debug=args.debug)


def run(args: argparse.Namespace) -> int:
  import jax  # after parsing: fast usage errors
  from epgrpo_jax.tools import tpu_costs
  # Programs compiled for devices this host lacks cannot be loaded back from a cache.
  jax.config.update("jax_enable_compilation_cache", False)
  devices = tpu_costs.topology_devices(args.topology, args.chips_per_host)
  check = CompileCheck.create(args, devices)
  print(check.describe())
  print(tpu_costs.HEADER)
  skip = {s.strip() for s in args.skip.split(",") if s.strip()}
  measured, too_big = [], []
  for name, build in check.programs():
    if name.split()[0] in skip:
      continue
    start = time.perf_counter()
    try:
      m = build()
    except jax.errors.JaxRuntimeError as e:  # the TPU compiler refuses a program over HBM
      if "RESOURCE_EXHAUSTED" not in str(e):
        raise
      print(f"{name:<28} DOES NOT FIT: {tpu_costs.one_line(e)}", flush=True)
      too_big.append(name)
      continue
    measured.append(m)
    if args.hlo_dir:
      write_hlo(args.hlo_dir, m)
    print(tpu_costs.row(m), f"[{time.perf_counter() - start:.0f}s]", flush=True)
  print(check.summary(measured))
  if too_big:
    print(f"DOES NOT FIT: {', '.join(too_big)} (the compiler ran out of HBM)")
  return 1 if too_big else 0


def sampler_mesh_config(text: str):
  """`--sampler-mesh` "axis=size[,axis=size]" as a `MeshConfig` (unnamed axes: data -1, fsdp 1,
  tensor 1)."""
  from epgrpo_jax.parallel.sharding import MESH_AXES, MeshConfig
  sizes = {}
  for part in filter(None, (p.strip() for p in text.split(","))):
    name, _, size = part.partition("=")
    if name not in MESH_AXES or not size.lstrip("-").isdigit():
      raise UserError(f"expected axis=size[,axis=size] over {', '.join(MESH_AXES)}; "
                       f"got {text!r}")
    sizes[name] = int(size)
  return MeshConfig(**sizes)


def write_hlo(directory, m) -> None:
  """`m`'s optimised HLO text as DIRECTORY/NAME.hlo (the name's spaces and signs as `_`)."""
  from pathlib import Path
  out = Path(directory)
  out.mkdir(parents=True, exist_ok=True)
  (out / (re.sub(r"[^\w.-]+", "_", m.name).strip("_") + ".hlo")).write_text(m.hlo)


@dataclasses.dataclass
class CompileCheck:
  """What one RL step compiles, with abstract arguments on a TPU mesh."""

  cfg: object  # TrainConfig
  model_cfg: object  # ModelConfig
  mesh: object
  chip: object
  prompt_tokens: int
  completion_tokens: int
  hosts: int
  sampler_mesh: object = None  # None: the training mesh

  @classmethod
  def create(cls, args, devices) -> "CompileCheck":
    from epgrpo_jax.models import load_hf_config, preset
    from epgrpo_jax.parallel.sharding import make_mesh
    from epgrpo_jax.tools import tpu_costs
    from epgrpo_jax.training.config import EMBEDDED, load_config
    overrides = list(args.overrides) + (["model.path=embedded"] if args.preset else [])
    cfg = load_config(args.config, overrides)  # with --preset, model.path is not read
    if args.preset:
      model_cfg = preset(args.preset)
    elif cfg.model.path == EMBEDDED:
      raise UserError("--preset: name a preset (e.g. qwen2.5-3b); the embedded model is built at "
                       "run time and has no config.json to read shapes from")
    else:
      model_cfg = load_hf_config(cfg.model.path)
    model_cfg = model_cfg.replace(dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype)
    if args.num_layers:
      if not 1 <= args.num_layers <= model_cfg.num_layers:
        raise UserError(f"--num-layers: must be 1 to {model_cfg.num_layers} (the model's layers), "
                         f"got {args.num_layers}")
      model_cfg = model_cfg.replace(num_layers=args.num_layers)
    if args.prompt_tokens < 1 or args.completion_tokens < 0:
      raise UserError("--prompt-tokens, --completion-tokens: must be >= 1 (0: the cap)")
    completion = args.completion_tokens or cfg.sampling.max_new_tokens
    if completion > cfg.sampling.max_new_tokens:
      raise UserError(f"--completion-tokens: {completion} exceeds sampling.max_new_tokens "
                       f"{cfg.sampling.max_new_tokens}")
    mesh = make_mesh(cfg.mesh, devices)
    sampler_mesh = None
    if args.sampler_mesh:
      try:
        sampler_mesh = make_mesh(sampler_mesh_config(args.sampler_mesh), devices)
      except UserError as e:
        raise UserError(f"--sampler-mesh: {e}") from None
    return cls(cfg, model_cfg, mesh, tpu_costs.chip_of(devices), args.prompt_tokens, completion,
               tpu_costs.hosts_of(devices), sampler_mesh)

  def describe(self) -> str:
    t, c = self.cfg.train, self.chip
    return (f"{c.name} x {self.mesh.size} ({self.hosts} host{'s' * (self.hosts > 1)}), mesh "
            f"{dict(self.mesh.shape)}; {c.hbm_bytes / 2 ** 30:.0f} GiB HBM, "
            f"{c.peak_flops / 1e12:.0f} TFLOP/s bf16, {c.hbm_bandwidth / 1e9:.0f} GB/s per chip\n"
            f"P x G = {t.prompts_per_step} x {t.num_generations}, prompt {self.prompt_tokens} + "
            f"completion {self.completion_tokens} tokens (max_new_tokens "
            f"{self.cfg.sampling.max_new_tokens}), packing {t.packing}, remat "
            f"{self.cfg.model.remat}, grad_accumulation {t.grad_accumulation}, dtype "
            f"{self.cfg.model.dtype}/{self.cfg.model.param_dtype}, {self.model_cfg.num_layers} "
            f"layers\n"
            f"per device: weights {self.weights_bytes / 2 ** 30:.2f} GiB; sampler mesh "
            f"{dict(self.parts.sampler_mesh.shape)}"
            f"{' (the training mesh)' if self.sampler_mesh is None else ''}, its weights "
            f"{self.sampler_weights_bytes / 2 ** 30:.2f} GiB")

  # -- the trainer's objects, abstract -----------------------------------------------------

  @functools.cached_property
  def parts(self):
    from epgrpo_jax.tools import step_abstract
    return step_abstract.StepParts.create(self.cfg, self.model_cfg, self.mesh,
                                          self.prompt_tokens, self.completion_tokens,
                                          self.sampler_mesh)

  @property
  def weights_bytes(self) -> int:
    from epgrpo_jax.tools.tpu_costs import per_device_bytes
    return per_device_bytes((self.parts.trainable, self.parts.frozen))

  @property
  def sampler_weights_bytes(self) -> int:
    """The weights one device holds for the sampler: what one decode step must read at least."""
    from epgrpo_jax.tools.tpu_costs import per_device_bytes
    return per_device_bytes(self.parts.sampler_state)

  def programs(self):
    """(name, () -> Measured) of each program of one step, in the order a step runs them."""
    from epgrpo_jax.tools.tpu_costs import measure
    p, t = self.parts, self.cfg.train
    ch = self.chip
    yield "prepare weights", lambda: measure("prepare weights", p.weights_program(), ch,
                                             note="once a sampling call")
    yield from self.sampler_programs()
    updates = t.num_iterations * t.mini_batches
    if p.fused:
      for name, compiled in p.fused_programs():
        yield f"update {name}", functools.partial(lambda n, c: measure(f"update {n}", c(), ch), name,
                                                  compiled)
      return
    yield "score", lambda: measure(
        "score" if not t.reuse_sampler_logprobs else "score (reference only)", p.score_program(), ch)
    yield "advantage", lambda: measure("advantage", p.advantage_program(), ch)
    for name, compiled in p.update_programs():
      yield f"update {name}", functools.partial(
          lambda n, c: measure(f"update {n}", c(), ch, runs=updates,
                               note=f"x {updates} updates" if updates > 1 else ""), name, compiled)

  def sampler_programs(self):
    """(name, () -> Measured) of the sampler's programs after the weights': the static
    sampler's (whole, prefill, a decode block per cache segment), or with `sampling.continuous`
    the engine's (its prompts' prefill and a block over all its slots)."""
    from epgrpo_jax.tools.tpu_costs import measure
    p, ch, s = self.parts, self.chip, self.cfg.sampling
    if s.continuous:
      yield "continuous prefill", lambda: measure("continuous prefill", p.slot_prefill_program(), ch)
      blocks = p.slot_blocks()
      name = f"continuous block ({s.slots} slots, {s.refill_every} steps)"
      yield "continuous block", lambda: measure(
          name, p.slot_block_program(), ch, runs=blocks,
          note=f"x {blocks} blocks: {p.rows} requests of {self.completion_tokens} tokens")
      return
    yield "sampler (whole)", lambda: measure(
        "sampler (whole)", p.sampler_program("sample"), ch, runs=0,
        note="memory of the whole program; its cost counts each decode loop body once")
    yield "prefill", lambda: measure("prefill", p.sampler_program("prefill"), ch)
    k = p.block_steps
    for j, (slots, blocks) in enumerate(p.decode_segments()):
      yield f"decode block {j}", functools.partial(
          lambda j, slots, blocks: measure(f"decode block {j} ({slots} slots, {k} steps)",
                                           p.decode_block_program(slots), ch, runs=blocks,
                                           note=f"x {blocks} blocks of {k} steps"), j, slots, blocks)

  def summary(self, measured) -> str:
    """The step's estimated time (sum of runs x estimated seconds), the largest per-device
    memory, and each decode block's time per token (its time / `sampling.stop_check_every`
    steps) against the weight read one token's step needs."""
    step = sum(m.runs * m.seconds for m in measured)
    peak = max((m.total for m in measured), default=0)
    lines = [f"estimated step: {step:.2f} s (each program's estimated time x its runs; sampling "
             f"runs whole decode blocks to the longest completion)",
             f"largest per-device memory: {peak / 2 ** 30:.2f} GiB of "
             f"{self.chip.hbm_bytes / 2 ** 30:.0f} GiB: "
             f"{'fits' if peak <= self.chip.hbm_bytes else 'DOES NOT FIT'}"]
    lines += self.update_mfu(measured)
    read = self.sampler_weights_bytes / self.chip.hbm_bandwidth
    for m in measured:
      k = {"decode": self.parts.block_steps, "continuous": self.cfg.sampling.refill_every}.get(
          m.name.split()[0])
      if k and m.name.split()[1] == "block":
        token = m.seconds / k
        lines.append(f"{m.name}: {m.seconds * 1e3:.3f} ms a block / {k} steps = {token * 1e3:.3f} ms "
                     f"a token = {token / read:.2f} x the read of its weights ({read * 1e3:.3f} ms)")
    return "\n".join(lines)

  def update_mfu(self, measured) -> list[str]:
    """The update's MFU by the one FLOP model (`models.flops.step`: model FLOPs, what the
    trainer's `perf/mfu` counts) over its estimated time, beside the compiled FLOPs."""
    from epgrpo_jax.models import flops
    update = [m for m in measured if m.name.startswith("update")]
    seconds = sum(m.runs * m.seconds for m in update)
    if not update or seconds <= 0:
      return []
    t = self.cfg.train
    model = flops.step(self.model_cfg, [self.prompt_tokens] * t.prompts_per_step,
                       [self.completion_tokens] * self.parts.rows, t.num_generations,
                       full_finetune=self.cfg.model.full_finetune, fused=self.parts.fused,
                       iterations=t.num_iterations)["update"].total / self.mesh.size
    compiled = sum(m.runs * m.flops for m in update)
    return [f"update: {model / 1e12:.1f} model TFLOP per chip in {seconds:.2f} s = "
            f"{model / (seconds * self.chip.peak_flops):.1%} MFU (models.flops); compiled "
            f"{compiled / 1e12:.1f} TFLOP per chip (recomputation and padding included)"]


if __name__ == "__main__":
  sys.exit(main())
