"""Supervised fine-tuning (the warm start): cross-entropy on completion tokens.

The command is `python -m epgrpo_jax.sft` (epgrpo_jax/sft.py).
Each row's prompt is rendered with the tokenizer's chat template (generation
prompt added) and its completion is followed by the EOS token; the loss is the
mean negative log-likelihood of the completion tokens (EOS included), never of
the prompt or padding. Sequences are padded to a few bucket lengths, so the
jitted step compiles at most once per bucket. Full fine-tuning by default;
`lora_rank > 0` trains LoRA adapters only (merged into the saved weights).

Shape suffixes: B batch rows, T tokens, D hidden, V vocabulary, N flat tokens.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from epgrpo_jax.core import optim
from epgrpo_jax.io.errors import MissingFileError, UserError
from epgrpo_jax.core.token_stats import token_logprob_entropy
from epgrpo_jax.io.metrics import Progress
from epgrpo_jax.io.records import read_rows
from epgrpo_jax.kernels import seam
from epgrpo_jax.models import (XLA, CausalLM, Kernels, LORA, LoraConfig, from_pretrained, load_tokenizer,
                               render_prompt, save_pretrained)


SCHEDULES = ("cosine", "linear", "constant")


@dataclasses.dataclass(frozen=True)
class SFTConfig:
  """Supervised fine-tuning settings."""

  model: str  # HF model directory (with tokenizer files)
  data: str  # JSONL file of rows with a prompt and a completion field
  out: str | None = None  # where to save the HF directory (None: do not save)
  steps: int = 300
  batch_size: int = 64
  lr: float = 3e-3
  warmup_ratio: float = 0.05
  schedule: str = "cosine"  # after warm-up: "cosine" or "linear" decay to end_lr_ratio * lr, or "constant"
  end_lr_ratio: float = 0.0
  weight_decay: float = 0.01
  b1: float = 0.9
  b2: float = 0.99
  max_grad_norm: float = 1.0
  seed: int = 0
  prompt_field: str = "problem"
  completion_field: str = "solution"
  prompt_template: str = "{problem}"  # the user message; {problem} is the prompt field
  max_length: int = 512  # longer examples are skipped (and counted)
  buckets: tuple[int, ...] = ()  # padded lengths; () = 32, 48, 64, 96, 128, 192, ... max_length
  loss_chunk_tokens: int = 8192  # the LM head runs on at most this many tokens at once
  lora_rank: int = 0  # > 0: train LoRA adapters only
  lora_alpha: float = 64.0
  log_every: int = 50
  verbose: bool = True

  def __post_init__(self):
    for name in ("steps", "batch_size", "max_length", "loss_chunk_tokens", "log_every"):
      if getattr(self, name) <= 0:
        raise UserError(f"{name}: must be > 0, got {getattr(self, name)}")
    if not self.lr > 0:
      raise UserError(f"lr: must be > 0, got {self.lr}")
    if not 0 <= self.warmup_ratio < 1:
      raise UserError(f"warmup_ratio: must be in [0, 1), got {self.warmup_ratio}")
    if self.schedule not in SCHEDULES:
      raise UserError(f"schedule: must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
    if "{problem}" not in self.prompt_template:
      raise UserError("prompt_template: must contain {problem}")
    if self.lora_rank < 0:
      raise UserError(f"lora_rank: must be >= 0, got {self.lora_rank}")
    object.__setattr__(self, "buckets", tuple(sorted(self.buckets)))

  def bucket_lengths(self) -> tuple[int, ...]:
    if self.buckets:
      return tuple(b for b in self.buckets if b < self.max_length) + (self.max_length,)
    out, b = [], 32
    while b < self.max_length:
      out.append(b)
      b = b * 3 // 2 if b & (b - 1) == 0 else b * 4 // 3  # 32, 48, 64, 96, 128, ...
    return tuple(out) + (self.max_length,)


@dataclasses.dataclass
class SFTResult:
  model: CausalLM  # the trained model (adapters merged if LoRA)
  path: Path | None  # the saved HF directory
  losses: list[float]  # per step
  seconds: float  # wall-clock of the training loop, compiles included
  skipped: dict[str, int]  # rows skipped, by reason


# ----------------------------------------------------------------------------- data

def encode_rows(tokenizer, rows: Sequence[dict[str, Any]], cfg: SFTConfig,
                skipped: dict[str, int] | None = None) -> list[tuple[np.ndarray, int]]:
  """(token ids, number of prompt tokens) per usable row; the others are counted in `skipped`."""
  skipped = {} if skipped is None else skipped
  eos = tokenizer.eos_token_id
  if eos is None:
    raise UserError("tokenizer: no eos_token; SFT needs one to end completions")
  usable = []
  for row in rows:
    prompt, completion = row.get(cfg.prompt_field), row.get(cfg.completion_field)
    if not isinstance(prompt, str) or not isinstance(completion, str) or not prompt or not completion:
      skipped["missing_field"] = skipped.get("missing_field", 0) + 1
    else:
      usable.append((render_prompt(tokenizer, cfg.prompt_template.replace("{problem}", prompt)),
                     completion))
  if not usable:
    return []
  prompts = tokenizer([p for p, _ in usable], add_special_tokens=False)["input_ids"]
  completions = tokenizer([c for _, c in usable], add_special_tokens=False)["input_ids"]
  out = []
  for p, c in zip(prompts, completions):
    if len(p) + len(c) + 1 > cfg.max_length:
      skipped["too_long"] = skipped.get("too_long", 0) + 1
      continue
    out.append((np.asarray(p + c + [eos], np.int32), len(p)))
  return out


def batches(examples: Sequence[tuple[np.ndarray, int]], batch_size: int,
            buckets: Sequence[int], pad_id: int, seed: int) -> Iterator[dict[str, np.ndarray]]:
  """An endless stream of padded batches, rows grouped by bucket length.

  Each epoch shuffles every bucket and cuts it into full batches; a bucket's
  remainder moves up to the next bucket, the last one's wraps around.
  """
  if not examples:
    raise UserError("no training examples")
  buckets = sorted(buckets)
  by_bucket: dict[int, list[int]] = {b: [] for b in buckets}
  for i, (ids, _) in enumerate(examples):
    by_bucket[next(b for b in buckets if len(ids) <= b)].append(i)
  rng = np.random.default_rng(seed)
  while True:
    plan = []
    carry: list[int] = []
    for b in buckets:
      pool = carry + list(rng.permutation(by_bucket[b]))
      n_full = len(pool) // batch_size
      plan += [(b, pool[k * batch_size:(k + 1) * batch_size]) for k in range(n_full)]
      carry = pool[n_full * batch_size:]
    if carry:
      everything = [i for b in buckets for i in by_bucket[b]]
      fill = list(rng.choice(everything, batch_size - len(carry)))
      plan.append((buckets[-1], carry + fill))
    for k in rng.permutation(len(plan)):
      length, idx = plan[k]
      yield _pad_batch([examples[i] for i in idx], length, pad_id)


def _pad_batch(rows: Sequence[tuple[np.ndarray, int]], length: int,
               pad_id: int) -> dict[str, np.ndarray]:
  b = len(rows)
  tokens = np.full((b, length), pad_id, np.int32)
  mask = np.zeros((b, length), np.int32)
  loss_mask = np.zeros((b, length), np.float32)
  for r, (ids, n_prompt) in enumerate(rows):
    tokens[r, :len(ids)] = ids
    mask[r, :len(ids)] = 1
    loss_mask[r, n_prompt:len(ids)] = 1.0
  return {"tokens_BxT": tokens, "mask_BxT": mask, "loss_mask_BxT": loss_mask}


# ----------------------------------------------------------------------------- loss and step

def sft_loss(model: CausalLM, batch: dict[str, jax.Array], chunk: int, kernels: Kernels = XLA) -> jax.Array:
  """Mean NLL of the completion tokens: position t predicts token t + 1."""
  tokens = batch["tokens_BxT"]
  b, t = tokens.shape
  positions_BxT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  hidden_BxTxD, _ = model(tokens, positions_BxT, batch["mask_BxT"], kernels=kernels)
  # The chunked LM head of the RL loss: no [B, T, V] logits, whatever the vocabulary.
  logp_BxT, _ = token_logprob_entropy(hidden_BxTxD[:, :-1], model.head_DxV(), tokens[:, 1:],
                                      token_chunk=chunk)
  weight_BxT = batch["loss_mask_BxT"][:, 1:]
  return -jnp.sum(logp_BxT * weight_BxT) / jnp.maximum(jnp.sum(weight_BxT), 1.0)


def make_schedule(cfg: SFTConfig) -> optax.Schedule:
  """Linear warm-up from 0, then cosine or linear decay to `end_lr_ratio * lr`, or constant."""
  return optim.make_schedule(cfg.lr, cfg.steps, warmup_ratio=cfg.warmup_ratio, decay=cfg.schedule,
                             end_ratio=cfg.end_lr_ratio)


def make_optimizer(cfg: SFTConfig) -> optax.GradientTransformation:
  """AdamW on `make_schedule`, after global-norm gradient clipping."""
  return optim.make_optimizer(make_schedule(cfg), weight_decay=cfg.weight_decay,
                              max_grad_norm=cfg.max_grad_norm, b1=cfg.b1, b2=cfg.b2)


def make_train_step(graphdef, tx: optax.GradientTransformation, chunk: int):
  """The jitted update over (params, opt_state, rest, batch); params and opt_state donated."""

  def loss_fn(params, rest, batch):
    model = nnx.merge(graphdef, params, rest)
    return sft_loss(model, batch, chunk, seam.choose(model.cfg))  # an unsharded program

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, rest, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, rest, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step


# ----------------------------------------------------------------------------- training

def train(model: CausalLM, tokenizer, rows: Sequence[dict[str, Any]], cfg: SFTConfig,
          skipped_lines: dict[str, int] | None = None) -> SFTResult:
  """Fine-tunes `model` in place on `rows`; returns it with the loss history. `skipped_lines`:
  lines the reader already skipped (counted with the rows skipped here)."""
  skipped: dict[str, int] = dict(skipped_lines or {})
  examples = encode_rows(tokenizer, rows, cfg, skipped)
  if not examples:
    raise UserError(f"{cfg.data}: no usable rows (skipped: {skipped})")
  pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
  trainable = LORA if cfg.lora_rank else nnx.Param
  graphdef, params, rest = nnx.split(model, trainable, ...)
  tx, schedule = make_optimizer(cfg), make_schedule(cfg)
  opt_state = jax.jit(tx.init)(params)  # jitted: same (non-weak) types as the step's outputs
  step_fn = make_train_step(graphdef, tx, cfg.loss_chunk_tokens)
  stream = batches(examples, cfg.batch_size, cfg.bucket_lengths(), pad_id, cfg.seed)
  bar = Progress(cfg.steps, "sft", enabled=cfg.verbose, plain=False)  # a live bar on a terminal
  log = bar.print if cfg.verbose else (lambda *a, **k: None)
  if skipped:
    log(f"[sft] skipped rows: {skipped}", flush=True)
  losses: list[float] = []
  t_start = t_log = time.time()
  tokens_since = 0
  pending = []
  for step in range(1, cfg.steps + 1):
    batch = next(stream)
    tokens_since += int(batch["mask_BxT"].sum())
    params, opt_state, loss = step_fn(params, opt_state, rest, batch)
    pending.append(loss)
    bar.update()
    if step % cfg.log_every == 0 or step == cfg.steps or step == 1:
      values = [float(x) for x in jax.device_get(pending)]
      losses += values
      pending = []
      now = time.time()
      rate = tokens_since / max(now - t_log, 1e-9)
      log(f"[sft] step {step}/{cfg.steps} loss {np.mean(values):.4f} "
          f"lr {float(schedule(step - 1)):.2e} tok/s {rate:.0f} "
          f"elapsed {now - t_start:.1f}s eta {bar.eta_str()}", flush=True)
      bar.update({"loss": float(np.mean(values)), "tok/s": rate}, n=0)
      t_log, tokens_since = now, 0
  bar.close()
  nnx.update(model, params)
  seconds = time.time() - t_start
  return SFTResult(model=model, path=None, losses=losses, seconds=seconds, skipped=skipped)


def sft(cfg: SFTConfig) -> SFTResult:
  """Loads `cfg.model`, fine-tunes it on `cfg.data`, saves to `cfg.out` (tokenizer copied)."""
  tokenizer = load_tokenizer(cfg.model)
  lines = collections.Counter()
  rows = read_rows(cfg.data, lines)
  lora = LoraConfig(rank=cfg.lora_rank, alpha=cfg.lora_alpha) if cfg.lora_rank else None
  model = from_pretrained(cfg.model, lora=lora, seed=cfg.seed)
  result = train(model, tokenizer, rows, cfg, skipped_lines=lines)
  if cfg.out is not None:
    result.path = save_pretrained(result.model, cfg.out, tokenizer_dir=cfg.model)
    if cfg.verbose:
      print(f"[sft] saved {result.path}", flush=True)
  return result


def check_paths(cfg: SFTConfig) -> None:
  """Inputs exist; the output is a directory of its own, never the input model or data."""
  model, data, out = Path(cfg.model), Path(cfg.data), Path(cfg.out)
  if not model.exists():
    raise MissingFileError(f"--model: {model} does not exist")
  if not model.is_dir():
    raise UserError(f"--model: {model} is not a directory")
  if not (model / "config.json").is_file():
    raise UserError(f"--model: {model} has no config.json (not an HF model directory)")
  if not data.is_file():
    raise MissingFileError(f"--data: {data} does not exist")
  if out.exists() and not out.is_dir():
    raise UserError(f"--out: {out} exists and is not a directory")
  if out.resolve() == model.resolve():
    raise UserError(f"--out: {out} is the input model (--model); write the result elsewhere")
  if out.resolve() in data.resolve().parents:
    raise UserError(f"--out: {out} holds the training data (--data); write the result elsewhere")
