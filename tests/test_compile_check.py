"""TPU programs compiled ahead of time on this CPU host (`tools/compile_check.py`): every program
of a tiny config's RL step compiles for a TPU slice with the real TPU compiler (libtpu, the
`tpu` extra), with no CPU-only or GPU-only custom call in it; per-backend choices follow the
mesh's devices, not the host's backend; the command's errors are one line, exit 2."""

from __future__ import annotations

import collections
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from epgrpo_jax.io.commandline import run_main
from epgrpo_jax.io.errors import UserError
from epgrpo_jax.kernels import seam
from epgrpo_jax.models import XLA, preset
from epgrpo_jax.parallel import tpu_env
from epgrpo_jax.tools import compile_check, tpu_costs

ROOT = Path(__file__).resolve().parents[1]
needs_libtpu = pytest.mark.skipif(
    not tpu_costs.libtpu_installed(),
    reason="libtpu is not installed (pip install -e \".[tpu]\"): no TPU ahead-of-time compiles")
TINY = ["--preset", "test-tiny", "--prompt-tokens", "8", "train.prompts_per_step=4",
        "train.num_generations=4", "sampling.max_new_tokens=16", "sampling.top_p=0.9"]


def test_choices_follow_the_programs_platform():
  # The seam picks a TPU program's kernels by its platform, not this CPU host's: XLA's
  # throughout (no C++ kernel, no CPU-only workaround), blockwise attention.
  cfg = preset("test-tiny")
  tpu = seam.for_backend(cfg, "tpu", True)
  assert tpu == dataclasses.replace(XLA, attention="blockwise")
  assert seam.for_backend(cfg.replace(dtype="bfloat16"), "tpu", True).attention == "blockwise"
  assert not tpu.folds_adapters(jnp.float32, 10_000, 64, 64)
  with pytest.raises(UserError, match="model.attention: cudnn runs on GPUs only; this program "
                                       "runs on tpu"):
    seam.for_backend(cfg.replace(attention="cudnn"), "tpu", True)
  assert seam.for_backend(cfg.replace(dtype="bfloat16"), "gpu", True).attention == "cudnn"
  cpu = seam.for_backend(cfg, "cpu", True)
  assert cpu.causal_attention is not None and cpu.attention == "plain"
  assert seam.backend_of(None) == "cpu"  # the suite's backend


def test_libtpu_is_quieted_only_where_no_tpu_is_attached(monkeypatch):
  monkeypatch.setattr(tpu_env, "tpu_attached", lambda: False)
  env = {}
  assert tpu_env.quiet_absent_tpu(env) and env == tpu_env.PLACEHOLDER
  env = {"TPU_WORKER_HOSTNAMES": "10.0.0.2"}
  assert not tpu_env.quiet_absent_tpu(env) and env == {"TPU_WORKER_HOSTNAMES": "10.0.0.2"}
  monkeypatch.setattr(tpu_env, "tpu_attached", lambda: True)
  env = {}
  assert not tpu_env.quiet_absent_tpu(env) and env == {}


@pytest.mark.usefixtures("no_compilation_cache")  # `run` turns the cache off
def test_missing_libtpu_is_one_line_naming_the_extra(monkeypatch, capsys):
  monkeypatch.setattr(tpu_costs, "libtpu_installed", lambda: False)
  args = compile_check.parse_args(["--topology", "v5e:2x2", *TINY])
  assert run_main(lambda: compile_check.run(args)) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "libtpu is not installed" in err and "[tpu]" in err


@pytest.mark.usefixtures("no_compilation_cache")  # `run` turns the cache off
def test_a_program_over_hbm_is_reported_and_exits_1(monkeypatch, capsys):
  class Check:  # what `run` reads of a CompileCheck
    def describe(self):
      return "slice"

    def programs(self):
      def over():
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the "
                                         "total memory required for HLO temporaries (20.94G)\n"
                                         "exceeds available HBM (15.75G).")
      yield "update fused", over

    def summary(self, measured):
      assert measured == []
      return "summary"

  monkeypatch.setattr(tpu_costs, "topology_devices", lambda *a: [])
  monkeypatch.setattr(compile_check.CompileCheck, "create", classmethod(lambda cls, *a: Check()))
  args = compile_check.parse_args(["--topology", "v5e:2x4", *TINY])
  assert compile_check.run(args) == 1
  out = capsys.readouterr().out
  assert "update fused                 DOES NOT FIT: Ran out of memory on HBM, the total memory " \
         "required for HLO temporaries (20.94G) exceeds available HBM (15.75G)." in out
  assert out.endswith("summary\nDOES NOT FIT: update fused (the compiler ran out of HBM)\n")


