"""The sampler's products by weights packed once on the CPU: bf16 on AMX tiles or with
AVX512-BF16 dot products, float32 on AVX-512 panels (`kernels.cpu`), against XLA's products and a sampler without them."""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from flax import nnx

from epgrpo_jax.kernels import cpu as cpu_kernels
from epgrpo_jax.kernels import seam
from epgrpo_jax.models import LoraConfig, Qwen2, lora_layers, preset
from epgrpo_jax.rollout.sampling import Sampler, SamplingConfig

BUCKETS = dict(prompt_buckets=(8, 16), length_buckets=(8, 16))
PROMPTS = [[5, 17, 33, 2, 60, 8, 71, 9], [44, 3, 90, 12, 7, 7, 21, 30, 65, 11, 4, 56]]


def policy_with_adapters(dtype: str, vocab_size: int) -> Qwen2:
  """test-tiny in `dtype` with a sharper head (no near-tie argmaxes) and LoRA adapters that
  change the policy (merged by the sampler)."""
  cfg = dataclasses.replace(preset("test-tiny"), dtype=dtype, param_dtype=dtype,
                            vocab_size=vocab_size)
  m = Qwen2(cfg, lora=LoraConfig(rank=4, alpha=8.0), rngs=nnx.Rngs(0))
  m.lm_head[...] = m.lm_head[...] * 30.0
  for layer in lora_layers(m):
    layer.lora_b[...] = jnp.full(layer.lora_b.shape, 0.05)
  return m


def program_text(sampler: Sampler) -> str:
  return list(sampler._programs.values())[-1].as_text()  # the sampling program (after the weights' own)


# ---------------------------------------------------------------------------
# bf16 on AMX tiles or AVX512-BF16.


def test_pack_bf16_lays_out_pairs_of_rows_per_tile():
  w = jnp.arange(64 * 48, dtype=jnp.float32).reshape(64, 48)  # integers below 256 stay exact
  w = w % 251
  packed = np.asarray(cpu_kernels.pack_bf16(w)).astype(np.float32)
  assert packed.shape == (3, 2, 16, 32)
  for n, c, r, j, e in [(0, 0, 0, 0, 0), (0, 0, 0, 0, 1), (2, 1, 15, 15, 1), (1, 0, 7, 3, 0)]:
    assert packed[n, c, r, 2 * j + e] == float(w[32 * c + 2 * r + e, 16 * n + j])
  assert cpu_kernels.can_pack(w) and not cpu_kernels.can_pack(w[:, :40])
  assert not cpu_kernels.can_pack(w[:48])


def bf16_unit_or_skip(unit: str):
  if unit == "amx" and not cpu_kernels.amx_available():
    pytest.skip("this CPU has no AMX-BF16 tiles (or Linux does not grant them)")
  if unit == "avx512" and not cpu_kernels.pairs_available():
    pytest.skip("the CPU kernels are not built for AVX512-BF16 here")


class TestCpuPackedMatmul(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters("amx", "avx512")
  def test_equals_the_bf16_product_with_float32_accumulation(self, unit):
    bf16_unit_or_skip(unit)
    rng = np.random.default_rng(3)
    # rows: 3 x 16 (a lone block of 16 after a pair; for AVX512-BF16, 6 blocks of 8) and
    # 2 x 5 (padded for AMX; a block of 8 and a tail of 2 for AVX512-BF16); 48 columns = 3
    # blocks of 16 (a lone block after a pair); K = 96, three tiles deep.
    for lead in ((48,), (2, 5)):
      x = jnp.asarray(rng.standard_normal((*lead, 96)), jnp.bfloat16)
      w = jnp.asarray(rng.standard_normal((96, 48)), jnp.bfloat16)
      packed = cpu_kernels.pack_bf16(w)
      want = jnp.matmul(x, w, preferred_element_type=jnp.float32)
      got = self.variant(functools.partial(cpu_kernels.packed_matmul, out_dtype=jnp.float32,
                                           unit=unit))(x, packed)
      assert got.shape == (*lead, 48) and got.dtype == jnp.float32
      chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-5)
      rounded = self.variant(functools.partial(cpu_kernels.packed_matmul, unit=unit))(x, packed)
      assert rounded.dtype == jnp.bfloat16
      np.testing.assert_array_equal(np.asarray(rounded), np.asarray(got.astype(jnp.bfloat16)))

  def test_many_rows_split_across_tasks(self):
    # 300 rows: AVX512-BF16's many-row path (38 blocks of 8, the last of 4, split by rows).
    bf16_unit_or_skip("avx512")
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((300, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((64, 80)), jnp.bfloat16)
    got = cpu_kernels.packed_matmul(x, cpu_kernels.pack_bf16(w), jnp.float32, unit="avx512")
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)

  def test_unknown_unit_is_refused(self):
    with pytest.raises(ValueError, match="unit"):
      cpu_kernels.packed_matmul(jnp.zeros((2, 32), jnp.bfloat16), jnp.zeros((1, 1, 16, 32)),
                                unit="avx2")


