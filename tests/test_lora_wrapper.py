"""LoRA is a wrapper around a plain dense layer (`models._lora.LoRA` over `models._dense.Dense`),
merge and unmerge are transforms that return a new model, and no module but `_lora` knows
the adapters' parameter names."""

from __future__ import annotations

import re
from pathlib import Path

import chex
import jax.numpy as jnp
import numpy as np
from flax import nnx
from hypothesis import given, settings, strategies as st

from epgrpo_jax.models import (LORA, Dense, LoRA, LoraConfig, from_pretrained, lora_layers, merge_adapters,
                               unmerge_adapters)
from epgrpo_jax.models import _lora
from epgrpo_jax.models._lora import folded_kernel, plain_params, projections, saved_adapters
from helpers import random_model, tiny_config, tiny_hf_dir

REPO = Path(__file__).resolve().parents[1]


def _layer(w, b, a, b_up, scale: float) -> LoRA:
  """A LoRA over a float32 dense layer holding the given arrays."""
  rngs = nnx.Rngs(0)
  w = np.asarray(w, np.float32)
  layer = LoRA(Dense(*w.shape, use_bias=True, param_dtype=jnp.float32, dtype=jnp.float32, rngs=rngs),
               np.asarray(a).shape[1], scale, rngs=rngs)
  layer.base.kernel[...] = jnp.asarray(w)
  layer.base.bias[...] = jnp.asarray(b, jnp.float32)
  factor_a, factor_b = layer.factors()
  factor_a[...] = jnp.asarray(a, jnp.float32)
  factor_b[...] = jnp.asarray(b_up, jnp.float32)
  return layer


def test_adapters_wrap_plain_dense_layers():
  lora = LoraConfig(rank=2, alpha=4.0, targets=("q", "v", "down"))
  model = random_model(tiny_config(), lora=lora)
  attn, mlp = model.layers[0].attn, model.layers[0].mlp
  for layer in (attn.q, attn.v, mlp.down):
    assert type(layer) is LoRA and type(layer.base) is Dense and layer.scale == lora.scale
    assert set(nnx.to_pure_dict(nnx.state(layer.base))) <= {"kernel", "bias"}  # nothing of LoRA
  for layer in (attn.k, attn.o, mlp.gate, mlp.up):
    assert type(layer) is Dense
  assert len(list(lora_layers(model))) == 3 * model.cfg.num_layers
  assert set(projections(model)) == set(projections(random_model(tiny_config())))
  # Only the factors are trainable under LoRA; the wrapped layer is the plain one.
  assert {p[-1] for p, _ in nnx.to_flat_state(nnx.state(model, LORA))} == {_lora.A, _lora.B}
  assert set(plain_params(model)) == set(plain_params(random_model(tiny_config())))


def test_checkpoint_names_are_those_written_so_far():
  """Saved adapters keep the names of every checkpoint written before the wrapper: a LoRA run's
  trainable state is read back by path, so a rename would orphan old checkpoints."""
  assert (_lora.A, _lora.B) == ("lora_a", "lora_b")
  model = random_model(tiny_config(), lora=LoraConfig(rank=3, alpha=3.0, targets=("k", "up")))
  shapes = {".".join(map(str, p)): v.shape for p, v in nnx.to_flat_state(nnx.state(model, LORA))}
  assert saved_adapters(shapes) == {f"layers.{i}.{m}": 3 for i in range(model.cfg.num_layers)
                                    for m in ("attn.k", "mlp.up")}