def _cli(*argv: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="")
  return subprocess.run([sys.executable, "-m", "epgrpo_jax.tools.compile_check", *argv],
                        capture_output=True, text=True, env=env, timeout=600)


@needs_libtpu
def test_a_plain_cpu_run_stays_silent_with_libtpu_installed():
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  env.pop("JAX_PLATFORMS", None)
  for k in tpu_env.PLACEHOLDER:
    env.pop(k, None)
  done = subprocess.run([sys.executable, "-c", "import epgrpo_jax, jax; print(jax.default_backend())"],
                        capture_output=True, text=True, env=env, timeout=120)
  assert (done.returncode, done.stdout, done.stderr) == (0, "cpu\n", "")


@needs_libtpu
@pytest.mark.parametrize("argv, message", [
    (["--topology", "v5e:3x3"], "--topology: 'v5e:3x3'"),
    (["--topology", "nonsense"], "--topology: 'nonsense'"),
    (["--topology", "v5e:2x2", "mesh.data=3"], "mesh: data*fsdp*tensor = 3 but there are 4"),
    (["--topology", "v5e:2x2", "--sampler-mesh", "tensor=3"],
     "--sampler-mesh: mesh: fixed axes (3 devices) do not divide the 4 devices"),
])
def test_bad_topology_or_mesh_is_one_line_exit_2(argv, message):
  done = _cli(*argv, *TINY)
  assert done.returncode == 2, done.stderr
  assert done.stderr.count("\n") == 1 and message in done.stderr, done.stderr


def _programs(check: compile_check.CompileCheck) -> dict:
  """Each program's measurements (`tpu_costs.measure` notes foreign custom calls), by name."""
  return {name: build() for name, build in check.programs()}


@pytest.fixture
def no_compilation_cache():
  """The persistent cache off while compiling for TPU devices this host lacks (their programs
  cannot be loaded back from it)."""
  before = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  yield
  jax.config.update("jax_enable_compilation_cache", before)


@needs_libtpu
@pytest.mark.usefixtures("no_compilation_cache")
@pytest.mark.parametrize("mesh_devices, overrides", [
    # fused update, packed, FSDP over 4 chips; the sampler on its own mesh, weights replicated
    (4, ["train.packing=true", "mesh.data=1", "mesh.fsdp=4", "--sampler-mesh", "data=4"]),
    (1, ["train.fused_update=false", "train.grad_accumulation=2", "model.remat=true",
         "model.dtype=bfloat16"]),  # one chip: where the CPU kernels would be chosen on a CPU
])
def test_tiny_step_compiles_for_v5e_2x2_without_foreign_custom_calls(mesh_devices, overrides):
  devices = tpu_costs.topology_devices("v5e:2x2")[:mesh_devices]
  args = compile_check.parse_args(["--topology", "v5e:2x2", *TINY, *overrides])
  check = compile_check.CompileCheck.create(args, devices)
  measured = _programs(check)
  expected = {"prepare weights", "sampler (whole)", "prefill", "decode block 0", "decode block 1"}
  expected |= ({"update fused"} if mesh_devices == 4 else
               {"score", "advantage", "update gradients (k=2)", "update optimizer step"})
  assert set(measured) == expected
  for name, m in measured.items():
    assert "FOREIGN" not in m.note, (name, m.note)
    assert m.argument > 0 and m.total <= m.chip.hbm_bytes and m.seconds > 0, (name, m)
  # 16 new tokens, segments ending at 8 and 16, blocks of 8: the prefill draws token 0, one
  # block per segment (steps 1-8, then 9-16 with the last masked at the cap).
  assert measured["prefill"].flops > 0
  assert measured["decode block 0"].runs == 1 and measured["decode block 1"].runs == 1
  summary = check.summary(list(measured.values()))
  assert "estimated step" in summary and "/ 8 steps" in summary and "a token" in summary
  assert "MFU (models.flops)" in summary
  if mesh_devices == 4:  # weights replicated on the sampler's mesh: a decode step gathers none
    whole = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(check.parts.sampler_state))
    assert check.sampler_weights_bytes == whole > check.weights_bytes, check.describe()
    for name in ("decode block 0", "decode block 1"):
      assert measured[name].gathered == 0 and "all-gather" not in measured[name].hlo


