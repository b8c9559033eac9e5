"""C++ XLA FFI kernels for the CPU, built on first use: the CPU backend behind the seam
(`kernels.seam`; `kernels.cpu.backend` builds its `Kernels`).

`decode_attention`: XLA:CPU runs the decode step's attention (a few hundred
`[G, Hd] x [Hd, S]` products per layer) well below memory bandwidth, and reads
every cache slot, including the ones not yet written; the kernel reads only the
slots up to the current one, a prompt's slots once for its G rows, and shares
the rows over XLA's intra-op threads. `largest_threshold`: the top-k / top-p
bisection of `strategies.largest_threshold`, one vectorised sweep of a row per
step instead of a dozen single-threaded XLA loop iterations over the batch.
`packed_matmul`: a bf16 matmul on the CPU's AMX tiles by a weight packed once
(`pack_bf16`); at decode shapes XLA's dots reread each weight from memory far
below bandwidth (`amx_available()` says whether it runs here); on a CPU without
AMX the same packed weight is multiplied with AVX512-BF16 dot products
(`unit="avx512"`, `pairs_available()`). `panel_matmul`: a float32 matmul on
AVX-512 by a weight packed once into panels of 32 columns (`pack_panels`), for
the same reason (`panels_available()`).
`cpu.cc` is compiled with the system's C++
compiler (`$CXX`, else `c++`) into `$EPGRPO_KERNEL_DIR` (default
`~/.cache/epgrpo_jax/kernels`), keyed by the source, the flags, the jax version
and the CPU; without a compiler, `available()` is False (one warning) and
callers keep the XLA path. `$EPGRPO_CPU_KERNELS=0` turns every kernel off the same way
(nothing is built; `available()` is False): the model's attention and SwiGLU, the sampler's
and the update's products all take XLA's path, as on a machine without a compiler.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from epgrpo_jax.io.errors import UserError
from epgrpo_jax.models import concatenated

logger = logging.getLogger("epgrpo_jax.models")

TARGETS = {"epgrpo_decode_attention": "EpgrpoDecodeAttention",
           "epgrpo_decode_attention_bf16": "EpgrpoDecodeAttentionBf16",
           "epgrpo_largest_threshold": "EpgrpoLargestThreshold",
           "epgrpo_nucleus_draw": "EpgrpoNucleusDraw",
           "epgrpo_packed_matmul": "EpgrpoPackedMatmul",
           "epgrpo_packed_matmul_f32": "EpgrpoPackedMatmulF32",
           "epgrpo_pair_matmul": "EpgrpoPairMatmul",
           "epgrpo_pair_matmul_f32": "EpgrpoPairMatmulF32",
           "epgrpo_panel_matmul": "EpgrpoPanelMatmul",
           "epgrpo_pack_panels": "EpgrpoPackPanels",
           "epgrpo_causal_attention": "EpgrpoCausalAttention",
           "epgrpo_causal_attention_grad": "EpgrpoCausalAttentionGrad",
           "epgrpo_swiglu": "EpgrpoSwiglu",
           "epgrpo_swiglu_grad": "EpgrpoSwigluGrad"}  # FFI target: C++ symbol
SOURCES = tuple(Path(__file__).with_name(name) for name in ("cpu.cc", "attention.cc", "mlp.cc"))
HEADERS = (Path(__file__).with_name("common.h"),)
FLAGS = ("-O3", "-march=native", "-std=c++17", "-fopenmp-simd", "-fno-math-errno", "-shared", "-fPIC")


def _cpu_signature() -> str:
  """The CPU's feature flags (a library built with -march=native runs only where they match)."""
  try:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith(("flags", "Features")):
        return line
  except OSError:
    pass
  return platform.machine()


def cache_dir() -> Path:
  return Path(os.environ.get("EPGRPO_KERNEL_DIR") or Path.home() / ".cache" / "epgrpo_jax" / "kernels")