@pytest.mark.parametrize("unit, target", [("amx", "epgrpo_packed_matmul"),
                                          ("avx512", "epgrpo_pair_matmul")])
def test_bf16_sampler_runs_its_projections_packed_like_xla(monkeypatch, unit, target):
  bf16_unit_or_skip(unit)
  if unit == "avx512":
    monkeypatch.setattr(cpu_kernels, "amx_available", lambda: False)  # AMX comes first
  m = policy_with_adapters("bfloat16", vocab_size=112)  # a head they take (97: no multiple of 16)
  config = SamplingConfig(greedy=True, max_new_tokens=16, **BUCKETS)
  packed = Sampler(config)
  got = packed.sample(m, PROMPTS, 2, jax.random.key(0))
  text = program_text(packed)
  assert text.count(f'custom_call_target="{target}"') >= 4 * m.cfg.num_layers
  assert f'custom_call_target="{target}_f32"' in text  # the head
  with_xla = Sampler(config.replace(packed_weights=False))
  want = with_xla.sample(m, PROMPTS, 2, jax.random.key(0))
  assert target not in program_text(with_xla)
  monkeypatch.setattr(cpu_kernels, "amx_available", lambda: False)  # a CPU with neither
  monkeypatch.setattr(cpu_kernels, "pairs_available", lambda: False)
  without = Sampler(config)
  without.sample(m, PROMPTS, 2, jax.random.key(0))
  assert "epgrpo_packed_matmul" not in program_text(without)
  assert "epgrpo_pair_matmul" not in program_text(without)
  np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
  np.testing.assert_allclose(np.asarray(got.logp), np.asarray(want.logp), atol=1e-6)


# ---------------------------------------------------------------------------
# float32 on AVX-512 panels.


def panels_or_skip():
  if not cpu_kernels.panels_available():
    pytest.skip("the CPU kernels are not built for AVX-512 here")


def test_pack_panels_lays_out_32_columns_per_panel_across_the_group():
  panels_or_skip()
  w = jnp.arange(40 * 96, dtype=jnp.float32).reshape(40, 96)
  for parts in ([w], [w[:, :64], w[:, 64:]], [w[:, :40], w[:, 40:48], w[:, 48:]]):
    # one weight; two in whole panels; three whose panels straddle them (as q/k/v can)
    packed = np.asarray(cpu_kernels.pack_panels(parts))
    assert packed.shape == (3, 40, 32)
    np.testing.assert_array_equal(packed, np.asarray(w).reshape(40, 3, 32).transpose(1, 0, 2))
    for p, k, j in [(0, 0, 0), (0, 39, 31), (1, 7, 3), (1, 7, 8), (2, 39, 17)]:
      assert packed[p, k, j] == float(w[k, 32 * p + j])
  assert cpu_kernels.can_pack_panels([jnp.zeros((256, 240)), jnp.zeros((256, 16))])
  assert not cpu_kernels.can_pack_panels([jnp.zeros((256, 256)), jnp.zeros((256, 40))])
  assert not cpu_kernels.can_pack_panels([jnp.zeros((256, 256)), jnp.zeros((128, 32))])
  assert not cpu_kernels.can_pack_panels([jnp.zeros((256, 256), jnp.bfloat16)])
  assert not cpu_kernels.can_pack_panels([jnp.zeros((8, 32))])  # below PANEL_MIN_SIZE