def laid_out_bytes(shape: str) -> int:
  """The bytes of an HLO array shape as laid out, e.g. `f32[2,2,8,48]{3,1,2,0:T(2,128)}`: its two
  most minor dimensions rounded up to the tile."""
  import math
  import re
  dtype, dims, order, tile = re.match(r"(\w+)\[([0-9,]*)\]\{([0-9,]*)(?::T\(([0-9,]+)\))?", shape).groups()
  dims = [int(d) for d in dims.split(",")]
  if tile:
    minor = [int(d) for d in order.split(",")][:2]
    for d, t in zip(minor, reversed([int(t) for t in tile.split(",")])):
      dims[d] = -(-dims[d] // t) * t
  return math.prod(dims) * {"f32": 4, "bf16": 2}[dtype]


@needs_libtpu
@pytest.mark.usefixtures("no_compilation_cache")
def test_continuous_engine_programs_compile_over_the_prepared_weights():
  """With `sampling.continuous` the sampler's programs are the engine's: the weights prepared
  once a call where they lie (split over the FSDP training mesh: nothing gathered), moved
  onto the sampler's own mesh (replicated), then its prompts' prefill and a block over its 8
  slots, which gather nothing and take the prepared weights only (no second copy: their
  arguments are the weights, the slots' caches and small state)."""
  devices = tpu_costs.topology_devices("v5e:2x2")
  args = compile_check.parse_args(["--topology", "v5e:2x2", *TINY, "mesh.data=1", "mesh.fsdp=4",
                                   "--sampler-mesh", "data=4", "sampling.continuous=true",
                                   "sampling.slots=8"])
  check = compile_check.CompileCheck.create(args, devices)
  measured = {name: build() for name, build in check.programs()
              if name.split()[0] in ("prepare", "continuous", "prefill", "decode", "sampler")}
  assert set(measured) == {"prepare weights", "continuous prefill", "continuous block"}
  for name, m in measured.items():
    assert "FOREIGN" not in m.note and m.seconds > 0 and m.total <= m.chip.hbm_bytes, (name, m)
  assert measured["prepare weights"].gathered == 0
  assert all(x.sharding.is_fully_replicated and x.sharding.mesh is check.parts.sampler_mesh
             for x in jax.tree.leaves(check.parts.sampler_weights))
  for name in ("continuous prefill", "continuous block"):
    assert measured[name].gathered == 0 and "all-gather" not in measured[name].hlo, name
  # 16 requests of 16 tokens through 8 slots: 2 waves of 2 blocks of 8 steps
  assert measured["continuous block"].runs == 4
  weights = tpu_costs.per_device_bytes(check.parts.sampler_weights)
  # the slots' keys and values as the block takes them: in the layout its decode loop writes (its
  # layout picked by the compiler, `continuous.lower_block`), each row's slots major to its
  # heads, the same in and out: no whole-cache copy outside the loop
  block = measured["continuous block"].hlo
  params = [line for line in block.splitlines() if " parameter(" in line and "slots.cache[\\'" in line
            and ("[\\'k\\']" in line or "[\\'v\\']" in line)]
  assert len(params) == 4 and all("{3,1,2,0:" in x or "{2,1,3,0:" in x for x in params), params
  slots_cache = sum(laid_out_bytes(x.split(" = ")[1]) for x in params)
  # besides the weights and the slots' cache: the prompt store, logits and per-slot state, less
  # than a second copy of the weights
  assert weights + slots_cache < measured["continuous block"].argument < 2 * weights + slots_cache
  summary = check.summary(list(measured.values()))
  assert "continuous block (8 slots, 8 steps):" in summary and "a token" in summary


@needs_libtpu
@pytest.mark.usefixtures("no_compilation_cache")
def test_llama_preset_prefill_compiles_without_foreign_custom_calls():
  """A Llama 3.2 preset (the llama3 rotary rule, a tied head over 128,256 rows) cut to one layer:
  its prefill compiles for one v5e chip with XLA's programs only (the whole step of the test
  above takes minutes at this vocabulary on a CPU host)."""
  devices = tpu_costs.topology_devices("v5e:2x2")[:1]
  args = compile_check.parse_args([
      "--topology", "v5e:2x2", "--preset", "llama3.2-1b", "--num-layers", "1", "--prompt-tokens", "8",
      "train.prompts_per_step=2", "train.num_generations=2", "sampling.max_new_tokens=8",
      "model.dtype=bfloat16", "model.param_dtype=bfloat16"])
  check = compile_check.CompileCheck.create(args, devices)
  cfg = check.model_cfg
  assert (cfg.model_type, cfg.rope_scaling, cfg.num_layers) == ("llama", (32.0, 1.0, 4.0, 8192), 1)
  # bf16 base weights: the tied 128,256 x 2,048 table, one layer (60,821,504), the final norm;
  # float32 adapters of rank 32 (the default) on the seven projections: 32 x (in + out) each,
  # 32 x 44,032 in all (q, o 2,048 + 2,048; k, v 2,048 + 512; gate, up, down 2,048 + 8,192).
  assert check.weights_bytes == 2 * (128_256 * 2048 + 60_821_504 + 2048) + 4 * 32 * 44_032
  prefill = dict(check.programs())["prefill"]()
  assert "FOREIGN" not in prefill.note and prefill.flops > 0, prefill.note


@needs_libtpu
@pytest.mark.usefixtures("no_compilation_cache")
def test_decode_on_the_fsdp_training_mesh_all_gathers():
  """Without a sampler mesh the sampler runs on the training mesh: under FSDP a decode block
  all-gathers (the test above: on a mesh of its own with replicated weights it gathers none)."""
  devices = tpu_costs.topology_devices("v5e:2x2")
  args = compile_check.parse_args(["--topology", "v5e:2x2", *TINY, "mesh.data=1", "mesh.fsdp=4"])
  check = compile_check.CompileCheck.create(args, devices)
  assert check.sampler_weights_bytes == check.weights_bytes
  decode = dict(check.programs())["decode block 0"]()
  assert decode.gathered > 0 and "all-gather" in decode.hlo


@needs_libtpu
@pytest.mark.usefixtures("no_compilation_cache")
def test_loops_are_costed_by_their_trip_counts():
  """XLA's cost analysis counts a loop body once; `measure` counts it by its trip count: a loop
  of 10 [256, 256] x [256, 256] products is 10 x 2 x 256^3 FLOPs, and the compiler's time and
  bytes scale by 10 (no product outside the loop), the MFU their ratio."""
  device = tpu_costs.topology_devices("v5e:2x2")[0]
  x = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16,
                           sharding=jax.sharding.SingleDeviceSharding(device))
  loop = jax.jit(lambda a, w: jax.lax.fori_loop(0, 10, lambda i, a: jnp.tanh(a @ w), a))
  compiled = loop.lower(x, x).compile()
  m = tpu_costs.measure("loop", compiled, tpu_costs.chip_of([device]))
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  assert cost["flops"] < 2 * 2 * 256 ** 3  # the compiler's count: one body
  assert m.flops == 10 * 2 * 256 ** 3
  assert m.seconds == pytest.approx(10 * cost["optimal_seconds"], rel=1e-9)
  assert m.bytes_accessed == pytest.approx(10 * cost["bytes accessed"], rel=1e-9)
  assert m.mfu == pytest.approx(m.flops / (m.seconds * 197e12), rel=1e-9)
  assert "10.0x the once-per-body cost" in m.note


