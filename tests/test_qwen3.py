"""Qwen3 (dense): q/k RMSNorm per head, no q/k/v bias, head_dim independent of hidden / heads.

Parity against `transformers.Qwen3ForCausalLM` (torch CPU, eager attention, float32) on
random odd configs, the load/export round trip, greedy decoding, bf16, LoRA, placement on 8
fake CPU devices and one RL step through the trainer on a tiny Qwen3 checkpoint directory.
Helpers and tolerances are those of the Qwen2 tests (tests/test_model.py).
"""

from __future__ import annotations

import dataclasses
import json

import chex
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from epgrpo_jax.models import (LoraConfig, Qwen3, build, config_from_hf, config_to_hf, family,
                               from_pretrained, hf_state_dict, load_hf_config, param_rules, preset,
                               save_pretrained)
from epgrpo_jax.parallel.sharding import MeshConfig, make_mesh, param_sharding
from helpers import arithmetic_task, random_model, rl_step_config, tiny_config, torch_logits
from test_model import (LOGIT_ATOL, export_parity, flat_params, hf_model, import_parity, ours,
                        padded_batch, randomize_lora)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

QWEN3 = dict(model_type="qwen3", attention_bias=False, qk_norm=True)
# Random odd configs: GQA/MQA/MHA, tied and untied, head_dim * heads below, equal to and above
# the hidden size (Qwen3-4B: 32 x 128 = 4096 over a hidden size of 2560).
PARITY_CONFIGS = {
    "gqa-untied": dict(),  # hidden 32, 4 heads, 2 kv heads, head_dim 8
    "h5-kv1-hd6-tied": dict(hidden_size=20, num_heads=5, num_kv_heads=1, head_dim=6,
                            tie_word_embeddings=True),
    "h4-kv2-hd12-wide": dict(hidden_size=20, num_heads=4, num_kv_heads=2, head_dim=12,
                             tie_word_embeddings=True, rope_theta=1e6),
    "h3-mha-hd10-untied": dict(hidden_size=24, num_heads=3, num_kv_heads=3, head_dim=10,
                               rms_norm_eps=1e-5, num_layers=3),
}
# bf16 compute and weights against our float32, as a share of the largest |logit|: measured
# on this file's random tiny Qwen3 (weights of std 0.2, q/k norms included) at 1.52% (float32
# params) and 1.98% (bfloat16 params), above the Qwen2 test model's 1.5% / 1.7%
# (tests/test_model.py). Bound: 3%, 1.5x the larger measurement (the real-model tier's bound).
BF16_LOGIT_SHARE = 0.03


def qwen3_config(**overrides):
  return tiny_config(**QWEN3, **overrides)


def hf_qwen3(directory):
  return hf_model(directory, transformers.Qwen3ForCausalLM)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
  return save_pretrained(random_model(qwen3_config(), seed=3), tmp_path_factory.mktemp("q3") / "m")


# ----------------------------------------------------------------------------- parity

@pytest.mark.parametrize("name", list(PARITY_CONFIGS))
def test_parity_ours_saved_hf_loads(name, tmp_path):
  model = random_model(qwen3_config(**PARITY_CONFIGS[name]), seed=11)
  assert {"q_norm", "k_norm"} <= set(vars(model.layers[0].attn))
  assert model.layers[0].attn.q.bias is None
  export_parity(model, tmp_path / name, transformers.Qwen3ForCausalLM, f"ours->hf qwen3 {name}")


@pytest.mark.parametrize("name", list(PARITY_CONFIGS))
def test_parity_hf_saved_ours_loads(name, tmp_path):
  cfg = qwen3_config(**PARITY_CONFIGS[name])
  model, torch_model = import_parity(cfg, tmp_path / name, transformers.Qwen3ForCausalLM,
                                     transformers.Qwen3Config, f"hf->ours qwen3 {name}")
  hf_names = set(torch_model.state_dict())
  assert "model.layers.0.self_attn.q_norm.weight" in hf_names
  assert not any(n.endswith("_proj.bias") for n in hf_names)
  # Our export writes back the tensors transformers wrote (tied heads: no lm_head).
  assert set(hf_state_dict(model)) == hf_names - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())


