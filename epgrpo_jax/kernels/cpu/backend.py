"""The CPU backend's `Kernels`: XLA:CPU's own workarounds (16-bit products rounded once,
16-bit cache writes through their bits, the ordered remat, the barrier before the rank-sized
transposes, LoRA folded in float32) and, in a single-device program where they are built,
the C++ kernels (causal and decode attention, SwiGLU, panel and packed products).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from epgrpo_jax.kernels import cpu
from epgrpo_jax.kernels.cpu import products
from epgrpo_jax.models import Kernels, ordered_remat, through_bits, write_row_slots, write_slots, xla_swiglu


def swiglu(gate_up: jax.Array) -> jax.Array:
  """silu(gate) * up: float32 in C++ (`cpu.swiglu`, no half copied out), else XLA's."""
  return cpu.swiglu(gate_up) if gate_up.dtype == jnp.float32 else xla_swiglu(gate_up)


@functools.cache
def _matmul(native: bool):
  return functools.partial(products.matmul, one_device=native)


def kernels(*, attention: str, native: bool, decode_rows: tuple[int, int] | None = None,
            packing_dtype=None, **common) -> Kernels:
  """The CPU's `Kernels`. `attention`: the resolved implementation ("cpu": the C++ causal
  kernel for passes without a cache, "plain" for the others); `native`: the C++ kernels may
  run (a single-device program, built here); `decode_rows`: one-token decode steps attend in
  C++ (`cpu.decode_attention`; the caller checked `seam.native`), given (rows sharing a
  prompt, its slots): a prompt's slots are read once for its rows; None: XLA's attention.
  `packing_dtype`: weights prepared once are packed for the C++ products of a model computing
  in that dtype (`cpu.packing_for`; the caller checked `seam.native`); None: not packed.
  `common`: the backend-independent fields (`constrain`)."""
  matmul = _matmul(native)
  decode = None
  if decode_rows is not None:
    decode = functools.partial(cpu.decode_attention, share_rows=decode_rows[0],
                               shared_slots=decode_rows[1])
  return Kernels(
      attention="plain" if attention == "cpu" else attention,
      causal_attention=cpu.causal_attention if attention == "cpu" and native else None,
      decode_attention=decode,
      matmul=matmul,
      folds_adapters=products.folds_adapters,
      merged_lora=products.merged_lora_product(matmul, jax.lax.optimization_barrier),
      swiglu=swiglu if native else xla_swiglu,
      remat=ordered_remat,
      write_slots=_WRITE_SLOTS,
      write_row_slots=_WRITE_ROW_SLOTS,
      rank_barrier=jax.lax.optimization_barrier,
      packing=cpu.packing_for(packing_dtype) if packing_dtype is not None else None,
      **common)


_WRITE_SLOTS, _WRITE_ROW_SLOTS = through_bits(write_slots), through_bits(write_row_slots)