@needs_libtpu
@pytest.mark.usefixtures("no_compilation_cache")
def test_head_chunks_stay_within_each_devices_rows():
  """The chunked head log-prob's backward with its rows split over 4 chips: token chunks of the
  flattened rows span chips and all-gather (the hidden-gradient buffer, every chunk); chunks
  within each chip's block of rows (`row_blocks`, what the trainer's programs pass: the mesh's
  data x fsdp through `Kernels.batch_shards`) gather nothing."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec
  from epgrpo_jax.core.token_stats import token_logprob_entropy
  from epgrpo_jax.models.flops import hlo_counts
  mesh = Mesh(np.array(tpu_costs.topology_devices("v5e:2x2")), ("rows",))
  split = NamedSharding(mesh, PartitionSpec("rows"))
  args = (jax.ShapeDtypeStruct((8, 64, 128), jnp.float32, sharding=split),
          jax.ShapeDtypeStruct((128, 1024), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec())),
          jax.ShapeDtypeStruct((8, 64), jnp.int32, sharding=split))

  def gathered(blocks):
    loss = lambda h, w, y: jnp.sum(sum(token_logprob_entropy(h, w, y, token_chunk=32, vocab_chunk=256,
                                                             row_blocks=blocks)))
    return hlo_counts(jax.jit(jax.grad(loss)).lower(*args).compile().as_text())["all_gather_bytes"]

  assert gathered(1) >= 8 * 64 * 128 * 4  # at least the whole f32 hidden gradient
  assert gathered(4) == 0
  sharded = compile_check.CompileCheck.create(
      compile_check.parse_args(["--topology", "v5e:2x2", *TINY, "mesh.data=2", "mesh.fsdp=2"]),
      tpu_costs.topology_devices("v5e:2x2"))
  assert seam.choose(sharded.model_cfg, sharded.mesh, constrain=True).batch_shards == 4
  assert seam.choose(sharded.model_cfg, sharded.mesh).batch_shards == 1


@needs_libtpu
@pytest.mark.usefixtures("no_compilation_cache")
def test_the_head_is_gathered_outside_its_chunk_loops(monkeypatch):
  """The trainer's gradient program (one layer, 2 micro-batches in a scan, remat) with the head
  split over fsdp = 4 chips along its hidden axis: the seam gathers it once (`Kernels.constrain`,
  "head", behind an optimization barrier), outside the chunked log-probs' loops, which run
  inside the micro-batch scan: no all-gather with a vocabulary-sized axis sits two loops deep,
  and the whole [32, 24576] head is gathered. Without the seam's gather, each (token chunk,
  vocabulary chunk) pair gathers its [32, 8192] slab of the head inside those loops."""
  from epgrpo_jax.models.flops import all_gathers
  from epgrpo_jax.parallel import sharding
  vocab = 3 * 8192  # three vocabulary chunks of the objective's 8,192: the head's loops run

  def head_gathers():
    args = compile_check.parse_args([
        "--topology", "v5e:2x2", *TINY, "--num-layers", "1", "mesh.data=1", "mesh.fsdp=4",
        "train.fused_update=false",
        "train.grad_accumulation=2", "model.remat=true", "model.dtype=bfloat16"])
    check = compile_check.CompileCheck.create(args, tpu_costs.topology_devices("v5e:2x2"))
    check = dataclasses.replace(check, model_cfg=check.model_cfg.replace(vocab_size=vocab))
    m = dict(check.programs())["update gradients (k=2)"]()
    return [g for g in all_gathers(m.hlo) if vocab in g.dims or 8192 in g.dims]

  gathered = head_gathers()
  assert any(g.dims == (32, vocab) for g in gathered), gathered
  assert all(len(g.loops) <= 1 for g in gathered), gathered
  constrain = sharding.activation_constraints
  monkeypatch.setattr(sharding, "activation_constraints", lambda mesh: (
      lambda x, kind="hidden", c=constrain(mesh): x if kind == "head" else c(x, kind)))
  assert any(len(g.loops) == 2 and g.dims == (32, 8192) for g in head_gathers())


@needs_libtpu
def test_the_score_passes_gather_the_frozen_weights_each_for_itself(monkeypatch):
  """The score program's policy and reference passes read the same frozen weights (LoRA). Fenced
  apart (`objective.score`), each pass gathers each layer's FSDP-split weights for itself: 2 passes
  x 2 layers of the [32, 64] gate and up and the [64, 32] down, and the head twice. Without the
  fence the compiler gathers each weight once for both passes, and holds every layer's gathered
  copy from one pass to the other (Qwen2.5-7B on a v5e-16: 0.29-0.43 GiB a layer)."""
  from epgrpo_jax.models.flops import all_gathers
  from epgrpo_jax.training import objective

  def gathered():
    args = compile_check.parse_args(["--topology", "v5e:2x2", *TINY, "mesh.data=1", "mesh.fsdp=4",
                                     "train.fused_update=false", "model.dtype=bfloat16"])
    check = compile_check.CompileCheck.create(args, tpu_costs.topology_devices("v5e:2x2"))
    counts = collections.Counter(g.dims for g in all_gathers(dict(check.programs())["score"]().hlo))
    return counts[(32, 64)], counts[(64, 32)], counts[(32, 97)]

  assert gathered() == (8, 4, 2)
  monkeypatch.setattr(objective, "after", lambda state, done: state)
  assert gathered() == (4, 2, 1)


@needs_libtpu
def test_two_host_slice_compiles_from_the_command_line():
  done = _cli("--topology", "v5e:2x4", *TINY, "mesh.data=2", "mesh.fsdp=4", "train.packing=true",
              "--skip", "sampler")
  assert done.returncode == 0, done.stderr
  assert "v5e x 8 (2 hosts)" in done.stdout and "'fsdp': 4" in done.stdout
  assert "update fused" in done.stdout and "FOREIGN" not in done.stdout
  assert "estimated step:" in done.stdout and "fits" in done.stdout


@needs_libtpu
def test_num_layers_cuts_the_model_and_says_so():
  devices = tpu_costs.topology_devices("v5e:2x2")[:1]
  check = compile_check.CompileCheck.create(
      compile_check.parse_args(["--topology", "v5e:2x2", *TINY, "--num-layers", "1"]), devices)
  assert check.model_cfg.num_layers == 1 and ", 1 layers" in check.describe()
  with pytest.raises(UserError, match=r"--num-layers: must be 1 to 2 \(the model's layers\), got 3"):
    compile_check.CompileCheck.create(
        compile_check.parse_args(["--topology", "v5e:2x2", *TINY, "--num-layers", "3"]), devices)


# The TPU compiler's text for two products (from a compiled Qwen2.5-3B scoring program): a
# [16, 2304, 2048] x [2048, 2048] product batched through a window of 16 over one padded
# position, and a batched attention product [16, 2, 8, 512, 512] x [16, 2, 512, 128] through
# dilated windows; and a loop of 7 trips around the first.
TPU_HLO = """\
%fused (p0: bf16[2048,2048], p1: bf16[16,2304,2048]) -> bf16[16,2304,2048] {
  %p0 = bf16[2048,2048,1]{0,1,2:T(8,128)(2,1)} parameter(0)
  %p1 = bf16[16,2304,2048]{1,2,0:T(8,128)(2,1)} parameter(1)
  ROOT %convolution.165 = bf16[16,2304,2048]{1,2,0:T(8,128)(2,1)} convolution(%p0, %p1), window={size=16 pad=15_15 rhs_reversal=1}, dim_labels=fb0_0oi->0fb, metadata={op_name="dot_general"}
}