class TestCpuPanelMatmul(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_equals_the_float32_product(self):
    panels_or_skip()
    rng = np.random.default_rng(4)
    # rows: 21 = two blocks of 8 and a tail of 5, (2, 3) = a tail alone, 200 = the many-row
    # path (25 blocks of 8 split across tasks); K = 37 (no alignment); N = 3 panels.
    for lead in ((21,), (2, 3), (200,)):
      x = jnp.asarray(rng.standard_normal((*lead, 37)), jnp.float32)
      w = jnp.asarray(rng.standard_normal((37, 96)), jnp.float32)
      want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
      got = self.variant(cpu_kernels.panel_matmul)(x, cpu_kernels.pack_panels([w]))
      assert got.shape == (*lead, 96) and got.dtype == jnp.float32
      chex.assert_trees_all_close(got, want.astype(np.float32), rtol=1e-5, atol=1e-5)


class TestTrainingProductsOnPanels(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_equal_xla_products_in_value_and_gradients(self):
    # The CPU kernels' matmul in float32: 300 rows (>= PACKED_MIN_ROWS) on panels, forward and
    # backward (x's gradient by the packed transpose), in a single-device program only.
    panels_or_skip()
    rng = np.random.default_rng(9)
    x, ct = (jnp.asarray(rng.standard_normal((3, 100, n)), jnp.float32) for n in (64, 96))
    w = jnp.asarray(rng.standard_normal((64, 96)), jnp.float32)
    loss = lambda product: lambda x, w: jnp.sum(product(x, w) * ct)
    want = jax.value_and_grad(loss(jnp.matmul), argnums=(0, 1))(x, w)
    matmul, on_a_mesh = (seam.for_backend(preset("test-tiny"), "cpu", one).matmul
                         for one in (True, False))
    with pytest.MonkeyPatch.context() as mp:
      mp.setattr(cpu_kernels, "PANEL_MIN_SIZE", 0)  # a small weight for the test
      got = self.variant(jax.value_and_grad(loss(matmul), argnums=(0, 1)))(x, w)
      jaxpr = str(jax.make_jaxpr(jax.grad(loss(matmul)))(x, w))
      assert jaxpr.count("epgrpo_panel_matmul") == 2  # the product and x's gradient
      assert "epgrpo_panel_matmul" not in str(jax.make_jaxpr(matmul)(x[0, :8], w))  # few rows
      assert "epgrpo_panel_matmul" not in str(jax.make_jaxpr(on_a_mesh)(x, w))
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-4)


def test_float32_sampler_runs_its_projections_on_panels_like_xla(monkeypatch):
  panels_or_skip()
  monkeypatch.setattr(cpu_kernels, "PANEL_MIN_SIZE", 0)  # test-tiny's weights are smaller
  m = policy_with_adapters("float32", vocab_size=128)  # a head in whole panels
  config = SamplingConfig(temperature=0.7, top_p=0.9, max_new_tokens=16, **BUCKETS)
  with_panels = Sampler(config)
  got = with_panels.sample(m, PROMPTS, 2, jax.random.key(0))
  text = program_text(with_panels)
  calls = text.count('custom_call_target="epgrpo_panel_matmul"')
  assert calls >= 4 * m.cfg.num_layers + 1  # q/k/v, o, gate/up, down per layer; the head
  # packed once a call, in the weights' own program; the sampling program packs nothing
  prepare = next(iter(with_panels._programs.values())).as_text()
  assert prepare.count('custom_call_target="epgrpo_pack_panels"') == 4 * m.cfg.num_layers + 1
  assert "epgrpo_pack_panels" not in text
  with_xla = Sampler(config.replace(packed_weights=False))
  want = with_xla.sample(m, PROMPTS, 2, jax.random.key(0))
  assert "epgrpo_panel_matmul" not in program_text(with_xla)
  np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
  np.testing.assert_allclose(np.asarray(got.logp), np.asarray(want.logp), atol=1e-5)
  np.testing.assert_allclose(np.asarray(got.entropy), np.asarray(want.entropy), atol=1e-5)
  monkeypatch.setattr(cpu_kernels, "panels_available", lambda: False)  # a CPU without AVX-512
  without = Sampler(config)
  without.sample(m, PROMPTS, 2, jax.random.key(0))
  assert "epgrpo_panel_matmul" not in program_text(without)