def build(compiler: str | None = None, directory: Path | None = None) -> Path:
  """Compiles the kernel (if not already built) and returns the shared library's path.

  Raises RuntimeError with the compiler's last line of output if it fails.
  """
  compiler = compiler or os.environ.get("CXX") or "c++"
  directory = directory or cache_dir()
  key = hashlib.sha256("\n".join([
      *(f.read_text() for f in SOURCES + HEADERS), compiler, " ".join(FLAGS), jax.__version__, _cpu_signature()]).encode())
  target = directory / f"cpu_kernels-{key.hexdigest()[:16]}.so"
  if target.exists():
    return target
  if shutil.which(compiler) is None:
    raise RuntimeError(f"C++ compiler {compiler!r} not found (set CXX)")
  directory.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=directory) as tmp:  # then an atomic rename
    partial = Path(tmp) / target.name
    cmd = [compiler, *FLAGS, "-I", jax.ffi.include_dir(), *map(str, SOURCES), "-o", str(partial)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
      last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
      raise RuntimeError(f"{compiler} failed on {', '.join(f.name for f in SOURCES)}: {last}")
    os.replace(partial, target)
  logger.info("built the CPU kernels: %s", target)
  return target


SWITCH_ENV = "EPGRPO_CPU_KERNELS"  # 0/false/off/no: never build or use the kernels
_SWITCH = {"": True, "1": True, "true": True, "on": True, "yes": True,
           "0": False, "false": False, "off": False, "no": False}


def switched_on(value: str | None) -> bool:
  """Whether `$EPGRPO_CPU_KERNELS` (`value`; None: unset) lets the kernels run."""
  choice = _SWITCH.get((value or "").strip().lower())
  if choice is None:
    raise UserError(f"${SWITCH_ENV}: {value!r} is neither on (1, true, on, yes) nor off "
                    f"(0, false, off, no)")
  return choice


@functools.cache
def available() -> bool:
  """Builds and registers the kernels once per process; False (with a warning) if it cannot,
  and False without building when `$EPGRPO_CPU_KERNELS` turns them off (read once)."""
  if not switched_on(os.environ.get(SWITCH_ENV)):
    logger.info("CPU kernels off ($%s=%s): XLA's paths throughout", SWITCH_ENV,
                os.environ[SWITCH_ENV])
    return False
  try:
    library = ctypes.cdll.LoadLibrary(str(build()))
    for target, symbol in TARGETS.items():
      jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)),
                                  platform="cpu")
  except (RuntimeError, OSError, subprocess.SubprocessError) as e:
    logger.warning("CPU kernels unavailable, using XLA's attention and thresholds: %s", e)
    return False
  return True


@functools.cache
def amx_available() -> bool:
  """Whether `packed_matmul` runs here: the kernels are built for a CPU with AMX-BF16 tiles
  and Linux grants this process their state."""
  return available() and bool(ctypes.cdll.LoadLibrary(str(build())).EpgrpoAmxReady())


@functools.cache
def pairs_available() -> bool:
  """Whether `packed_matmul(..., unit="avx512")` runs here: the kernels are built for a CPU
  with AVX512-BF16."""
  return available() and bool(ctypes.cdll.LoadLibrary(str(build())).EpgrpoPairsReady())


def bf16_unit() -> str | None:
  """Where `packed_matmul` runs here: "amx" (`amx_available()`), else "avx512"
  (`pairs_available()`); None where neither can."""
  if amx_available():
    return "amx"
  return "avx512" if pairs_available() else None


@functools.cache
def panels_available() -> bool:
  """Whether `panel_matmul` runs here: the kernels are built for a CPU with AVX-512."""
  return available() and bool(ctypes.cdll.LoadLibrary(str(build())).EpgrpoPanelsReady())


