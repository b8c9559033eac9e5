"""Llama 3.x: the shared decoder without biases or q/k norms, rotary frequencies by Llama 3.1's
"llama3" rule. Parity against `transformers.LlamaForCausalLM` (torch CPU, eager, float32) on
random odd configs with and without the rule, the load/export round trip, greedy decoding,
LoRA and placement on 8 fake CPU devices; helpers and tolerances of tests/test_model.py. The
presets against the published Instruct config.json files and parameter counts.
"""

from __future__ import annotations


import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from epgrpo_jax.models import (Llama, LoraConfig, build, config_from_hf, config_to_hf, flops,
                               from_pretrained, hf_state_dict, param_rules, preset, rope_cos_sin,
                               save_pretrained)
from epgrpo_jax.parallel.sharding import MeshConfig, make_mesh, param_sharding
from helpers import random_model, tiny_config, torch_logits
from test_model import (LOGIT_ATOL, export_parity, hf_model, import_parity, ours,
                        padded_batch, randomize_lora)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LLAMA = dict(model_type="llama", attention_bias=False, qk_norm=False)
# (factor, low_freq_factor, high_freq_factor, original context): Llama 3.1's factors over a
# context short enough that, at head_dim 12 and theta 5e5, frequencies fall in all three bands
# (kept, divided by the factor, interpolated).
LLAMA3 = (8.0, 1.0, 4.0, 64)
PARITY_CONFIGS = {
    "gqa-untied-llama3": dict(head_dim=12, rope_theta=5e5, rope_scaling=LLAMA3),
    "h5-kv1-hd6-tied": dict(hidden_size=20, num_heads=5, num_kv_heads=1, head_dim=6,
                            tie_word_embeddings=True),
    "h3-mha-hd10-tied-llama3": dict(hidden_size=24, num_heads=3, num_kv_heads=3, head_dim=10,
                                    rope_theta=5e5, rope_scaling=(32.0, 1.0, 4.0, 32),
                                    tie_word_embeddings=True, num_layers=3),
}


def llama_config(**overrides):
  return tiny_config(**LLAMA, **overrides)


def hf_llama(directory):
  return hf_model(directory, transformers.LlamaForCausalLM)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
  cfg = llama_config(**PARITY_CONFIGS["gqa-untied-llama3"])
  return save_pretrained(random_model(cfg, seed=3), tmp_path_factory.mktemp("llama") / "m")