%attn (q0: f32[16,2,8,512,512], q1: bf16[16,2,512,128,1]) -> f32[16,2,8,512,128] {
  %q0 = f32[16,2,8,512,512]{3,4,2,1,0:T(8,128)} parameter(0)
  %q1 = bf16[16,2,512,128,1]{4,3,2,1,0:T(8,128)(2,1)} parameter(1)
  ROOT %convolution-base-dilated.617 = f32[16,2,8,512,128]{4,3,2,1,0:T(8,128)} convolution(%q0, %q1), window={size=16x2x1 stride=15x1x1 lhs_dilate=16x2x1}, dim_labels=012bf_01io2->012bf
}

%body (a: (s32[], bf16[16,2304,2048], bf16[2048,2048])) -> (s32[], bf16[16,2304,2048], bf16[2048,2048]) {
  %a = (s32[]{:T(128)}, bf16[16,2304,2048]{1,2,0}, bf16[2048,2048]{0,1}) parameter(0)
  %f = bf16[16,2304,2048]{1,2,0:T(8,128)(2,1)} fusion(%w, %x), kind=kOutput, calls=%fused
}

%cond (c: (s32[], bf16[16,2304,2048], bf16[2048,2048])) -> pred[] {
  %c = (s32[]{:T(128)}, bf16[16,2304,2048]{1,2,0}, bf16[2048,2048]{0,1}) parameter(0)
  %constant.3 = s32[]{:T(128)} constant(7)
  %i = s32[]{:T(128)} get-tuple-element(%c), index=0
  ROOT %lt.0 = pred[]{:T(512)} compare(%i, %constant.3), direction=LT
}

