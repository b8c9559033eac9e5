"""The platform a program is compiled for: the devices of its mesh, which need not be this
process's backend (a TPU program compiled ahead of time on a CPU host,
`tools/compile_check.py`). Per-backend choices follow it through `kernels.seam`, never
`jax.default_backend()` alone."""

from __future__ import annotations

import jax


def mesh_platform(mesh: jax.sharding.Mesh | None) -> str | None:
  """The platform of the mesh's devices ("cpu", "gpu", "tpu"), or None without a mesh."""
  return None if mesh is None else mesh.devices.flat[0].platform
