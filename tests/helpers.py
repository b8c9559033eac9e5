"""Shared test helpers: tiny random Qwen2 models and HF directories written with our code."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from epgrpo_jax.models import CausalLM, LoraConfig, ModelConfig, abstract_model, preset, save_pretrained
from epgrpo_jax.models import _lora
from epgrpo_jax.models._hf_io import TOKENIZER_FILES

# The real Qwen2.5 tokenizer (fixture `qwen_tokenizer_dir` of tests/conftest.py); its ids
# need the real vocabulary size.
QWEN_VOCAB_ROWS = 151_936
QWEN_BOS, QWEN_EOS = 151_643, 151_645


def tiny_config(**overrides) -> ModelConfig:
  """The `test-tiny` preset with fields overridden."""
  return preset("test-tiny", **overrides)


def randomize(model: CausalLM, seed: int = 0, std: float = 0.2, lora_std: float = 0.2) -> CausalLM:
  """Fills every parameter with random numpy values in place (biases, norms, LoRA included).

  Norm weights become 1 + noise. With `lora_std=0` the adapters get their
  usual initialisation instead (A uniform in +-sqrt(6 / fan_in), B = 0).
  Works on an abstract model from `nnx.eval_shape` too.
  """
  rng = np.random.default_rng(seed)
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    name = ".".join(map(str, path))
    dtype = var.get_value().dtype
    factor = _lora.factor(name)  # "A", "B" of an adapter, else None
    if factor == "B" and not lora_std:
      value = np.zeros(var.shape)
    elif factor == "A" and not lora_std:
      bound = np.sqrt(6.0 / var.shape[0])
      value = rng.uniform(-bound, bound, var.shape)
    else:
      base = 1.0 if name.endswith("norm.weight") else 0.0
      scale = lora_std if factor else std
      value = base + scale * rng.standard_normal(var.shape)
    var.set_value(jnp.asarray(value, dtype))
  return model


def random_model(cfg: ModelConfig | None = None, *, lora: LoraConfig | None = None,
                 seed: int = 0, lora_std: float = 0.2) -> CausalLM:
  """A model of `cfg`'s family (default: the `test-tiny` Qwen2) with every parameter random,
  built without jax RNG."""
  cfg = cfg or tiny_config()
  model = abstract_model(cfg, lora, seed)
  return randomize(model, seed, lora_std=lora_std)


class WhitespaceTokenizer:
  """A whitespace tokenizer with no chat template: enough for the data layer's prompt rendering."""

  chat_template = None

  def __call__(self, text, add_special_tokens=False):
    return {"input_ids": [len(w) for w in text.split()]}


def copy_tokenizer(src: str | Path, dst: str | Path) -> None:
  """Copies the tokenizer files present in `src` into `dst`."""
  for fname in TOKENIZER_FILES:
    if (Path(src) / fname).exists():
      shutil.copyfile(Path(src) / fname, Path(dst) / fname)


def tiny_hf_dir(tmp_path: str | Path, *, name: str = "tiny-qwen2", seed: int = 0,
                tokenizer: str | Path | None = None, lora: LoraConfig | None = None,
                max_shard_bytes: int | None = None, **cfg) -> Path:
  """Writes a random tiny Qwen2 HF directory with our `save_pretrained`; returns its path.

  `cfg` overrides the `test-tiny` preset. `tokenizer` (a folder, e.g. the
  `qwen_tokenizer_dir` fixture) copies the Qwen2.5 tokenizer files from there
  and, unless given, sets the real vocabulary size and Qwen bos/eos ids. With
  `lora`, random adapters are merged into the written weights.
  """
  if tokenizer:
    cfg.setdefault("vocab_size", QWEN_VOCAB_ROWS)
    cfg.setdefault("bos_token_id", QWEN_BOS)
    cfg.setdefault("eos_token_id", QWEN_EOS)
  model = random_model(tiny_config(**cfg), lora=lora, seed=seed)
  directory = Path(tmp_path) / name
  tok_dir = Path(tokenizer) if tokenizer else None
  save_pretrained(model, directory, tokenizer_dir=tok_dir, max_shard_bytes=max_shard_bytes)
  return directory


TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # also fires on persistent-cache hits


class Events:
  """Counts jit tracings and XLA executable builds while installed; `names` lists the functions
  traced or compiled, in order, so that an unexpected count says what it was."""

  def __init__(self):
    self.traces = self.compiles = 0
    self.names: list[str] = []
    self._lock = threading.Lock()

  def _listener(self, event: str, duration: float, *, fun_name: str = "?", **_) -> None:
    with self._lock:
      if event == TRACE_EVENT:
        self.traces += 1
        self.names.append(f"trace {fun_name}")
      elif event == COMPILE_EVENT:
        self.compiles += 1
        self.names.append(f"compile {fun_name}")

  def __enter__(self) -> "Events":
    jax.monitoring.register_event_duration_secs_listener(self._listener)
    return self

  def __exit__(self, *exc) -> None:
    jax.monitoring.unregister_event_duration_listener(self._listener)


def arithmetic_task(directory: str | Path):
  """The embedded arithmetic task, small: a random-init tiny model with its tokenizer and splits."""
  from epgrpo_jax.tasks import arithmetic
  return arithmetic.build_assets(directory, seed=0, train_per_level=60, heldout_per_level=4,
                                 verbose=False)


def rl_step_config(task, out_dir: str | Path, *overrides: str):
  """A TrainConfig of 4 prompts x 4 completions of up to 16 tokens on `arithmetic_task`,
  LoRA rank 4, no progress bar, TensorBoard or sample dumps; then `overrides`."""
  from epgrpo_jax.training.config import TrainConfig
  return TrainConfig().override(
      f"model.path={task.model_dir}", f"data.train_files=[{task.train_file}]",
      "data.prompt_template='{problem}'", "train.prompts_per_step=4",
      "train.num_generations=4", "sampling.max_new_tokens=16", "lora.rank=4",
      f"train.output_dir={out_dir}", "logging.progress=false", "logging.tensorboard=false",
      "logging.samples_every=0", *overrides)


def torch_logits(model, tokens_BxT, mask_BxT, positions_BxT) -> np.ndarray:
  """Float32 logits [B, T, V] of a transformers causal LM, with explicit position ids."""
  import torch
  with torch.no_grad():
    out = model(input_ids=torch.as_tensor(tokens_BxT, dtype=torch.long),
                attention_mask=torch.as_tensor(mask_BxT, dtype=torch.long),
                position_ids=torch.as_tensor(positions_BxT, dtype=torch.long))
  return out.logits.float().numpy()


def assert_same_completions(a, b):
  """Two samplers' outputs (`SampleOutput`) agree: the same tokens, masks and lengths, log-probs
  and entropies within 1e-5."""
  np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
  np.testing.assert_array_equal(np.asarray(a.mask), np.asarray(b.mask))
  np.testing.assert_array_equal(np.asarray(a.lengths), np.asarray(b.lengths))
  np.testing.assert_allclose(np.asarray(a.logp), np.asarray(b.logp), atol=1e-5)
  np.testing.assert_allclose(np.asarray(a.entropy), np.asarray(b.entropy), atol=1e-5)
