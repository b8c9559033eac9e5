"""The "Add a model family" walk-through of docs/architecture.md, kept honest: a toy family with
its own config.json keys and tensor names, registered exactly as the doc says, runs through
HF config -> build, save_pretrained / from_pretrained (bit-equal weights), sharding on the 8 fake
CPU devices of tests/conftest.py, and one sampler call."""

from __future__ import annotations

import json
from typing import Any

import chex
import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from safetensors import safe_open

from epgrpo_jax.io.errors import UserError
from epgrpo_jax.models import (Dense, LoRA, LoraConfig, ModelConfig, build, config_from_hf, config_to_hf, family,
                               from_pretrained, init_cache, load_hf_config, registry, save_pretrained)
from epgrpo_jax.models._decoder import Decoder, init_cache as decoder_cache
from epgrpo_jax.parallel.sharding import MeshConfig, make_mesh, param_sharding
from epgrpo_jax.rollout.sampling import Sampler, SamplingConfig
from helpers import random_model


# --- Step 1: the module (the shared decoder as it is; a family may add flags to it).
class ToyLM(Decoder):
  """A made-up family on the shared decoder."""


# --- Step 2: config.json <-> ModelConfig, in the family's own key names.
def toy_config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
  if hf.get("sliding_window"):
    raise UserError("sliding_window: not supported by toylm")
  return dict(vocab_size=hf["vocab"], hidden_size=hf["dim"], intermediate_size=hf["ffn_dim"],
              num_layers=hf["n_layers"], num_heads=hf["n_heads"], num_kv_heads=hf["n_kv_heads"],
              rope_theta=float(hf["rope_theta"]), rms_norm_eps=float(hf["norm_eps"]),
              tie_word_embeddings=hf["tied"], max_position_embeddings=hf["max_seq_len"],
              bos_token_id=hf["bos_id"], eos_token_id=hf["eos_id"])


def toy_config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
  return {"model_type": "toylm", "vocab": cfg.vocab_size, "dim": cfg.hidden_size,
          "ffn_dim": cfg.intermediate_size, "n_layers": cfg.num_layers, "n_heads": cfg.num_heads,
          "n_kv_heads": cfg.num_kv_heads, "rope_theta": cfg.rope_theta, "norm_eps": cfg.rms_norm_eps,
          "tied": cfg.tie_word_embeddings, "max_seq_len": cfg.max_position_embeddings,
          "bos_id": cfg.bos_token_id, "eos_id": cfg.eos_token_id}


# --- Step 3: the HF weight table (HF regex -> NNX path template, transposed) and the names.
TOY_WEIGHTS = (
    (r"tok_embeddings\.weight", "embed", False),
    (r"output\.weight", "lm_head", True),
    (r"norm\.weight", "final_norm.weight", False),
    (r"blocks\.(\d+)\.attn_norm\.scale", "layers.{0}.input_norm.weight", False),
    (r"blocks\.(\d+)\.ffn_norm\.scale", "layers.{0}.post_attn_norm.weight", False),
    (r"blocks\.(\d+)\.attention\.w(q|k|v|o)\.weight", "layers.{0}.attn.{1}.kernel", True),
    (r"blocks\.(\d+)\.attention\.w(q|k|v)\.bias", "layers.{0}.attn.{1}.bias", False),
    (r"blocks\.(\d+)\.feed_forward\.w1\.weight", "layers.{0}.mlp.gate.kernel", True),
    (r"blocks\.(\d+)\.feed_forward\.w3\.weight", "layers.{0}.mlp.up.kernel", True),
    (r"blocks\.(\d+)\.feed_forward\.w2\.weight", "layers.{0}.mlp.down.kernel", True),
)


def toy_hf_names(cfg: ModelConfig) -> list[str]:
  names = ["tok_embeddings.weight", "norm.weight"] + ([] if cfg.tie_word_embeddings else ["output.weight"])
  for i in range(cfg.num_layers):
    b = f"blocks.{i}."
    names += [b + "attn_norm.scale", b + "ffn_norm.scale"]
    names += [b + f"attention.w{x}.weight" for x in "qkvo"] + [b + f"attention.w{x}.bias" for x in "qkv"]
    names += [b + f"feed_forward.w{x}.weight" for x in "132"]
  return names


# --- Step 4: logical axes of the base weights (LoRA factors follow their kernel's). The toy's
# own choice: its embedding and head keep the vocabulary whole (Qwen2 splits it over `tensor`);
# paths without a row (norms, biases) are replicated.
TOY_AXES = (
    (r"embed", (None, "embed")),
    (r"lm_head", ("embed", None)),
    (r".*attn\.(q|k|v)\.kernel", ("embed", "heads")),
    (r".*attn\.o\.kernel", ("heads", "embed")),
    (r".*mlp\.(gate|up)\.kernel", ("embed", "mlp")),
    (r".*mlp\.down\.kernel", ("mlp", "embed")),
)

# --- Step 5: the Family, registered (the package's __init__ does this; models/__init__ imports it).
TOY = registry.Family(model_type="toylm", module=ToyLM, config_from_hf=toy_config_from_hf,
                      config_to_hf=toy_config_to_hf, weights=TOY_WEIGHTS, hf_names=toy_hf_names,
                      param_axes=TOY_AXES, lora_targets=("q", "v"), init_cache=decoder_cache)

