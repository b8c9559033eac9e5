"""Logical axes of Llama's base weights by NNX path: Qwen2's without the bias row."""

from epgrpo_jax.models.qwen2 import sharding as qwen2_sharding

PARAM_AXES: tuple[tuple[str, tuple[str | None, ...]], ...] = tuple(
    row for row in qwen2_sharding.PARAM_AXES if not row[0].endswith(r"\.bias"))