def decode_attention(q_BxKxGxHd, keys_BxKxHdxS, values_BxKxSxHd, allowed_BxS, limit, *,
                     share_rows: int = 1, shared_slots: int = 0):
  """softmax(q . keys / sqrt(Hd)) . values over the slots < `limit` that `allowed_BxS` marks.

  Rows come in groups of `share_rows` consecutive rows whose keys and values in slots
  `[0, shared_slots)` are identical (a prompt's cache copied to its G samples); the kernel
  reads those slots from each group's first row only. A bfloat16 cache is read as it is
  (half the bytes of float32), any other as float32; the arithmetic is float32 and the
  output has q's dtype. Call `available()` first.
  """
  cache_dtype = jnp.bfloat16 if keys_BxKxHdxS.dtype == values_BxKxSxHd.dtype == jnp.bfloat16 \
      else jnp.float32
  target = "epgrpo_decode_attention_bf16" if cache_dtype == jnp.bfloat16 else "epgrpo_decode_attention"
  out = jax.ShapeDtypeStruct(q_BxKxGxHd.shape, jnp.float32)
  return jax.ffi.ffi_call(target, out)(
      q_BxKxGxHd.astype(jnp.float32), keys_BxKxHdxS.astype(cache_dtype),
      values_BxKxSxHd.astype(cache_dtype), allowed_BxS.astype(bool),
      jnp.asarray(limit, jnp.int32), share_rows=np.int64(share_rows),
      shared_slots=np.int64(shared_slots)).astype(q_BxKxGxHd.dtype)


def largest_threshold(values_BxV: jax.Array, weights_BxV: jax.Array, target_B: jax.Array) -> jax.Array:
  """`strategies.largest_threshold` in C++ (masses summed in float64); call `available()` first."""
  out = jax.ShapeDtypeStruct(values_BxV.shape[:1], jnp.float32)
  return jax.ffi.ffi_call("epgrpo_largest_threshold", out)(
      values_BxV.astype(jnp.float32), weights_BxV.astype(jnp.float32), target_B.astype(jnp.float32))


def row_uniforms(key: jax.Array, b: int) -> jax.Array:
  """The draw's [B] float32 uniforms in [0, 1) (this draw's and `strategies.categorical`'s):
  from one key, `uniform(key, (B,))`; from [B] keys (one per row, a request's key folded
  with its token's position), one uniform of each, so a row's draw depends on its key alone."""
  if key.ndim == 0:
    return jax.random.uniform(key, (b,), jnp.float32)
  return jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(key)