def test_greedy_tokens_match_transformers(base_dir):
  from test_real_model import hf_greedy, our_greedy
  prompts = [[5, 17, 33, 8, 2], [9, 4], [71, 60, 12, 19, 44, 3, 30, 91]]
  ours_tokens = our_greedy(from_pretrained(base_dir), prompts, (1,), 0, n=12)
  theirs = hf_greedy(hf_qwen3(base_dir), prompts, (1,), 0, n=12)
  print(f"\nqwen3 greedy lengths {list(map(len, ours_tokens))}")
  assert ours_tokens == theirs


def test_bfloat16_logits_within_the_measured_share(base_dir):
  tokens, mask, positions = padded_batch(97, [0, 4, 7], 11, "left", seed=9)
  ref = ours(from_pretrained(base_dir), tokens, mask, positions)[mask]
  for param_dtype in ("float32", "bfloat16"):
    model = from_pretrained(base_dir, dtype="bfloat16", param_dtype=param_dtype)
    assert model.layers[0].attn.q_norm.weight.get_value().dtype == jnp.dtype(param_dtype)
    got = ours(model, tokens, mask, positions)[mask]
    share = np.abs(got - ref).max() / np.abs(ref).max()
    print(f"\nqwen3 bf16 compute, {param_dtype} params: max abs logit error {share:.4f} of the scale")
    assert np.isfinite(got).all() and share < BF16_LOGIT_SHARE


# ----------------------------------------------------------------------------- config

def test_config_round_trip_and_rejections():
  cfg = qwen3_config(head_dim=12, tie_word_embeddings=True, eos_token_id=(1, 2))
  assert config_from_hf(config_to_hf(cfg)) == cfg
  hf_cfg = transformers.Qwen3Config(**config_to_hf(cfg))
  assert hf_cfg.head_dim == 12 and hf_cfg.attention_bias is False
  # What transformers writes for a Qwen3 loads as the same config.
  assert config_from_hf(hf_cfg.to_dict()) == cfg
  for bad, match in (({"attention_bias": True}, "attention_bias"),
                     ({"use_sliding_window": True}, "sliding"),
                     ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
                     ({"num_experts": 8}, "num_experts"),
                     ({"model_type": "qwen3_moe"}, "model_type")):
    with pytest.raises(ValueError, match=match) as info:
      config_from_hf(config_to_hf(cfg) | bad)
    assert "\n" not in str(info.value)
  # A family's module takes only its own decoder flags: its checkpoints have exactly those tensors.
  for flags in (dict(attention_bias=True), dict(qk_norm=False)):
    with pytest.raises(ValueError, match="a qwen3 decoder has"):
      build(cfg.replace(**flags), None, nnx.Rngs(0))
  with pytest.raises(ValueError, match="model.qk_norm: a qwen2 decoder has qk_norm=False"):
    build(tiny_config(qk_norm=True), None, nnx.Rngs(0))
  assert isinstance(build(cfg, None, nnx.Rngs(0)), Qwen3)


def test_presets_have_the_published_shapes():
  for name, shape in (("qwen3-1.7b", (28, 2048, 6144, 16, 8, 128)),
                      ("qwen3-4b", (36, 2560, 9728, 32, 8, 128))):
    cfg = preset(name)
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads,
            cfg.num_kv_heads, cfg.head_dim) == shape, name
    assert (cfg.vocab_size, cfg.tie_word_embeddings, cfg.rope_theta, cfg.qk_norm,
            cfg.attention_bias) == (151_936, True, 1e6, True, False), name


# ----------------------------------------------------------------------------- LoRA, mesh

