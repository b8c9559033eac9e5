"""The task's cached assets: the two splits, the tokenizer and a randomly initialised tiny Qwen2
(a Hugging Face directory), built once per parameter set with an atomic rename."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Iterable

from flax import nnx

from epgrpo_jax.io import catalog
from epgrpo_jax.io.records import read_rows
from epgrpo_jax.models import ModelConfig, build, save_pretrained
from epgrpo_jax.tasks.arithmetic.problems import LEVELS, VERSION, generate_splits
from epgrpo_jax.tasks.arithmetic.tokenizer import IM_END, PAD, build_tokenizer, chat_prompt, save_tokenizer


def tiny_model_config(vocab_size: int, *, eos_token_id: int, pad_token_id: int, **overrides):
  """The tiny Qwen2 of the embedded default (sized for 2 CPU cores)."""
  kw: dict[str, Any] = dict(vocab_size=vocab_size, hidden_size=128, intermediate_size=384,
                            num_layers=4, num_heads=8, num_kv_heads=4, rope_theta=10000.0,
                            tie_word_embeddings=True, max_position_embeddings=512,
                            bos_token_id=pad_token_id, eos_token_id=eos_token_id)
  kw.update(overrides)
  return ModelConfig(**kw)


@dataclasses.dataclass(frozen=True)
class Assets:
  """Paths of a built task: the random-init model (with tokenizer) and the two splits."""

  root: Path
  model_dir: Path  # HF dir: config.json, model.safetensors, tokenizer files
  train_file: Path  # JSONL rows: problem, answer, level, solution, expression
  heldout_file: Path  # the same fields; shuffled, so any prefix mixes all levels
  seed: int
  manifest: dict[str, Any]

  @property
  def tokenizer_dir(self) -> Path:
    return self.model_dir

  def train_rows(self) -> list[dict[str, Any]]:
    return read_rows(self.train_file)

  def heldout_rows(self) -> list[dict[str, Any]]:
    return read_rows(self.heldout_file)


def _write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> None:
  with open(path, "w") as f:
    for row in rows:
      f.write(json.dumps(row) + "\n")


def _digest(obj: Any) -> str:
  return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:10]


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def atomic_build(final: Path, build_fn) -> bool:
  """Runs `build_fn(tmp_dir)` and renames tmp_dir to `final` (a no-op if it exists).

  The temporary directory sits next to `final`; leftovers of killed builds
  (their process gone) are removed first. Returns True if this call built it.
  """
  final = Path(final)
  if final.exists():
    return False
  final.parent.mkdir(parents=True, exist_ok=True)
  for stale in final.parent.glob(f".tmp-{final.name}-*"):
    try:
      pid = int(stale.name.rsplit("-", 2)[1])
    except ValueError:
      continue
    if not _pid_alive(pid):
      shutil.rmtree(stale, ignore_errors=True)
  tmp = final.parent / f".tmp-{final.name}-{os.getpid()}-{os.urandom(4).hex()}"
  tmp.mkdir()
  try:
    build_fn(tmp)
    try:
      os.rename(tmp, final)
    except OSError:  # another process finished first
      if not final.exists():
        raise
      shutil.rmtree(tmp, ignore_errors=True)
      return False
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return True


def build_assets(data_dir: str | Path | None = None, seed: int = 0, *, train_per_level: int = 1500,
                 heldout_per_level: int = 50, vocab_size: int = 384,
                 model_overrides: dict[str, Any] | None = None, verbose: bool = True) -> Assets:
  """Builds (once) and returns the task's assets under `data_dir`.

  A build is keyed by its parameters: `data_dir/arithmetic-v1-seed{seed}-{hash}/` holds
  `model/` (random-init tiny Qwen2 + tokenizer), `train.jsonl`,
  `heldout.jsonl` and `manifest.json`. It is written to a temporary directory
  and renamed into place, so a killed build leaves no partial cache; a second
  call with the same parameters does no work.
  """
  data_dir = Path(data_dir) if data_dir is not None else catalog.cache_dir()
  params = dict(version=VERSION, seed=seed, train_per_level=train_per_level,
                heldout_per_level=heldout_per_level, vocab_size=vocab_size,
                model_overrides=model_overrides or {},
                levels={str(k): dataclasses.asdict(v) for k, v in LEVELS.items()})
  root = data_dir / f"{VERSION}-seed{seed}-{_digest(params)}"

  def build(tmp: Path) -> None:
    t0 = time.time()
    train, heldout = generate_splits(seed, train_per_level, heldout_per_level)
    _write_jsonl(tmp / "train.jsonl", train)
    _write_jsonl(tmp / "heldout.jsonl", heldout)
    tok = build_tokenizer((chat_prompt(r["problem"]) + r["solution"] + IM_END for r in train),
                          vocab_size)
    save_tokenizer(tok, tmp / "model")
    _save_random_model(tmp / "model", tok, seed, model_overrides or {})
    manifest = dict(params, num_train_rows=len(train), num_heldout_rows=len(heldout),
                    vocab=tok.get_vocab_size(), build_seconds=round(time.time() - t0, 2))
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")

  t0 = time.time()
  if atomic_build(root, build) and verbose:
    print(f"[arithmetic] built task assets in {time.time() - t0:.1f}s: {root}", flush=True)
  manifest = json.loads((root / "manifest.json").read_text())
  return Assets(root=root, model_dir=root / "model", train_file=root / "train.jsonl",
                heldout_file=root / "heldout.jsonl", seed=seed, manifest=manifest)


def _save_random_model(directory: Path, tok, seed: int, overrides: dict[str, Any]) -> None:
  cfg = tiny_model_config(tok.get_vocab_size(), eos_token_id=tok.token_to_id(IM_END),
                          pad_token_id=tok.token_to_id(PAD), **overrides)
  save_pretrained(build(cfg, None, nnx.Rngs(seed)), directory)
  gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
         "pad_token_id": tok.token_to_id(PAD)}
  (directory / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