def nucleus_draw(key: jax.Array, logits_BxV: jax.Array, temperature: float,
                 top_p: float) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`strategies.sample_step` with top-k off and temperature > 0, in one C++ call: (tokens_B
  int32, logp_B, entropy_B), the same draw for the same key (one, or [B]: `row_uniforms`)
  up to float rounding. Call `available()` first."""
  b = logits_BxV.shape[0]
  u_B = row_uniforms(key, b)
  outs = (jax.ShapeDtypeStruct((b,), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.float32),
          jax.ShapeDtypeStruct((b,), jnp.float32))
  return tuple(jax.ffi.ffi_call("epgrpo_nucleus_draw", outs)(
      logits_BxV.astype(jnp.float32), u_B, temperature=np.float32(temperature),
      top_p=np.float32(top_p)))


def can_pack(w_KxN: jax.Array) -> bool:
  """Whether `pack_bf16` takes this weight: 2-D, K a multiple of 32, N of 16."""
  return w_KxN.ndim == 2 and w_KxN.shape[0] % 32 == 0 and w_KxN.shape[1] % 16 == 0


def pack_bf16(w_KxN: jax.Array) -> jax.Array:
  """w as bf16 tiles for `packed_matmul`: [N/16, K/32, 16, 32], row r of tile (n, c) holding
  w[32c + 2r, 16n + j] and w[32c + 2r + 1, 16n + j] for j = 0..15 in turn."""
  k, n = w_KxN.shape
  w = w_KxN.astype(jnp.bfloat16).reshape(k // 32, 16, 2, n // 16, 16)
  return w.transpose(3, 0, 1, 4, 2).reshape(n // 16, k // 32, 16, 32)


def packed_matmul(x: jax.Array, packed: jax.Array, out_dtype=jnp.bfloat16, *,
                  unit: str = "amx") -> jax.Array:
  """x @ w for w packed by `pack_bf16`, over x's last axis: x rounded to bf16, float32
  accumulation, the result in `out_dtype` (bfloat16: rounded once, or float32). `unit`
  "amx" multiplies on AMX tiles (call `amx_available()` first), "avx512" with AVX512-BF16
  dot products of pairs (`pairs_available()`)."""
  if jnp.dtype(out_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
    raise ValueError(f"packed_matmul: out_dtype must be bfloat16 or float32, got {out_dtype}")
  if unit not in ("amx", "avx512"):
    raise ValueError(f"packed_matmul: unit must be 'amx' or 'avx512', got {unit!r}")
  blocks = packed.shape[0]
  lead, k = x.shape[:-1], x.shape[-1]
  x_MxK = x.astype(jnp.bfloat16).reshape(-1, k)
  m = x_MxK.shape[0]
  pad = -m % 16 if unit == "amx" else 0  # AMX takes rows in blocks of 16
  if pad:
    x_MxK = jnp.pad(x_MxK, ((0, pad), (0, 0)))
  target = ("epgrpo_packed_matmul" if unit == "amx" else "epgrpo_pair_matmul") + (
      "_f32" if jnp.dtype(out_dtype) == jnp.float32 else "")
  out = jax.ShapeDtypeStruct((m + pad, 16 * blocks), jnp.dtype(out_dtype))
  y = jax.ffi.ffi_call(target, out)(x_MxK, packed.astype(jnp.bfloat16))
  return y[:m].reshape(*lead, 16 * blocks)


# Smallest weight (K x N elements) `panel_matmul` takes: below it XLA's dot is as fast.
PANEL_MIN_SIZE = 1 << 16


def can_pack_panels(weights: Sequence[jax.Array]) -> bool:
  """Whether `pack_panels` takes these weights: 2-D float32 [K, N_i], one K, sum N_i a
  multiple of 32, at least `PANEL_MIN_SIZE` elements in all."""
  return (all(w.ndim == 2 and w.dtype == jnp.float32 and w.shape[0] == weights[0].shape[0]
              for w in weights)
          and sum(w.shape[1] for w in weights) % 32 == 0
          and sum(w.size for w in weights) >= PANEL_MIN_SIZE)


def pack_panels(weights: Sequence[jax.Array]) -> jax.Array:
  """The weights [K, N_i] concatenated over columns (w, N = sum N_i) as panels of 32 columns
  for `panel_matmul`: [N/32, K, 32], panel p holding w[:, 32p : 32p + 32]. Call
  `panels_available()` first."""
  k, n = weights[0].shape[0], sum(w.shape[1] for w in weights)
  out = jax.ShapeDtypeStruct((n // 32, k, 32), jnp.float32)
  return jax.ffi.ffi_call("epgrpo_pack_panels", out)(*(w.astype(jnp.float32) for w in weights))


def panel_matmul(x: jax.Array, packed: jax.Array) -> jax.Array:
  """x @ w in float32 for w packed by `pack_panels`, over x's last axis, each sum taken over
  k in order. Call `panels_available()` first."""
  lead, k = x.shape[:-1], x.shape[-1]
  x_MxK = x.astype(jnp.float32).reshape(int(np.prod(lead)), k)
  out = jax.ShapeDtypeStruct((x_MxK.shape[0], 32 * packed.shape[0]), jnp.float32)
  y = jax.ffi.ffi_call("epgrpo_panel_matmul", out)(x_MxK, packed.astype(jnp.float32))
  return y.reshape(*lead, out.shape[1])


@dataclasses.dataclass(frozen=True)
class Packing:
  """Products by weights packed once. `can_pack(ws)` and `pack(ws)` take a projection
  group's weights [K, N_i] (packed as their concatenation over columns); `matmul(x, packed)`
  gives the product in the weights' dtype, `logits(x, packed)` in float32."""

  can_pack: Callable[[Sequence[jax.Array]], bool]
  pack: Callable[[Sequence[jax.Array]], jax.Array]
  matmul: Callable[..., jax.Array]
  logits: Callable[..., jax.Array]