HF_CONFIG = {"model_type": "toylm", "vocab": 96, "dim": 32, "ffn_dim": 48, "n_layers": 2, "n_heads": 4,
             "n_kv_heads": 2, "rope_theta": 10000.0, "norm_eps": 1e-6, "tied": False, "max_seq_len": 128,
             "bos_id": 0, "eos_id": 1}
LORA = LoraConfig(rank=2, alpha=4.0, targets=("q", "v"))


@pytest.fixture
def toy(monkeypatch):
  """The toy family registered for one test (the registry as it was afterwards)."""
  monkeypatch.setattr(registry, "_FAMILIES", dict(registry._FAMILIES))
  registry.register(TOY)
  return TOY


def test_hf_config_builds_the_family(toy):
  cfg = config_from_hf(HF_CONFIG)
  assert (cfg.model_type, cfg.hidden_size, cfg.head_dim, cfg.num_kv_heads) == ("toylm", 32, 8, 2)
  assert config_to_hf(cfg) == HF_CONFIG and family("toylm") is toy
  model = build(cfg, LORA, nnx.Rngs(0))
  assert type(model) is ToyLM and isinstance(model.layers[0].attn.q, LoRA)
  assert type(model.layers[0].mlp.gate) is Dense
  hidden, cache = model(np.array([[3, 4, 5]]), np.array([[0, 1, 2]]), np.ones((1, 3), bool),
                        init_cache(cfg, 1, 4))
  assert hidden.shape == (1, 3, 32) and int(cache["index"]) == 3
  with pytest.raises(UserError, match=r"^lora.targets: \['gate'\] are not projections of model_type "
                                      r"'toylm'; choose from \['q', 'v'\]$"):
    build(cfg, LoraConfig(rank=2, alpha=4.0, targets=("q", "gate")), nnx.Rngs(0))
  with pytest.raises(UserError, match=r"^model_type: unsupported 'nope'; known: llama, qwen2, qwen3, toylm$"):
    config_from_hf(HF_CONFIG | {"model_type": "nope"})
  with pytest.raises(UserError, match=r"^sliding_window: not supported by toylm$"):
    config_from_hf(HF_CONFIG | {"sliding_window": 64})


def test_save_and_load_round_trip_bit_equal(toy, tmp_path):
  cfg = config_from_hf(HF_CONFIG)
  model = random_model(cfg, seed=3)
  save_pretrained(model, tmp_path / "toy")
  assert json.loads((tmp_path / "toy" / "config.json").read_text())["model_type"] == "toylm"
  with safe_open(tmp_path / "toy" / "model.safetensors", "numpy") as f:
    assert sorted(f.keys()) == sorted(toy_hf_names(cfg))  # the family's names, no other
    # HF stores [out, in]: wq is q's kernel transposed.
    np.testing.assert_array_equal(f.get_tensor("blocks.1.attention.wq.weight"),
                                  np.asarray(model.layers[1].attn.q.kernel[...]).T)
  assert load_hf_config(tmp_path / "toy") == cfg
  loaded = from_pretrained(tmp_path / "toy")
  assert type(loaded) is ToyLM
  chex.assert_trees_all_equal(nnx.state(loaded, nnx.Param), nnx.state(model, nnx.Param))


def test_sharded_load_and_one_sampler_call(toy, tmp_path):
  cfg = config_from_hf(HF_CONFIG)
  save_pretrained(random_model(cfg, seed=4), tmp_path / "toy")
  mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
  assert mesh.size == 8
  model = from_pretrained(tmp_path / "toy", mesh=mesh, lora=LORA)
  rules = toy.param_rules()
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    name, value = ".".join(map(str, path)), var.get_value()
    assert value.sharding.spec == param_sharding(name, value.shape, mesh, rules).spec, name
  q = model.layers[0].attn.q
  assert q.base.kernel[...].sharding.spec == P("fsdp", "tensor")
  assert q.lora_a[...].sharding.spec == P("fsdp", None)  # (embed, rank): the kernel's input axis
  assert q.lora_b[...].sharding.spec == P(None, "tensor")  # (rank, heads): its output axis
  assert model.embed[...].sharding.spec == P(None, "fsdp")  # the toy's rule (Qwen2: "tensor", "fsdp")
  assert q.base.bias[...].sharding.spec == P()  # no row: replicated

  prompts = [[5, 17, 33, 2], [44, 3, 90, 12, 7, 7]]
  config = SamplingConfig(greedy=True, max_new_tokens=4, prompt_buckets=(8,), length_buckets=(4,))
  out = Sampler(config, eos_ids=(-5,), mesh=mesh).sample(nnx.split(model), prompts, 1,
                                                         jax.random.key(0))
  assert out.tokens.shape == (2, 1, 4)
  # The first greedy token is the argmax of the full forward at each prompt's last token.
  host = from_pretrained(tmp_path / "toy", lora=LORA)
  for i, ids in enumerate(prompts):
    n = len(ids)
    hidden, _ = host(np.array([ids]), np.arange(n)[None], np.ones((1, n), bool))
    assert int(out.tokens[i, 0, 0]) == int(np.argmax(host.logits(hidden)[0, -1]))
