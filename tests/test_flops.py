"""The one FLOP model (`models/flops.py`) against a hand count, and the trainer's `perf/*`
metrics built on it."""

from __future__ import annotations

import jax
import pytest
from hypothesis import given, settings, strategies as st

from epgrpo_jax.models import ModelConfig, flops
from epgrpo_jax.tasks import arithmetic
from epgrpo_jax.training.config import TrainConfig
from epgrpo_jax.training.trainer import Trainer

# d 4, f 6, 2 layers, 2 heads of 2 dims, 1 KV head, vocabulary 10. Per layer and token:
# q 4x2x2 = 16, k and v 2x4x1x2 = 16, o 2x2x4 = 16, MLP 3x4x6 = 72: 120 weights.
TINY = ModelConfig(vocab_size=10, hidden_size=4, intermediate_size=6, num_layers=2, num_heads=2,
                   num_kv_heads=1, head_dim=2)


def test_layer_params_by_hand():
  assert flops.layer_params(TINY) == 120


@pytest.mark.parametrize("family", [{}, dict(model_type="qwen3", attention_bias=False, qk_norm=True)],
                         ids=["qwen2", "qwen3"])
def test_forward_counts_the_compiled_products(family):
  """The dot FLOPs XLA compiles for one forward (plain attention: every (query, key) pair,
  not the causal half) equal the model's count, with head_dim x heads (48) above the hidden
  size (20): q/k norms and biases add no products."""
  import jax.numpy as jnp
  from flax import nnx
  from helpers import random_model, tiny_config
  cfg = tiny_config(hidden_size=20, num_heads=4, num_kv_heads=2, head_dim=12, attention="plain",
                    **family)
  t = 7
  compiled = nnx.jit(lambda m, *a: m.logits(m(*a)[0])).lower(
      random_model(cfg), jnp.zeros((1, t), jnp.int32), jnp.arange(t)[None], jnp.ones((1, t), bool))
  fwd = flops.forward(cfg, [t], head_tokens=t)
  full_attention = 4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * t * t
  assert flops.hlo_counts(compiled.compile().as_text())["dot_flops"] == (
      fwd.linear + fwd.head + full_attention)


def test_forward_and_backward_by_hand():
  """Sequences of 3 and 2 tokens, the head at 3 of them.
  linear 2 x 2 layers x 120 x 5 tokens = 2400; causal pairs 6 + 3 = 9, attention
  4 x 2 layers x 2 heads x 2 dims x 9 = 288; head 2 x 4 x 10 x 3 = 240."""
  fwd = flops.forward(TINY, [3, 2], head_tokens=3)
  assert (fwd.linear, fwd.attention, fwd.head, fwd.total) == (2400, 288, 240, 2928)
  lora = flops.backward(fwd, full_finetune=False)  # activation gradients; attention 2x
  assert (lora.linear, lora.attention, lora.head) == (2400, 576, 240)
  full = flops.backward(fwd, full_finetune=True)  # + weight gradients of linear layers and head
  assert (full.linear, full.attention, full.head) == (4800, 576, 480)


def test_step_by_hand():
  """One prompt of 2 tokens, G = 2 completions of 2 and 1 tokens: the update and scoring
  sequences are 3 and 2 tokens (the forward above, 2928)."""
  sep = flops.step(TINY, [2], [2, 1], 2)
  assert sep["scoring"].total == 2 * 2928  # the policy's and the reference forward
  assert sep["update"].total == 2928 + 3216  # forward + LoRA backward (2400 + 576 + 240)
  fused = flops.step(TINY, [2], [2, 1], 2, fused=True)
  assert fused["scoring"].total == 0
  assert fused["update"].total == 2 * 2928 + 3216  # the reference forward runs in the update
  full = flops.step(TINY, [2], [2, 1], 2, full_finetune=True, iterations=2)
  assert full["update"].total == 2 * (2928 + 5856)
  # Sampling: prefill 2 tokens once (3 pairs, the head once), then row 0 feeds its first token
  # at position 2 (3 pairs, the head once); row 1's only token is never fed. 3 tokens, 6 pairs:
  # linear 2 x 2 x 120 x 3 = 1440, attention 4 x 2 x 2 x 2 x 6 = 192, head 2 x 4 x 10 x 2 = 160.
  s = sep["sampling"]
  assert (s.linear, s.attention, s.head) == (1440, 192, 160)
  assert sep["total"].total == 1792 + 2 * 2928 + 6144


@settings(max_examples=max(1, settings.default.max_examples // 16), deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=6), st.integers(0, 20))
def test_forward_adds_over_sequences(lengths, head):
  """Packing sequences side by side (each attending within itself) changes no model FLOP."""
  parts = [flops.forward(TINY, [n], 0) for n in lengths]
  whole = flops.forward(TINY, lengths, head)
  assert whole.linear == sum(p.linear for p in parts)
  assert whole.attention == sum(p.attention for p in parts)
  assert whole.head == flops.forward(TINY, [], head).head


def test_peak_by_device_kind():
  assert flops.peak_flops("NVIDIA H200") == 989e12
  assert flops.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
  assert flops.peak_flops("TPU v5p") == 459e12
  assert flops.peak_flops("cpu") is None
  assert flops.peak_flops("cpu", 2.5) == 2.5e12
  assert flops.mfu(989e12, 2.0, 989e12, chips=1) == 0.5
  assert flops.mfu(1.0, 1.0, None) is None


@pytest.fixture(scope="module")
def task(tmp_path_factory):
  return arithmetic.build_assets(tmp_path_factory.mktemp("arith"), seed=0, train_per_level=20,
                                 heldout_per_level=2, verbose=False)


def test_trainer_perf_metrics(task, tmp_path):
  """`perf/update_tflops` counts the fused update program of the step by the FLOP model (the
  reference forward inside it), `perf/mfu` divides by the configured peak per chip."""
  cfg = TrainConfig().override(
      f"model.path={task.model_dir}", f"data.train_files=[{task.train_file}]",
      "data.prompt_template='{problem}'", "train.steps=1", "train.prompts_per_step=4",
      "train.num_generations=2", "sampling.max_new_tokens=8", "sampling.length_buckets=[8]",
      "lora.rank=2", f"train.output_dir={tmp_path}", "logging.progress=false",
      "logging.tensorboard=false", "eval.before=false", "eval.after=false",
      "logging.peak_tflops=0.001")
  trainer = Trainer(cfg)
  try:
    state = trainer.initial_state()
    c = trainer.collect(state, score=not trainer.fused)
    _, metrics, _ = trainer.update(state, c)
  finally:
    trainer.close()
  assert trainer.fused
  expected = flops.step(trainer.model_cfg, c.host.prompt_mask.sum(1), c.completion_mask_BxN.sum(1),
                        2, fused=True)["update"].total
  assert metrics["perf/update_tflops"] == pytest.approx(expected / metrics["update_time"] / 1e12)
  assert metrics["perf/mfu"] == pytest.approx(
      metrics["perf/update_tflops"] / 0.001 / jax.device_count())
