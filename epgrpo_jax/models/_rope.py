"""Rotary position embeddings in the HF "rotate half" layout, computed in float32: angles by
position (computed, or looked up in a table made once per program), and Llama 3.1's
frequency rule for long contexts.

Shape suffixes as in `_decoder`: B batch, T tokens, N heads, Hd head dim.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from epgrpo_jax.models._config import ModelConfig


def llama3_frequencies(inv_freq_Hd2, factor: float, low_freq_factor: float, high_freq_factor: float,
                       original_context: int):
  """Llama 3.1's rule for long contexts (HF rope_type "llama3"): frequencies whose wavelength
  exceeds original_context / low_freq_factor are divided by `factor`, those under
  original_context / high_freq_factor kept, and those between interpolated smoothly."""
  wavelength = 2 * math.pi / inv_freq_Hd2
  slow = jnp.where(wavelength > original_context / low_freq_factor, inv_freq_Hd2 / factor, inv_freq_Hd2)
  smooth = (original_context / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
  smoothed = (1 - smooth) * slow / factor + smooth * slow
  medium = ~(wavelength < original_context / high_freq_factor) & ~(
      wavelength > original_context / low_freq_factor)
  return jnp.where(medium, smoothed, slow)


def rope_cos_sin(positions_BxT, head_dim: int, theta: float,
                 scaling: tuple | None = None) -> tuple[jax.Array, jax.Array]:
  """cos and sin of the rotary angles, [B, T, 1, Hd] float32, in the HF "rotate half" layout;
  `scaling`: the `llama3_frequencies` parameters (`ModelConfig.rope_scaling`), or None."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  if scaling is not None:
    inv_freq = llama3_frequencies(inv_freq, *scaling)
  angles_BxTxHd2 = positions_BxT[..., None].astype(jnp.float32) * inv_freq
  angles_BxTx1xHd = jnp.concatenate([angles_BxTxHd2, angles_BxTxHd2], -1)[:, :, None, :]
  return jnp.cos(angles_BxTx1xHd), jnp.sin(angles_BxTx1xHd)


def rope_table(cfg: ModelConfig, length: int) -> tuple[jax.Array, jax.Array]:
  """`rope_cos_sin` of positions 0..length-1 as [length, Hd] tables, for `Decoder(rope_table=...)`.

  A decode loop computes it once outside the loop: XLA:CPU fuses cos and sin into
  their consumers and there evaluates them once per head, which cost about a tenth
  of a decode step.
  """
  cos, sin = rope_cos_sin(jnp.arange(length)[None], cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
  return cos[0, :, 0], sin[0, :, 0]


def rope_angles(positions_BxT, head_dim: int, theta: float,
                table: tuple[jax.Array, jax.Array] | None = None,
                scaling: tuple | None = None) -> tuple[jax.Array, jax.Array]:
  """cos and sin [B, T, 1, Hd] at `positions_BxT`: looked up in `table` (a `rope_table`) if
  given, else computed (`rope_cos_sin`, with `scaling`)."""
  if table is None:
    return rope_cos_sin(positions_BxT, head_dim, theta, scaling)
  return tuple(jnp.take(t_LxHd, positions_BxT, axis=0)[:, :, None] for t_LxHd in table)


def rope(x_BxTxNxHd, positions_BxT, theta: float, table: tuple[jax.Array, jax.Array] | None = None):
  """Rotary embedding in the HF "rotate half" layout, computed in float32 (`rope_angles`)."""
  return rotate(x_BxTxNxHd, *rope_angles(positions_BxT, x_BxTxNxHd.shape[-1], theta, table))


def rotate(x_BxTxNxHd, cos_BxTx1xHd, sin_BxTx1xHd):
  """`rope` by the angles' cos and sin, computed in float32."""
  x = x_BxTxNxHd.astype(jnp.float32)
  x1, x2 = jnp.split(x, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], -1)
  out = x * cos_BxTx1xHd + rotated * sin_BxTx1xHd
  return out.astype(x_BxTxNxHd.dtype)
