"""The platform a program is traced for: the devices of its mesh, which need not be this
process's backend (a TPU program compiled ahead of time on a CPU host,
`tools/compile_check.py`). Every per-backend choice (attention implementation, the C++ CPU
kernels, CPU-only layouts and compiler options) asks `backend()`, never
`jax.default_backend()` directly."""

from __future__ import annotations

import contextlib
import contextvars

import jax

_PLATFORM: contextvars.ContextVar[str | None] = contextvars.ContextVar("platform", default=None)


def mesh_platform(mesh: jax.sharding.Mesh | None) -> str | None:
  """The platform of the mesh's devices ("cpu", "gpu", "tpu"), or None without a mesh."""
  return None if mesh is None else mesh.devices.flat[0].platform


@contextlib.contextmanager
def program_platform(platform: str | None):
  """While tracing inside, `backend()` is `platform` (None: the process's default backend)."""
  token = _PLATFORM.set(platform)
  try:
    yield
  finally:
    _PLATFORM.reset(token)


def mesh_backend(mesh: jax.sharding.Mesh | None) -> str:
  """The platform a program on `mesh` runs on: its devices', else `backend()`."""
  return mesh_platform(mesh) or backend()


def backend() -> str:
  """The platform of the program being traced (`program_platform`), else the process's
  default backend."""
  return _PLATFORM.get() or jax.default_backend()
