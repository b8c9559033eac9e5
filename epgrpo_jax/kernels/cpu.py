"""The sampler's C++ XLA FFI kernels for the CPU, built on first use.

`decode_attention`: XLA:CPU runs the decode step's attention (a few hundred
`[G, Hd] x [Hd, S]` products per layer) well below memory bandwidth, and reads
every cache slot, including the ones not yet written; the kernel reads only the
slots up to the current one, a prompt's slots once for its G rows, and shares
the rows over XLA's intra-op threads. `largest_threshold`: the top-k / top-p
bisection of `strategies.largest_threshold`, one vectorised sweep of a row per
step instead of a dozen single-threaded XLA loop iterations over the batch.
`cpu.cc` is compiled with the system's C++
compiler (`$CXX`, else `c++`) into `$EPGRPO_KERNEL_DIR` (default
`~/.cache/epgrpo_jax/kernels`), keyed by the source, the flags, the jax version
and the CPU; without a compiler, `available()` is False (one warning) and
callers keep the XLA path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

logger = logging.getLogger("epgrpo_jax.models")

TARGETS = {"epgrpo_decode_attention": "EpgrpoDecodeAttention",
           "epgrpo_largest_threshold": "EpgrpoLargestThreshold"}  # FFI target: C++ symbol
SOURCE = Path(__file__).with_name("cpu.cc")
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
      SOURCE.read_text(), compiler, " ".join(FLAGS), jax.__version__, _cpu_signature()]).encode())
  target = directory / f"cpu_kernels-{key.hexdigest()[:16]}.so"
  if target.exists():
    return target
  if shutil.which(compiler) is None:
    raise RuntimeError(f"C++ compiler {compiler!r} not found (set CXX)")
  directory.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=directory) as tmp:  # then an atomic rename
    partial = Path(tmp) / target.name
    cmd = [compiler, *FLAGS, "-I", jax.ffi.include_dir(), str(SOURCE), "-o", str(partial)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
      last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
      raise RuntimeError(f"{compiler} failed on {SOURCE.name}: {last}")
    os.replace(partial, target)
  logger.info("built the CPU kernels: %s", target)
  return target


@functools.cache
def available() -> bool:
  """Builds and registers the kernels once per process; False (with a warning) if it cannot."""
  try:
    library = ctypes.cdll.LoadLibrary(str(build()))
    for target, symbol in TARGETS.items():
      jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)),
                                  platform="cpu")
  except (RuntimeError, OSError, subprocess.SubprocessError) as e:
    logger.warning("CPU kernels unavailable, using XLA's attention and thresholds: %s", e)
    return False
  return True


def decode_attention(q_BxKxGxHd, keys_BxKxHdxS, values_BxKxSxHd, allowed_BxS, limit, *,
                     share_rows: int = 1, shared_slots: int = 0):
  """softmax(q . keys / sqrt(Hd)) . values over the slots < `limit` that `allowed_BxS` marks.

  Rows come in groups of `share_rows` consecutive rows whose keys and values in slots
  `[0, shared_slots)` are identical (a prompt's cache copied to its G samples); the kernel
  reads those slots from each group's first row only. float32; call `available()` first.
  """
  out = jax.ShapeDtypeStruct(q_BxKxGxHd.shape, jnp.float32)
  return jax.ffi.ffi_call("epgrpo_decode_attention", out)(
      q_BxKxGxHd.astype(jnp.float32), keys_BxKxHdxS.astype(jnp.float32),
      values_BxKxSxHd.astype(jnp.float32), allowed_BxS.astype(bool),
      jnp.asarray(limit, jnp.int32), share_rows=np.int64(share_rows),
      shared_slots=np.int64(shared_slots))


def largest_threshold(values_BxV: jax.Array, weights_BxV: jax.Array, target_B: jax.Array) -> jax.Array:
  """`strategies.largest_threshold` in C++ (masses summed in float64); call `available()` first."""
  out = jax.ShapeDtypeStruct(values_BxV.shape[:1], jnp.float32)
  return jax.ffi.ffi_call("epgrpo_largest_threshold", out)(
      values_BxV.astype(jnp.float32), weights_BxV.astype(jnp.float32), target_B.astype(jnp.float32))