def test_llama3_rule_bands():
  """The rule keeps the fast frequencies, divides the slow ones by the factor and interpolates
  between: angles of position 1 against the unscaled ones."""
  theta, hd = 5e5, 12

  def angles(scaling):
    cos, sin = (np.asarray(x, np.float64)[0, 0, 0, :hd // 2]
                for x in rope_cos_sin(jnp.ones((1, 1)), hd, theta, scaling))
    return np.arctan2(sin, cos)

  plain, scaled = angles(None), angles(LLAMA3)
  wavelength = 2 * np.pi / (theta ** (-np.arange(0, hd, 2) / hd))
  fast, slow = wavelength < 64 / 4, wavelength > 64
  assert fast.any() and slow.any() and (~fast & ~slow).any()
  np.testing.assert_allclose(scaled[fast], plain[fast], rtol=1e-5)
  np.testing.assert_allclose(scaled[slow], plain[slow] / 8, rtol=1e-5)
  middle = ~fast & ~slow
  assert np.all(scaled[middle] < plain[middle]) and np.all(scaled[middle] > plain[middle] / 8)


@pytest.mark.parametrize("name", list(PARITY_CONFIGS))
def test_parity_ours_saved_hf_loads(name, tmp_path):
  model = random_model(llama_config(**PARITY_CONFIGS[name]), seed=11)
  assert isinstance(model, Llama) and model.layers[0].attn.q.bias is None
  export_parity(model, tmp_path / name, transformers.LlamaForCausalLM, f"ours->hf llama {name}")


@pytest.mark.parametrize("name", list(PARITY_CONFIGS))
def test_parity_hf_saved_ours_loads(name, tmp_path):
  cfg = llama_config(**PARITY_CONFIGS[name])
  model, torch_model = import_parity(cfg, tmp_path / name, transformers.LlamaForCausalLM,
                                     transformers.LlamaConfig, f"hf->ours llama {name}")
  assert set(hf_state_dict(model)) == set(torch_model.state_dict()) - (
      {"lm_head.weight"} if cfg.tie_word_embeddings else set())
  if cfg.rope_scaling is not None:  # the rule matters here: without it the logits move
    tokens, mask, positions = padded_batch(cfg.vocab_size, [0, 2], 11, "left")
    unscaled = random_model(cfg.replace(rope_scaling=None), seed=0)
    nnx.update(unscaled, nnx.state(model))
    assert np.abs(ours(unscaled, tokens, mask, positions) - ours(model, tokens, mask, positions))[
        mask].max() > 1e-3


def test_greedy_tokens_match_transformers(base_dir):
  from test_real_model import hf_greedy, our_greedy
  prompts = [[5, 17, 33, 8, 2], [9, 4], [71, 60, 12, 19, 44, 3, 30, 91]]
  theirs = hf_greedy(hf_llama(base_dir), prompts, (1,), 0, n=12)
  assert our_greedy(from_pretrained(base_dir), prompts, (1,), 0, n=12) == theirs


def test_config_round_trip_and_rejections():
  cfg = llama_config(**PARITY_CONFIGS["gqa-untied-llama3"], eos_token_id=(1, 2))
  assert config_from_hf(config_to_hf(cfg)) == cfg
  hf_cfg = transformers.LlamaConfig(**config_to_hf(cfg))
  assert hf_cfg.rope_parameters["rope_type"] == "llama3" and hf_cfg.rope_parameters["factor"] == 8.0
  assert config_from_hf(hf_cfg.to_dict()) == cfg  # transformers' own layout reads back
  old_layout = {k: v for k, v in config_to_hf(cfg).items() if k != "rope_parameters"}
  assert config_from_hf(old_layout | {"rope_theta": 5e5}) == cfg  # rope_scaling only (older files)
  for bad, match in (({"attention_bias": True}, "attention_bias"), ({"mlp_bias": True}, "mlp_bias"),
                     ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type"),
                     ({"rope_scaling": {"rope_type": "llama3", "factor": 4.0}}, "low_freq_factor")):
    with pytest.raises(ValueError, match=match) as info:
      config_from_hf(config_to_hf(cfg) | bad)
    assert "\n" not in str(info.value)
  with pytest.raises(ValueError, match="model.rope_scaling: a qwen2 decoder has rope_scaling=None"):
    build(tiny_config(rope_scaling=LLAMA3), None, nnx.Rngs(0))


def test_lora_zero_init_is_the_base_and_merged_export_matches_hf(base_dir, tmp_path):
  model, base = from_pretrained(base_dir, lora=LoraConfig(rank=4, alpha=8.0)), from_pretrained(base_dir)
  tokens, mask, positions = padded_batch(97, [0, 3, 5], 11, "left", seed=12)
  chex.assert_trees_all_close(ours(model, tokens, mask, positions), ours(base, tokens, mask, positions),
                              atol=1e-5)
  randomize_lora(model)
  with_adapters = ours(model, tokens, mask, positions)
  theirs = torch_logits(hf_llama(save_pretrained(model, tmp_path / "merged")), tokens, mask, positions)
  chex.assert_trees_all_close(with_adapters[mask], theirs[mask], atol=LOGIT_ATOL, rtol=0)


def test_mesh_placement_on_8_devices(base_dir):
  mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
  model = from_pretrained(base_dir, mesh=mesh, lora=LoraConfig(rank=4, alpha=8.0))
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    name, value = ".".join(map(str, path)), var.get_value()
    assert value.sharding.spec == param_sharding(name, value.shape, mesh, param_rules(model.cfg)).spec
  assert model.layers[0].attn.q.base.kernel.get_value().sharding.spec == P("fsdp", "tensor")
  tokens, mask, positions = padded_batch(97, [0, 1, 2, 3], 8, "left")
  chex.assert_trees_all_close(ours(model, tokens, mask, positions),
                              ours(from_pretrained(base_dir), tokens, mask, positions), atol=1e-5)


# ----------------------------------------------------------------------------- presets

def _instruct_config_json(hidden, inter, layers, heads, head_dim, tied, factor):
  """The keys of the published config.json of meta-llama's Llama 3.1 / 3.2 Instruct models that
  a `ModelConfig` reads, as those files spell them (`rope_scaling`, the older layout)."""
  return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256,
          "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
          "num_attention_heads": heads, "num_key_value_heads": 8, "head_dim": head_dim,
          "hidden_act": "silu", "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
          "rope_scaling": {"factor": factor, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                           "original_max_position_embeddings": 8192, "rope_type": "llama3"},
          "max_position_embeddings": 131072, "tie_word_embeddings": tied, "bos_token_id": 128000,
          "eos_token_id": [128001, 128008, 128009], "attention_bias": False, "mlp_bias": False}


# Preset: (its checkpoint's config.json keys, the parameter count published for the checkpoint).
PRESETS = {
    "llama3.2-1b": (_instruct_config_json(2048, 8192, 16, 32, 64, True, 32.0), 1_235_814_400),
    "llama3.2-3b": (_instruct_config_json(3072, 8192, 28, 24, 128, True, 32.0), 3_212_749_824),
    "llama3.1-8b": (_instruct_config_json(4096, 14336, 32, 32, 128, False, 8.0), 8_030_261_248),
}


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_is_its_checkpoints_config_json(name):
  hf, _ = PRESETS[name]
  assert preset(name) == config_from_hf(hf)
  assert preset(name).rope_scaling == (hf["rope_scaling"]["factor"], 1.0, 4.0, 8192)


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_builds_with_the_published_parameter_count(name):
  """The module of each preset, built abstractly (no weights allocated), has the checkpoint's
  parameter count (tied heads counted once); the FLOP model's linear and head products of one
  token are 2 per weight that multiplies it: every weight but the norms, and the embedding table
  too unless it is the head."""
  cfg = preset(name)
  model = nnx.eval_shape(lambda: build(cfg, None, nnx.Rngs(0)))
  assert isinstance(model, Llama)
  params = sum(int(np.prod(v.shape)) for v in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert params == PRESETS[name][1]
  norms = (2 * cfg.num_layers + 1) * cfg.hidden_size
  table = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
  one_token = flops.forward(cfg, [1], head_tokens=1)
  assert one_token.linear + one_token.head == 2 * (params - norms - table)