def test_merge_is_the_dense_layer_with_w_plus_scale_a_b():
  # W [2, 3], bias [3], A [2, 1], B [1, 3], scale 2: W + 2 A @ B = [[1.2, 2.4, 3.6], [4.4, 5.8, 7.2]].
  layer = _layer([[1, 2, 3], [4, 5, 6]], [0.5, -1, 2], [[1], [2]], [[0.1, 0.2, 0.3]], 2.0)
  x = jnp.asarray([[1.0, -1.0], [0.5, 0.0]])
  want = np.asarray([[-2.7, -4.4, -1.6], [1.1, 0.2, 3.8]], np.float32)  # x @ (W + 2 A B) + b
  np.testing.assert_allclose(folded_kernel(layer), [[1.2, 2.4, 3.6], [4.4, 5.8, 7.2]], atol=1e-6)
  np.testing.assert_allclose(layer(x), want, atol=1e-5)
  np.testing.assert_allclose(layer(x, adapters=False), [[-2.5, -4, -1], [1, 0, 3.5]], atol=1e-6)

  merged = merge_adapters(layer)
  assert merged.merged and not layer.merged  # a new model; the input as it was
  np.testing.assert_array_equal(layer.base.kernel[...], [[1, 2, 3], [4, 5, 6]])
  np.testing.assert_allclose(merged.base.kernel[...], [[1.2, 2.4, 3.6], [4.4, 5.8, 7.2]], atol=1e-6)
  np.testing.assert_allclose(merged(x), want, atol=1e-5)  # the dense forward by W + 2 A B
  np.testing.assert_allclose(merged(x, adapters=False), [[-2.5, -4, -1], [1, 0, 3.5]], atol=1e-5)
  back = unmerge_adapters(merged)
  assert not back.merged and merged.merged
  np.testing.assert_allclose(back.base.kernel[...], [[1, 2, 3], [4, 5, 6]], atol=1e-6)


@settings(max_examples=max(1, settings.default.max_examples // 50), deadline=None)
@given(scale=st.floats(0.25, 4.0), seed=st.integers(0, 2**16))
def test_merged_forward_equals_the_adapted_forward(scale, seed):
  d_in, d_out, rank = 5, 3, 2  # one shape: each new one would compile the eager ops again
  rng = np.random.default_rng(seed)
  layer = _layer(rng.standard_normal((d_in, d_out)), rng.standard_normal(d_out),
                 rng.standard_normal((d_in, rank)), rng.standard_normal((rank, d_out)), scale)
  x = jnp.asarray(rng.standard_normal((3, d_in)), jnp.float32)
  merged = merge_adapters(layer)
  chex.assert_trees_all_close(merged(x), layer(x), atol=1e-4, rtol=1e-4)
  chex.assert_trees_all_close(merged(x, adapters=False), layer(x, adapters=False), atol=1e-4, rtol=1e-4)
  chex.assert_trees_all_close(unmerge_adapters(merged).base.kernel[...], layer.base.kernel[...],
                              atol=1e-5, rtol=1e-5)


def test_fresh_adapters_drawn_in_parameter_path_order(tmp_path):
  """A is kaiming-uniform from numpy's generator of the seed, one A after another in the sorted
  order of their parameter paths (the order every run so far drew them in), B zero."""
  lora = LoraConfig(rank=2, alpha=4.0, targets=("q", "gate", "down"))
  model = from_pretrained(tiny_hf_dir(tmp_path, num_layers=2), lora=lora, seed=5)
  rng = np.random.default_rng(5)
  for path in sorted(f"{p}.{_lora.A}" for p in _lora.wrappers(model)):
    layer = _lora.wrappers(model)[path.rsplit(".", 1)[0]]
    a, b = layer.factors()
    bound = np.sqrt(6.0 / a.shape[0])
    np.testing.assert_array_equal(a[...], rng.uniform(-bound, bound, a.shape).astype(np.float32))
    np.testing.assert_array_equal(b[...], np.zeros(b.shape, np.float32))


def _sources() -> list[Path]:
  files = [p for p in (REPO / "epgrpo_jax").rglob("*.py") if p.name != "_lora.py"]
  files += list((REPO / "benchmarks").rglob("*.py")) + list((REPO / "notebooks").glob("*.ipynb"))
  return files + [REPO / "tests" / "helpers.py"]


def test_no_module_but_lora_names_the_adapter_parameters():
  names = re.compile(rf"\b({_lora.A}|{_lora.B})\b")
  found = [f"{path.relative_to(REPO)}:{i}" for path in _sources()
           for i, line in enumerate(path.read_text().splitlines(), 1) if names.search(line)]
  assert not found, f"ask models._lora instead of naming the adapter parameters: {found}"
  assert names.search((REPO / "epgrpo_jax" / "models" / "_lora.py").read_text())  # the scan can fail