def test_lora_zero_init_is_the_base_and_merged_export_matches_hf(base_dir, tmp_path):
  lora = LoraConfig(rank=4, alpha=8.0)
  model, base = from_pretrained(base_dir, lora=lora), from_pretrained(base_dir)
  tokens, mask, positions = padded_batch(97, [0, 3, 5], 11, "left", seed=12)
  base_logits = ours(base, tokens, mask, positions)
  chex.assert_trees_all_close(ours(model, tokens, mask, positions), base_logits, atol=1e-5)
  np.testing.assert_array_equal(ours(model, tokens, mask, positions, adapters=False),
                                ours(model, tokens, mask, positions))
  randomize_lora(model)
  with_adapters = ours(model, tokens, mask, positions)
  assert np.abs(with_adapters - base_logits)[mask].max() > 0.1
  theirs = torch_logits(hf_qwen3(save_pretrained(model, tmp_path / "merged")), tokens, mask,
                       positions)
  chex.assert_trees_all_close(with_adapters[mask], theirs[mask], atol=LOGIT_ATOL, rtol=0)
  # The q/k norms are frozen base weights: no adapter on them, written unchanged.
  tensors = hf_state_dict(model)
  np.testing.assert_array_equal(tensors["model.layers.1.self_attn.k_norm.weight"],
                                flat_params(base)["layers.1.attn.k_norm.weight"])


def test_mesh_placement_on_8_devices(base_dir):
  mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
  lora = LoraConfig(rank=4, alpha=8.0)
  model, host = from_pretrained(base_dir, mesh=mesh, lora=lora), from_pretrained(base_dir, lora=lora)
  values = {".".join(map(str, p)): v.get_value()
            for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  shardings = {p: v.sharding for p, v in values.items()}
  specs = {p: s.spec for p, s in shardings.items()}
  for name, value in values.items():  # placed by the Qwen3 family's rules
    assert specs[name] == param_sharding(name, value.shape, mesh, param_rules(model.cfg)).spec, name
  assert family("qwen3").param_rules() == param_rules(model.cfg)
  assert not any("bias" in pattern for pattern, _ in family("qwen3").param_axes)
  assert specs["layers.0.attn.q.base.kernel"] == P("fsdp", "tensor")  # q wrapped by its adapter
  assert specs["layers.0.attn.k.lora_b"] == P(None, "tensor")
  assert all(shardings[f"layers.{i}.attn.{x}_norm.weight"].is_fully_replicated
             for i in range(2) for x in "qk")
  assert not any(p.endswith(".bias") for p in specs)
  tokens, mask, positions = padded_batch(97, [0, 1, 2, 3], 8, "left")
  chex.assert_trees_all_close(ours(model, tokens, mask, positions),
                              ours(host, tokens, mask, positions), atol=1e-5)


# ----------------------------------------------------------------------------- RL smoke

def test_rl_step_through_the_trainer(tmp_path):
  """One EP-GRPO step on a tiny random Qwen3 with the arithmetic task's tokenizer: finite
  metrics and a gradient (a dense reward, as tests/test_sharding.py: the random model earns 0
  from the exact answer), and the exported policy is a Qwen3 directory transformers reads
  with our logits."""
  from epgrpo_jax.training.loop import train
  task = arithmetic_task(tmp_path / "task")
  cfg = load_hf_config(task.model_dir).replace(**QWEN3, num_layers=2)
  model_dir = save_pretrained(random_model(cfg, seed=2), tmp_path / "qwen3",
                              tokenizer_dir=task.model_dir)
  run = rl_step_config(dataclasses.replace(task, model_dir=model_dir), tmp_path / "run",
                       "train.steps=1", "sampling.length_buckets=[16]",
                       "reward.function=test_sharding:digit_reward")
  summary = train(run)
  rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  [step] = [r for r in rows if "loss" in r]
  for key in ("reward", "kl", "entropy", "loss", "grad_norm"):
    assert np.isfinite(step[key]), key
  assert step["grad_norm"] > 0
  policy = tmp_path / "run" / "policy"
  assert summary["steps"] == 1
  assert json.loads((policy / "config.json").read_text())["model_type"] == "qwen3"
  tokens, mask, positions = padded_batch(cfg.vocab_size, [0, 2], 9, "left", seed=1)
  chex.assert_trees_all_close(
      ours(from_pretrained(policy), tokens, mask, positions)[mask],
      torch_logits(hf_qwen3(policy), tokens, mask, positions)[mask], atol=LOGIT_ATOL, rtol=0)