ENTRY %main (x: bf16[16,2304,2048], w: bf16[2048,2048]) -> bf16[16,2304,2048] {
  %g = f32[16,2,8,512,128]{4,3,2,1,0:T(8,128)} fusion(%s, %v), kind=kOutput, calls=%attn
  %while = (s32[]{:T(128)}, bf16[16,2304,2048]{1,2,0}, bf16[2048,2048]{0,1}) while(%t), condition=%cond, body=%body
}
"""


def test_tpu_products_are_counted_by_their_real_multiply_adds():
  from epgrpo_jax.models.flops import hlo_counts
  product = 2 * 16 * 2304 * 2048 * 2048
  attention = 2 * 16 * 2 * 8 * 512 * 512 * 128
  assert hlo_counts(TPU_HLO, loops=False)["dot_flops"] == product + attention
  assert hlo_counts(TPU_HLO)["dot_flops"] == 7 * product + attention


# An all-gather in the TPU compiler's asynchronous form, inside a loop of 3 trips: its start,
# a continuation fusion that overlaps it with a product and its done each hold a copy of the
# instruction (channel 5); a second all-gather (channel 6) outside the loop.
TPU_GATHER_HLO = """\
%start (p: bf16[256,1024]) -> (bf16[256,1024], bf16[2048,1024]) {
  %p = bf16[256,1024]{1,0} parameter(0)
  %all-gather.1 = bf16[2048,1024]{1,0} all-gather(%p), channel_id=5, dimensions={0}
  ROOT %custom-call.1 = (bf16[256,1024]{1,0}, bf16[2048,1024]{1,0}) custom-call(%all-gather.1), custom_call_target="AsyncCollectiveStart"
}

%async_collective_fusion.2 (q: bf16[256,1024]) -> bf16[2048,1024] {
  %q = bf16[256,1024]{1,0} parameter(0)
  ROOT %all-gather.2 = bf16[2048,1024]{1,0} all-gather(%q), channel_id=5, dimensions={0}
}

%done (r: bf16[256,1024]) -> bf16[2048,1024] {
  %r = bf16[256,1024]{1,0} parameter(0)
  %all-gather.3 = bf16[2048,1024]{1,0} all-gather(%r), channel_id=5, dimensions={0}
  ROOT %custom-call.3 = bf16[2048,1024]{1,0} custom-call(%r, %all-gather.3), custom_call_target="AsyncCollectiveDone"
}

