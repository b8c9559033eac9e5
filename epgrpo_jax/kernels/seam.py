"""The seam between the model and the backends: `choose` picks a program's `Kernels` once,
from its backend (the platform of its mesh's devices, which a compile check names apart from
this host's), its dtype, whether it runs on one device, and the config, and the program passes
them to the model (`model(..., kernels=...)`).

Per backend (docs/architecture.md, "The kernel seam"):
- cpu: `kernels.cpu.backend` (XLA:CPU's workarounds, and the C++ kernels where they run:
  `native`).
- gpu: XLA's implementations, and on one device the Pallas decode attention that reads each
  row's own slots (`kernels.gpu`), unless `model.attention` is plain (`gpu_decode`).
- tpu: XLA's implementations (`models.Kernels()`), attention resolved from the config.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from epgrpo_jax.io.errors import UserError
from epgrpo_jax.kernels import cpu
from epgrpo_jax.kernels.cpu import backend as cpu_backend
from epgrpo_jax.models import ATTENTION, Kernels, ModelConfig, as_dtype
from epgrpo_jax.parallel import sharding
from epgrpo_jax.parallel.platform import mesh_platform

GPU = ("gpu", "cuda", "rocm")


def backend_of(mesh: jax.sharding.Mesh | None) -> str:
  """The platform a program on `mesh` runs on: its devices', else this process's default."""
  return mesh_platform(mesh) or jax.default_backend()


def one_device(mesh: jax.sharding.Mesh | None) -> bool:
  """Whether a program on `mesh` runs on one device. Without a mesh it does, however many the
  process has: jit places an unsharded program on one device (the default one, or its
  arguments'), so the C++ kernels may serve it. The one notion for every program: the
  trainer's, SFT's and the sampler's (`sampler_native`)."""
  return mesh is None or mesh.size == 1


def native(backend: str, single_device: bool, wanted: bool = True) -> bool:
  """Whether a program may call the C++ CPU kernels: `wanted`, on the CPU, on a single device
  (XLA cannot shard them over a mesh), with the kernels built here (`cpu.available()`)."""
  return wanted and backend == "cpu" and single_device and cpu.available()


def sampler_native(mesh: jax.sharding.Mesh | None, wanted: bool) -> bool:
  """Whether the sampler's programs on `mesh` (None: one device) run the C++ decode attention,
  thresholds or draw and packed products (`sampling.cpu_kernels`: `wanted`)."""
  return native(backend_of(mesh), one_device(mesh), wanted)


def sampler_draw(cpu_kernels: bool) -> tuple[Callable | None, Callable | None]:
  """The sampler's (top-k / top-p threshold, whole nucleus draw) where they are the backend's
  own: the C++ ones (`cpu.largest_threshold`, `cpu.nucleus_draw`) with `cpu_kernels`
  (`sampler_native`); (None, None): XLA's (`rollout.strategies`)."""
  return (cpu.largest_threshold, cpu.nucleus_draw) if cpu_kernels else (None, None)


def shared_prompt_cache(setting, backend: str) -> bool:
  """Whether the static sampler keeps each prompt's cache once for its G rows
  (`models.split_cache`; `sampling.shared_prompt_cache`: `setting` true, false or "auto").
  auto: on a TPU, where XLA's decode attention reads every slot of every row's cache, so G
  copies of a prompt are G reads (docs/sampling.md); off on the CPU, whose C++ decode attention
  already reads a group's prompt slots once, and on GPUs until measured there (on, the prompt
  part is one XLA product per group and each row's own slots the Pallas kernel's span,
  `gpu.shared_decode_attention`)."""
  return backend == "tpu" if setting == "auto" else bool(setting)


def gpu_decode(name: str, backend: str, single_device: bool) -> bool:
  """Whether one-token decode steps attend with the Pallas kernel (`kernels.gpu`): on a GPU, in
  a single-device program (XLA cannot shard the kernel's custom call over a mesh), unless
  `model.attention` (`name`) is plain, which keeps every pass on XLA's einsums."""
  return backend in GPU and single_device and name != "plain"


def resolve(name: str, dtype, backend: str) -> str:
  """The attention implementation `name` ("auto": chosen by backend and dtype) stands for.

  auto: "cudnn" on a GPU in bf16/fp16; on the CPU "cpu" (the C++ causal kernel, three times
  XLA's plain attention at the bench shapes, docs/benchmarks.md) in float32 where the C++
  kernels build, else "plain"; "blockwise" elsewhere (GPU in fp32, TPU), where long sequences
  are the point.
  """
  if name not in ATTENTION:
    raise UserError(f"model.attention: unknown {name!r}; use one of {list(ATTENTION)}")
  if name == "cudnn" and backend not in GPU:
    raise UserError(f"model.attention: cudnn runs on GPUs only; this program runs on {backend} "
                    f"(use auto)")
  if name != "auto":
    return name
  if backend == "cpu":
    return "cpu" if jnp.dtype(dtype) == jnp.float32 and cpu.available() else "plain"
  if backend in GPU and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16):
    return "cudnn"
  return "blockwise"


