"""The plain dense layer every projection of the models is: y = x @ kernel (+ bias).

Low-rank adapters wrap it (`_lora.LoRA`); the layer itself knows nothing of them.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from epgrpo_jax.models._kernels import XLA, Kernels


class Dense(nnx.Module):
  """y = x @ kernel (+ bias) in `dtype`: kernel [in, out] and bias [out] (None without) in
  `param_dtype`, the kernel drawn from N(0, 0.02^2)."""

  def __init__(self, d_in: int, d_out: int, *, use_bias: bool, param_dtype, dtype, rngs: nnx.Rngs):
    init = jax.nn.initializers.normal(0.02)
    self.kernel = nnx.Param(init(rngs.params(), (d_in, d_out), param_dtype))
    self.bias = nnx.Param(jnp.zeros((d_out,), param_dtype)) if use_bias else None
    self.dtype = dtype

  def __call__(self, x, adapters: bool = True, kernels: Kernels = XLA,
               product: Callable | None = None):
    """The layer on x: the product by `kernels.matmul`, or by `product` (a prepared
    `x -> x @ kernel`, `Kernels.products`), plus the bias. `adapters` is the projections'
    common signature (`_lora.LoRA`); a plain layer has none."""
    x = x.astype(self.dtype)
    y = product(x) if product else kernels.matmul(x, self.kernel[...].astype(self.dtype))
    return self.biased(y)

  def biased(self, y: jax.Array) -> jax.Array:
    """y plus the bias (in the compute dtype), y itself without one."""
    return y if self.bias is None else y + self.bias[...].astype(self.dtype)