%body (a: (s32[], bf16[256,1024])) -> (s32[], bf16[256,1024]) {
  %a = (s32[]{:T(128)}, bf16[256,1024]{1,0}) parameter(0)
  %s = (bf16[256,1024]{1,0}, bf16[2048,1024]{1,0}) fusion(%w), kind=kCustom, calls=%start
  %c = bf16[2048,1024]{1,0} fusion(%w), kind=kCustom, calls=%async_collective_fusion.2
  %d = bf16[2048,1024]{1,0} fusion(%w), kind=kCustom, calls=%done
}

%cond (c: (s32[], bf16[256,1024])) -> pred[] {
  %c = (s32[]{:T(128)}, bf16[256,1024]{1,0}) parameter(0)
  %constant.3 = s32[]{:T(128)} constant(3)
  %i = s32[]{:T(128)} get-tuple-element(%c), index=0
  ROOT %lt.0 = pred[]{:T(512)} compare(%i, %constant.3), direction=LT
}

ENTRY %main (w: bf16[256,1024]) -> bf16[2048,1024] {
  %all-gather.4 = f32[64,1024]{1,0} all-gather(%w), channel_id=6, dimensions={0}
  %while = (s32[]{:T(128)}, bf16[256,1024]{1,0}) while(%t), condition=%cond, body=%body
}
"""


# A windowed product as the TPU compiler unrolls it: the body holds two steps and adds 2 to its
# counter, which runs from 0 while below 8: 4 trips of a [64, 32] x [32, 128] product.
TPU_STEP_HLO = """\
%body (a: (u32[], f32[64,128])) -> (u32[], f32[64,128]) {
  %a = (u32[]{:T(128)}, f32[64,128]{1,0}) parameter(0)
  %i = u32[]{:T(128)} get-tuple-element(%a), index=0
  %x = f32[64,32]{1,0} parameter(1)
  %w = f32[32,128]{1,0} parameter(2)
  %dot.1 = f32[64,128]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %two = u32[]{:T(128)} constant(2)
  %next = u32[]{:T(128)} add(%i, %two)
  ROOT %tuple.1 = (u32[]{:T(128)}, f32[64,128]{1,0}) tuple(%next, /*index=1*/%dot.1)
}

%cond (c: (u32[], f32[64,128])) -> pred[] {
  %c = (u32[]{:T(128)}, f32[64,128]{1,0}) parameter(0)
  %bound = u32[]{:T(128)} constant(8)
  %j = u32[]{:T(128)} get-tuple-element(%c), index=0
  ROOT %lt.0 = pred[]{:T(512)} compare(%j, %bound), direction=LT
}

ENTRY %main (t: (u32[], f32[64,128])) -> (u32[], f32[64,128]) {
  %while = (u32[]{:T(128)}, f32[64,128]{1,0}) while(%t), condition=%cond, body=%body
}
"""


def test_a_loop_counter_stepping_by_two_runs_half_the_bound():
  from epgrpo_jax.models.flops import hlo_counts
  assert hlo_counts(TPU_STEP_HLO)["dot_flops"] == 4 * 2 * 64 * 32 * 128


def test_an_asynchronous_all_gather_counts_once_per_loop_trip():
  from epgrpo_jax.models.flops import Gathered, all_gathers, hlo_counts
  inside, outside = 2048 * 1024 * 2, 64 * 1024 * 4
  assert sorted(all_gathers(TPU_GATHER_HLO), key=lambda g: g.loops) == [
      Gathered((), (64, 1024), outside), Gathered((3,), (2048, 1024), inside)]
  assert hlo_counts(TPU_GATHER_HLO)["all_gather_bytes"] == 3 * inside + outside
  assert hlo_counts(TPU_GATHER_HLO, loops=False)["all_gather_bytes"] == inside + outside


# A module in the TPU compiler's form: a fusion over a whole array; a loop of 4 trips whose
# body updates an f32[1024, 256] buffer in place with a [128, 256] slice computed from a
# dynamic slice of a bf16 parameter, and copies a [128, 256] bf16 array into on-core memory
# (S(1)); bookkeeping that moves nothing.
TPU_BYTES_HLO = """\
%fused_scale (p0: bf16[1024,256]) -> f32[1024,256] {
  %p0 = bf16[1024,256]{1,0:T(8,128)(2,1)} parameter(0)
  ROOT %convert.1 = f32[1024,256]{1,0:T(8,128)} convert(%p0)
}