def choose(cfg: ModelConfig, mesh: jax.sharding.Mesh | None = None, *, constrain: bool = False,
           decode_rows: tuple[int, int] | None = None, packed: bool = False) -> Kernels:
  """The `Kernels` of a program running the model of `cfg` on `mesh` (None: unsharded):
  `for_backend` of the mesh's platform (`backend_of`) and device count (`one_device`).
  `constrain`: keep the hidden states batch-sharded over the mesh
  (`sharding.activation_constraints`; `batch_shards` the devices that split them);
  `decode_rows`: the C++ decode attention serves one-token steps (the sampler's where
  `sampler_native`), given (rows sharing a prompt, its slots); `packed`: weights prepared once
  (the sampler's) are packed for the backend's products where it has them (`Kernels.packing`;
  the sampler's where `sampler_native` and `sampling.packed_weights`)."""
  constrain_fn = sharding.activation_constraints(mesh) if constrain and mesh is not None else None
  kernels = for_backend(cfg, backend_of(mesh), one_device(mesh), constrain=constrain_fn,
                        decode_rows=decode_rows, packed=packed)
  if constrain_fn is None:
    return kernels
  return dataclasses.replace(kernels, batch_shards=mesh.shape["data"] * mesh.shape["fsdp"])


def for_backend(cfg: ModelConfig, backend: str, single_device: bool, *,
                constrain: Callable | None = None,
                decode_rows: tuple[int, int] | None = None, packed: bool = False) -> Kernels:
  """The `Kernels` of a program for `backend` ("cpu", "gpu", "tpu") on one device or several:
  the CPU's (`kernels.cpu.backend`, its C++ kernels where `native`), else XLA's; attention
  resolved from `cfg` (`resolve`), on a GPU the Pallas decode attention where `gpu_decode`;
  `constrain(x, kind)`: activation sharding constraints; `packed`: the CPU's packing of
  prepared weights (`cpu.packing_for` the compute dtype; the caller checked
  `sampler_native`); no other backend packs."""
  dtype = as_dtype(cfg.dtype)
  attention = resolve(cfg.attention, dtype, backend)
  common = {"constrain": constrain} if constrain is not None else {}
  if backend == "cpu":
    return cpu_backend.kernels(attention=attention, native=native(backend, single_device),
                               decode_rows=decode_rows, packing_dtype=dtype if packed else None,
                               **common)
  if gpu_decode(cfg.attention, backend, single_device):
    from epgrpo_jax.kernels import gpu  # Pallas' Triton parts load only where a GPU program is built

    common["decode_attention"] = gpu.decode_attention
    common["shared_decode_attention"] = gpu.shared_decode_attention
  return Kernels(attention=attention, **common)
