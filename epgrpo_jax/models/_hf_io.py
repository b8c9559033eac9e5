"""Hugging Face checkpoint directories <-> the NNX models of every registered family, without torch.

config.json's `model_type` picks the family (`models.registry`), whose table maps HF tensor
names to NNX parameter paths. Loading reads one tensor
at a time from (possibly sharded) safetensors and places it straight into its
target sharding; saving folds LoRA adapters into the base weights.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from safetensors import safe_open
from safetensors.numpy import save_file

from epgrpo_jax.io.errors import MissingFileError, UserError
from epgrpo_jax.parallel import distributed, sharding
from epgrpo_jax.models._config import LoraConfig, ModelConfig, as_dtype
from epgrpo_jax.models import _lora
from epgrpo_jax.models.interface import CausalLM
from epgrpo_jax.models.registry import Family, abstract_model, config_from_hf, family

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json",
                   "chat_template.jinja", "chat_template.json")


def _tensor_files(directory: Path) -> dict[str, Path]:
  """HF tensor name -> the safetensors file holding it."""
  index = directory / "model.safetensors.index.json"
  single = directory / "model.safetensors"
  if index.exists():
    try:
      weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError) as e:
      raise UserError(f"{index}: not a valid safetensors index ({e})") from None
    return {name: directory / fname for name, fname in weight_map.items()}
  if single.exists():
    try:
      with safe_open(single, "numpy") as f:
        return {name: single for name in f.keys()}
    except Exception as e:  # safetensors raises its own error types
      raise UserError(f"{single}: unreadable safetensors file ({e})") from None
  raise MissingFileError(f"{directory}: no model.safetensors or model.safetensors.index.json")


def load_hf_config(directory: str | Path, **overrides) -> ModelConfig:
  path = Path(directory) / "config.json"
  if not path.exists():
    raise MissingFileError(f"{path}: missing (not a Hugging Face model directory)")
  try:
    hf = json.loads(path.read_text(encoding="utf-8"))
  except UnicodeDecodeError:
    raise UserError(f"{path}: not UTF-8 text") from None
  except json.JSONDecodeError as e:
    raise UserError(f"{path}: invalid JSON ({e})") from None
  if not isinstance(hf, dict):
    raise UserError(f"{path}: expected a JSON object, got {type(hf).__name__}")
  try:
    return config_from_hf(hf, **overrides)
  except ValueError as e:
    raise UserError(f"{path}: {e}") from None


def from_pretrained(directory: str | Path, *, dtype: str | None = None,
                    param_dtype: str | None = None, lora: LoraConfig | None = None,
                    mesh: jax.sharding.Mesh | None = None, seed: int = 0) -> CausalLM:
  """Loads an HF directory (config.json + safetensors) into the NNX model of its family.

  `dtype` is the compute dtype, `param_dtype` the base-weight dtype (default:
  float32). LoRA adapters, when requested, are freshly initialised (B = 0).
  With a mesh, each tensor goes straight to its sharding from `epgrpo_jax.parallel.sharding`.
  """
  directory = Path(directory)
  overrides = {k: v for k, v in (("dtype", dtype), ("param_dtype", param_dtype)) if v}
  cfg = load_hf_config(directory, **overrides)
  fam = family(cfg.model_type)
  fam.check_lora(lora)
  files = _tensor_files(directory)
  model = abstract_model(cfg, lora, seed)
  expected = fam.nnx_to_hf(cfg)
  missing = [n for n in expected if n not in files]
  if missing:
    raise UserError(f"{directory}: tensor {missing[0]!r} missing from the checkpoint"
                     + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
  unknown = [n for n in files if n not in expected and not any(re.fullmatch(p, n) for p in fam.ignored)
             and not (n == "lm_head.weight" and cfg.tie_word_embeddings)]
  if unknown:
    raise UserError(f"{files[unknown[0]]}: unexpected tensor {unknown[0]!r} for this config")

  by_path = _lora.plain_params(model)
  pdt = as_dtype(cfg.param_dtype)
  handles: dict[Path, object] = {}
  try:
    for name, (path, transpose) in expected.items():
      fname = files[name]
      if fname not in handles:
        if not fname.exists():
          raise MissingFileError(f"{fname}: missing (listed in the safetensors index)")
        try:
          handles[fname] = safe_open(fname, "numpy").__enter__()
        except Exception as e:
          raise UserError(f"{fname}: unreadable safetensors file ({e})") from None
      try:
        array = handles[fname].get_tensor(name)
      except Exception as e:
        raise UserError(f"{fname}: cannot read tensor {name!r} ({e})") from None
      array = array.T if transpose else array
      var = by_path[path]
      if tuple(array.shape) != tuple(var.shape):
        raise UserError(f"{fname}: tensor {name!r} has shape {tuple(array.shape)}, "
                         f"config.json implies {tuple(var.shape)}")
      var.set_value(_place(np.asarray(array).astype(pdt), path, mesh, fam))
  finally:
    for h in handles.values():
      h.__exit__(None, None, None)

  _lora.init_adapters(model, seed, lambda array, path: _place(array, path, mesh, fam))
  return model


def _place(array, path: str, mesh, fam: Family):
  if mesh is None:
    return jnp.asarray(array)
  # Every process holds the whole tensor: no collective.
  return distributed.put(array, sharding.param_sharding(path, array.shape, mesh, fam.param_rules()))


def _to_host(array) -> np.ndarray:
  """The full value of a (possibly multi-process sharded) array as numpy."""
  if isinstance(array, jax.Array) and not array.is_fully_addressable:
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))
  return np.asarray(jax.device_get(array))


def _weight_files(directory: Path) -> list[Path]:
  return [path for path in [directory / "model.safetensors", directory / "model.safetensors.index.json",
                            *directory.glob("model-*-of-*.safetensors")] if path.is_file()]


def _exchange(a: Path, b: Path) -> bool:
  """Swaps two directory entries in one atomic step (Linux renameat2 RENAME_EXCHANGE); False
  where the system or file system cannot."""
  try:
    libc = ctypes.CDLL(None, use_errno=True)
    at_fdcwd, rename_exchange = -100, 2
    return libc.renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0
  except (AttributeError, OSError):
    return False


def _swap_in(new: Path, directory: Path) -> None:
  """Replaces `directory` by the complete directory `new`. Earlier weights go (a stale index or
  single file must not shadow the new ones); any other file of the old directory that `new`
  lacks is copied across, so nothing else in it is lost. The two directories trade places in
  one atomic step where the system allows it, so an interruption at any point leaves either
  the old directory or the new one, whole."""
  if not directory.exists():
    os.replace(new, directory)
    return
  if not directory.is_dir():
    raise UserError(f"{directory}: exists and is not a directory; cannot write a model there")
  stale = {path.name for path in _weight_files(directory)}
  for entry in directory.iterdir():
    if entry.name not in stale and not (new / entry.name).exists():
      if entry.is_dir():
        shutil.copytree(entry, new / entry.name, symlinks=True)
      else:
        shutil.copy2(entry, new / entry.name, follow_symlinks=False)
  if _exchange(new, directory):
    shutil.rmtree(new)  # now the old directory
    return
  old = directory.with_name(f".{directory.name}.old-{os.getpid()}")
  os.replace(directory, old)  # without an atomic exchange: a short window with neither
  os.replace(new, directory)
  shutil.rmtree(old)


def hf_state_dict(model: CausalLM, dtype: str = "float32") -> dict[str, np.ndarray]:
  """HF-named numpy tensors with LoRA merged into the base weights."""
  out_dtype = np.dtype(as_dtype(dtype))
  params = _lora.plain_params(model)
  kernels = {f"{path}.kernel": layer for path, layer in _lora.projections(model).items()}
  tensors = {}
  for name, (path, transpose) in family(model.cfg.model_type).nnx_to_hf(model.cfg).items():
    array = _lora.folded_kernel(kernels[path]) if path in kernels else params[path][...]
    array = _to_host(array).astype(out_dtype)
    tensors[name] = np.ascontiguousarray(array.T if transpose else array)
  return tensors


def save_pretrained(model: CausalLM, directory: str | Path, *, tokenizer_dir: str | Path | None = None,
                    tokenizer=None, dtype: str = "float32", max_shard_bytes: int | None = None) -> Path:
  """Writes an HF directory transformers and vLLM load: config.json, safetensors, tokenizer.

  LoRA adapters are merged into the base weights (the written model is the
  policy with adapters on). Tokenizer files are copied from `tokenizer_dir`, or
  written by a transformers `tokenizer` object. `max_shard_bytes` splits the
  weights into several files with a `model.safetensors.index.json`. The directory is
  written under a temporary name and then replaces `directory` (earlier weights go,
  other files stay). With several processes, all must call
  this (the weights are gathered) and process 0 writes.
  """
  final = Path(directory)
  tensors = hf_state_dict(model, dtype)
  if jax.process_index() != 0:
    return final
  final.parent.mkdir(parents=True, exist_ok=True)
  # Written whole under a temporary name, then swapped in: an interrupted export leaves the
  # earlier directory as it was, and a model can be exported over the directory it came from.
  directory = final.with_name(f".{final.name}.tmp-{os.getpid()}")
  shutil.rmtree(directory, ignore_errors=True)
  directory.mkdir()
  config = family(model.cfg.model_type).config_to_hf(model.cfg) | {"torch_dtype": dtype, "dtype": dtype}
  (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
  if max_shard_bytes is None:
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
  else:
    shards, current, size = [], {}, 0
    for name, array in tensors.items():
      if current and size + array.nbytes > max_shard_bytes:
        shards.append(current)
        current, size = {}, 0
      current[name] = array
      size += array.nbytes
    shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards):
      fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
      save_file(shard, directory / fname, metadata={"format": "pt"})
      weight_map.update({name: fname for name in shard})
    total = sum(a.nbytes for a in tensors.values())
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
  if tokenizer_dir is not None:
    for fname in TOKENIZER_FILES:
      src = Path(tokenizer_dir) / fname
      if src.exists():
        shutil.copyfile(src, directory / fname)
  if tokenizer is not None:
    tokenizer.save_pretrained(directory)
  _swap_in(directory, final)
  return final