def _bf16_packing(unit: str) -> Packing:
  return Packing(lambda ws: can_pack(concatenated(ws)), lambda ws: pack_bf16(concatenated(ws)),
                 functools.partial(packed_matmul, unit=unit),
                 functools.partial(packed_matmul, out_dtype=jnp.float32, unit=unit))


BF16_PACKINGS = {unit: _bf16_packing(unit) for unit in ("amx", "avx512")}
PANELS_F32 = Packing(can_pack_panels, pack_panels, panel_matmul, panel_matmul)


def packing_for(dtype) -> Packing | None:
  """The packed products that run here for a model computing in `dtype`: for bfloat16 on
  AMX tiles or AVX512-BF16 dot products (`bf16_unit()`), for float32 on AVX-512 panels
  (`panels_available()`); None where none applies."""
  dtype = jnp.dtype(dtype)
  if dtype == jnp.bfloat16:
    return BF16_PACKINGS.get(bf16_unit())
  if dtype == jnp.float32 and panels_available():
    return PANELS_F32
  return None


@jax.custom_vjp
def causal_attention(q_BxTxKxGxHd: jax.Array, k_BxTxKxHd: jax.Array, v_BxTxKxHd: jax.Array,
                     valid_BxT: jax.Array, segments_BxT: jax.Array) -> jax.Array:
  """softmax(q . k / sqrt(Hd)) . v in float32, query t seeing slot s iff s <= t, `valid_BxT[b, s]`
  and `segments_BxT[b, s] == segments_BxT[b, t]`; G query heads share a KV head. A query with
  no visible slot gets 0. Differentiable in q, k and v (a C++ backward). Call `available()`
  first."""
  return _causal_attention_fwd(q_BxTxKxGxHd, k_BxTxKxHd, v_BxTxKxHd, valid_BxT, segments_BxT)[0]


def _causal_attention_fwd(q, k, v, valid, segments):
  args = (q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
          valid.astype(bool), segments.astype(jnp.int32))
  outs = (jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct(q.shape[:-1], jnp.float32))
  out, lse = jax.ffi.ffi_call("epgrpo_causal_attention", outs)(*args)
  return out.astype(q.dtype), (args, out, lse)


def _causal_attention_bwd(residuals, dout):
  (q, k, v, valid, segments), out, lse = residuals
  outs = (jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct(k.shape, jnp.float32),
          jax.ShapeDtypeStruct(v.shape, jnp.float32))
  dq, dk, dv = jax.ffi.ffi_call("epgrpo_causal_attention_grad", outs)(
      q, k, v, valid, segments, out, lse, dout.astype(jnp.float32))
  return dq, dk, dv, None, None


causal_attention.defvjp(_causal_attention_fwd, _causal_attention_bwd)


@jax.custom_vjp
def swiglu(y: jax.Array) -> jax.Array:
  """silu(gate) * up in float32 for the gate/up product as one array [..., 2F] (gate first):
  no half is copied out, and the gradient comes back in the same layout. Call `available()`
  first."""
  y_MxF2 = y.astype(jnp.float32).reshape(-1, y.shape[-1])
  out = jax.ffi.ffi_call("epgrpo_swiglu", jax.ShapeDtypeStruct(
      (y_MxF2.shape[0], y.shape[-1] // 2), jnp.float32))(y_MxF2)
  return out.reshape(*y.shape[:-1], y.shape[-1] // 2).astype(y.dtype)


def _swiglu_fwd(y):
  return swiglu(y), y


def _swiglu_bwd(y, dh):
  y_MxF2 = y.astype(jnp.float32).reshape(-1, y.shape[-1])
  dh_MxF = dh.astype(jnp.float32).reshape(y_MxF2.shape[0], -1)
  dy = jax.ffi.ffi_call("epgrpo_swiglu_grad", jax.ShapeDtypeStruct(y_MxF2.shape, jnp.float32))(
      y_MxF2, dh_MxF)
  return (dy.reshape(y.shape).astype(y.dtype),)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)