%fused_update (q0: f32[1024,256], q1: bf16[1024,256], q2: s32[]) -> f32[1024,256] {
  %q0 = f32[1024,256]{1,0:T(8,128)} parameter(0)
  %q1 = bf16[1024,256]{1,0:T(8,128)(2,1)} parameter(1)
  %q2 = s32[]{:T(128)} parameter(2)
  %zero = s32[]{:T(128)} constant(0)
  %ds = bf16[128,256]{1,0:T(8,128)(2,1)} dynamic-slice(%q1, %q2, %zero), dynamic_slice_sizes={128,256}
  %cv = f32[128,256]{1,0:T(8,128)} convert(%ds)
  ROOT %dus = f32[1024,256]{1,0:T(8,128)} dynamic-update-slice(%q0, %cv, %q2, %zero)
}

%body (a: (s32[], f32[1024,256], bf16[1024,256])) -> (s32[], f32[1024,256], bf16[1024,256]) {
  %a = (s32[]{:T(128)}, f32[1024,256]{1,0:T(8,128)}, bf16[1024,256]{1,0:T(8,128)(2,1)}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%a), index=0
  %buf = f32[1024,256]{1,0:T(8,128)} get-tuple-element(%a), index=1
  %xb = bf16[1024,256]{1,0:T(8,128)(2,1)} get-tuple-element(%a), index=2
  %upd = f32[1024,256]{1,0:T(8,128)} fusion(%buf, %xb, %i), kind=kLoop, calls=%fused_update
  %part = bf16[128,256]{1,0:T(8,128)(2,1)} slice(%xb), slice={[0:128], [0:256]}
  %cs = (bf16[128,256]{1,0:T(8,128)(2,1)}, bf16[128,256]{1,0:T(8,128)(2,1)S(1)}, u32[]{:S(2)}) copy-start(%part)
  %cd = bf16[128,256]{1,0:T(8,128)(2,1)S(1)} copy-done(%cs)
  %one = s32[]{:T(128)} constant(1)
  %next = s32[]{:T(128)} add(%i, %one)
  ROOT %t = (s32[]{:T(128)}, f32[1024,256]{1,0:T(8,128)}, bf16[1024,256]{1,0:T(8,128)(2,1)}) tuple(%next, %upd, %xb)
}

%cond (c: (s32[], f32[1024,256], bf16[1024,256])) -> pred[] {
  %c = (s32[]{:T(128)}, f32[1024,256]{1,0:T(8,128)}, bf16[1024,256]{1,0:T(8,128)(2,1)}) parameter(0)
  %n = s32[]{:T(128)} constant(4)
  %j = s32[]{:T(128)} get-tuple-element(%c), index=0
  ROOT %lt = pred[]{:T(512)} compare(%j, %n), direction=LT
}

ENTRY %main (x: bf16[1024,256]) -> f32[1024,256] {
  %x = bf16[1024,256]{1,0:T(8,128)(2,1)} parameter(0)
  %y = f32[1024,256]{1,0:T(8,128)} fusion(%x), kind=kLoop, calls=%fused_scale
  %z = s32[]{:T(128)} constant(0)
  %init = (s32[]{:T(128)}, f32[1024,256]{1,0:T(8,128)}, bf16[1024,256]{1,0:T(8,128)(2,1)}) tuple(%z, %y, %x)
  %w = (s32[]{:T(128)}, f32[1024,256]{1,0:T(8,128)}, bf16[1024,256]{1,0:T(8,128)(2,1)}) while(%init), condition=%cond, body=%body
  ROOT %out = f32[1024,256]{1,0:T(8,128)} get-tuple-element(%w), index=1
}
"""


def test_hbm_bytes_count_what_each_instruction_moves():
  """The entry's fusion reads the bf16 array and writes it as f32 (0.5 + 1 MiB); each of the 4
  trips reads a [128, 256] bf16 slice and writes its f32 update in place (64 + 128 KiB, not the
  1 MiB buffer), slices [128, 256] bf16 out of HBM (64 KiB read + 64 KiB written) and copies it
  into on-core memory (64 KiB read); the loop's tuples move nothing, its scalars 25 bytes a
  trip (the counter's add 12, the condition's compare 9, the fusion's index 4)."""
  from epgrpo_jax.models.hlo_bytes import hlo_hbm_bytes
  kib = 1024
  trip = (64 + 128) * kib + (64 + 64) * kib + 64 * kib + 25
  assert hlo_hbm_bytes(TPU_BYTES_HLO, loops=False) == 512 * kib + 1024 * kib + trip
  assert hlo_hbm_bytes(TPU_BYTES_HLO) == 512 * kib + 1024 * kib + 4 * trip
