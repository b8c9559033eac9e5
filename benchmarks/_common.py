"""Shared pieces of the step, overhead and scaling benchmarks.

A random Qwen2 saved as an HF directory (our `save_pretrained`) with a tiny
word-level tokenizer, a JSONL of random prompts, a cheap reward, a Trainer
config for our side, a compilation counter and the machine line every
benchmark prints.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import resource
import statistics
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


# -- the machine ---------------------------------------------------------------------------


def usable_cores() -> int:
  """The CPUs this process may run on."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:
    return os.cpu_count() or 1


def cpu_seconds() -> float:
  """User and system CPU time of this process so far, over all its threads."""
  usage = resource.getrusage(resource.RUSAGE_SELF)
  return usage.ru_utime + usage.ru_stime


def machine_line() -> str:
  """CPUs, load average, thread settings: printed with every result."""
  load = os.getloadavg()
  cores = usable_cores()
  return (f"{platform.machine()} {cores} CPUs usable, load average {load[0]:.2f} {load[1]:.2f} "
          f"{load[2]:.2f}; OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}")


def load1() -> float:
  return os.getloadavg()[0]


def median(xs: Sequence[float]) -> float:
  return statistics.median(xs) if xs else float("nan")


def peak_bytes(m) -> int:
  """A compiled program's footprint from its `memory_analysis()`: arguments + temporaries +
  outputs - aliased (donated) bytes."""
  return (m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes
          - m.alias_size_in_bytes)


def device_peak_bytes() -> int | None:
  """The first device's peak bytes in use so far (`memory_stats()`; None where the backend,
  e.g. CPU, keeps no statistics)."""
  import jax
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use")


class CompileCounter:
  """Counts XLA backend compilations (jax.monitoring) while installed."""

  def __init__(self):
    self.count = 0
    self.seconds = 0.0
    self._lock = threading.Lock()

  def _listener(self, event: str, duration: float, **_):
    if event == COMPILE_EVENT:
      with self._lock:
        self.count += 1
        self.seconds += duration

  def __enter__(self) -> "CompileCounter":
    import jax
    jax.monitoring.register_event_duration_secs_listener(self._listener)
    return self

  def __exit__(self, *exc) -> None:
    import jax
    jax.monitoring.unregister_event_duration_listener(self._listener)


# -- model, tokenizer, prompts --------------------------------------------------------------


def _byte_chars() -> list[str]:
  """GPT-2's byte -> printable character table (the byte-level BPE alphabet), in byte order."""
  keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
  table, extra = {}, 0
  for b in range(256):
    if b in keep:
      table[b] = chr(b)
    else:
      table[b] = chr(256 + extra)
      extra += 1
  return [table[b] for b in range(256)]


LETTERS = "abcdefghijklmnopqrstuvwxyz"
SPECIALS = (BOS, EOS, PAD)


def vocabulary(vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
  """A byte-level BPE vocabulary of exactly `vocab_size` tokens and its merges.

  Ids 0-2 are <s>, </s> (EOS), <pad>; then the 256 bytes; then merged words:
  " a".." z", " aa".." zz" (so every space-led one- or two-letter word is one
  token), then " aaa", ... until the vocabulary is full.
  """
  space = _byte_chars()[ord(" ")]  # "Ġ"
  vocab = {t: i for i, t in enumerate(SPECIALS)}
  for c in _byte_chars():
    vocab[c] = len(vocab)
  merges: list[tuple[str, str]] = []

  def add(left: str, right: str) -> bool:
    if len(vocab) >= vocab_size:
      return False
    merges.append((left, right))
    vocab[left + right] = len(vocab)
    return True

  words = [space + a for a in LETTERS]
  for w in words:
    add(space, w[1:])
  longer = words
  while len(vocab) < vocab_size:
    nxt = []
    for w in longer:
      for b in LETTERS:
        if not add(w, b):
          break
        nxt.append(w + b)
    longer = nxt
  if len(vocab) < vocab_size:
    raise ValueError(f"vocab_size {vocab_size}: too small for the byte alphabet")
  return vocab, merges


def build_tokenizer(directory: str | Path, vocab_size: int):
  """A Qwen2-style byte-level BPE tokenizer of exactly `vocab_size` tokens, saved to `directory`.

  transformers loads a `qwen2` directory's tokenizer as `Qwen2Tokenizer`
  (byte-level BPE with Qwen's split pattern) whatever the file says, so this
  builds one: EOS is </s> (id 1), pad <pad> (id 2), no token is added when
  encoding, and each space-led two-letter word is one token. It carries a plain
  chat template (the benchmarks use plain prompts).
  """
  from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

  vocab, merges = vocabulary(vocab_size)
  tok = Qwen2Tokenizer(vocab=vocab, merges=merges, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                       unk_token=None)
  tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                       "{% if add_generation_prompt %}assistant:{% endif %}")
  if len(tok) != vocab_size:
    raise AssertionError(f"tokenizer has {len(tok)} tokens, wanted {vocab_size}")
  tok.save_pretrained(str(directory))
  return tok


def build_model_dir(directory: str | Path, preset: str = "bench-tiny", *, dtype: str = "float32",
                    seed: int = 0) -> Path:
  """A random `preset` Qwen2 (BOS 0, EOS 1) saved with our `save_pretrained`, plus the tokenizer."""
  import jax.numpy as jnp
  from flax import nnx

  from epgrpo_jax.models import Qwen2, preset as model_preset, save_pretrained

  directory = Path(directory)
  cfg = model_preset(preset, bos_token_id=0, eos_token_id=1, param_dtype=dtype, dtype=dtype)
  if cfg.vocab_size > 4096:  # big presets: random weights without running an initialiser per leaf
    model = nnx.eval_shape(lambda: Qwen2(cfg, rngs=nnx.Rngs(seed)))
    _fill_random(model, seed, jnp.dtype(dtype))
  else:
    model = Qwen2(cfg, rngs=nnx.Rngs(seed))
  save_pretrained(model, directory, dtype=dtype)
  build_tokenizer(directory, cfg.vocab_size)
  return directory


def _fill_random(model, seed: int, dtype) -> None:
  import jax
  import jax.numpy as jnp
  from flax import nnx

  key = jax.random.key(seed)
  for i, (path, var) in enumerate(nnx.to_flat_state(nnx.state(model, nnx.Param))):
    name = ".".join(map(str, path))
    if name.endswith("norm.weight"):
      var.set_value(jnp.ones(var.shape, dtype))
    elif name.endswith("bias"):
      var.set_value(jnp.zeros(var.shape, dtype))
    else:
      var.set_value((0.02 * jax.random.normal(jax.random.fold_in(key, i), var.shape)).astype(dtype))


def prompt_texts(n: int, prompt_len: int, seed: int = 0) -> list[str]:
  """`n` prompts of exactly `prompt_len` tokens: a letter, then space-led two-letter words."""
  import numpy as np

  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    letters = rng.integers(0, 26, (prompt_len, 2))
    out.append(LETTERS[letters[0, 0]] + "".join(f" {LETTERS[a]}{LETTERS[b]}" for a, b in letters[1:]))
  return out


def write_prompts(path: str | Path, texts: Sequence[str]) -> Path:
  """A training JSONL: problem = the text, answer = "0" (unused by the reward below)."""
  path = Path(path)
  path.write_text("".join(json.dumps({"problem": t, "answer": "0"}) + "\n" for t in texts))
  return path


def length_parity(completions: list[str], answers: list[str]) -> list[float]:
  """The benchmark reward (ours): 1.0 when the completion has an even number of characters."""
  return [float(len(c) % 2 == 0) for c in completions]


def trl_length_parity(prompts, completions, **kwargs) -> list[float]:
  """The same reward with TRL's reward-function signature."""
  return length_parity(list(completions), [])


# -- our trainer ------------------------------------------------------------------------------


@dataclasses.dataclass
class Shape:
  prompts: int = 8  # P
  samples: int = 8  # G
  prompt_len: int = 32
  new_tokens: int = 128
  lora_rank: int = 32
  lora_alpha: float = 64.0


def batch_shape_args(ap, *, prompts: int, samples: int, new_tokens: int, max_prompt_tokens: int,
                     prompts_help: str = "P prompts") -> None:
  """The batch-shape flags the rollout-shaped benchmarks share, with each one's defaults."""
  ap.add_argument("--prompts", type=int, default=prompts, help=prompts_help)
  ap.add_argument("--samples", type=int, default=samples, help="G completions per prompt")
  ap.add_argument("--new-tokens", type=int, default=new_tokens, help="sampling.max_new_tokens")
  ap.add_argument("--max-prompt-tokens", type=int, default=max_prompt_tokens,
                  help="data.max_prompt_tokens")


def dtype_overrides(dtype: str) -> list[str]:
  """The model's weights and compute in `dtype` (LoRA weights stay float32)."""
  return [f"model.dtype={dtype}", f"model.param_dtype={dtype}"]


def trainer_overrides(model_dir: Path, train_file: Path, out_dir: Path, shape: Shape,
                      *extra: str) -> list[str]:
  """Dotted overrides of a TrainConfig for one benchmark step of `shape` (EP-GRPO by default)."""
  return [
      f"model.path={model_dir}", f"data.train_files=[{train_file}]",
      "data.prompt_template='{problem}'", "data.use_chat_template=false",
      f"data.max_prompt_tokens={max(shape.prompt_len, 1)}",
      f"train.prompts_per_step={shape.prompts}", f"train.num_generations={shape.samples}",
      "train.steps=1000", f"train.output_dir={out_dir}",
      f"sampling.max_new_tokens={shape.new_tokens}", "sampling.ignore_eos=true",
      "sampling.temperature=1.0", "sampling.top_p=0.95", "sampling.top_k=0",
      f"lora.rank={shape.lora_rank}", f"lora.alpha={shape.lora_alpha}",
      "loss.beta=0.001", "optim.learning_rate=1e-5", "optim.warmup_ratio=0.0",
      "reward.function=_common:length_parity",
      "logging.progress=false", "logging.tensorboard=false", "logging.samples_every=0",
      "eval.before=false", "eval.after=false", *extra]


def make_trainer(model_dir: Path, train_file: Path, out_dir: Path, shape: Shape, *extra: str):
  from epgrpo_jax.training.config import TrainConfig
  from epgrpo_jax.training.trainer import Trainer

  cfg = TrainConfig().override(*trainer_overrides(model_dir, train_file, out_dir, shape, *extra))
  return Trainer(cfg)


def time_call(fn: Callable[[], object]) -> float:
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


def alternating_medians(calls: dict[str, Callable[[], object]], rounds: int, *,
                        reverse_odd_rounds: bool = False) -> dict[str, float]:
  """Median seconds of each call over `rounds` rounds in which every call runs once, after one
  warm-up call each (compilation, caches), so that all of them see the same machine load.
  `reverse_odd_rounds` runs odd rounds in reverse order (ABBA)."""
  for fn in calls.values():
    fn()
  times: dict[str, list[float]] = {name: [] for name in calls}
  for i in range(rounds):
    names = list(calls)[::-1] if reverse_odd_rounds and i % 2 else list(calls)
    for name in names:
      times[name].append(time_call(calls[name]))
  return {name: median(v) for name, v in times.items()}


# -- FLOPs ----------------------------------------------------------------------------------


def step_flops(cfg, shape: "Shape", *, lora: bool = True, fused: bool = False) -> dict[str, float]:
  """Model FLOPs of one RL step of `shape` (every prompt `prompt_len` tokens, every completion
  `new_tokens`) by the program they run in: sampling, scoring (policy + reference forwards;
  0 with the fused update, `train.fused_update`), update (forward + backward, plus the
  reference forward when fused), total; and "update_attention", "update_head" (the update's
  shares). The one FLOP model: `epgrpo_jax.models.flops`."""
  from epgrpo_jax.models import flops

  rows = shape.prompts * shape.samples
  by_phase = flops.step(cfg, [shape.prompt_len] * shape.prompts, [shape.new_tokens] * rows,
                        shape.samples, full_finetune=not lora, fused=fused)
  out = {name: f.total for name, f in by_phase.items()}
  out.update(update_attention=by_phase["update"].attention, update_head=by_phase["update"].head)
  return out


def sampling_flops_per_token(cfg, prompts: int, samples: int, prompt_len: int,
                             new_tokens: int) -> float:
  """The sampler's model FLOPs per completion token (prefill included; `models.flops`)."""
  from epgrpo_jax.models import flops

  done = flops.sampling(cfg, [prompt_len] * prompts, [new_tokens] * (prompts * samples), samples)
  return done.total / (prompts * samples * new_tokens)


# -- a step timed phase by phase ----------------------------------------------------------------


PHASES = ("sample", "reward", "scoring", "reference", "advantage", "update")


class PhasedStep:
  """`Trainer.step` (single process), with the device synchronised after each phase.

  Same programs and data as the trainer: the sampler, the fused scoring +
  reference program (or, with `train.reuse_sampler_logprobs`, the sampler's
  log-probs and the reference-only program), the advantage program and the
  update. The reference pass's share is measured by the trainer's
  reference-only program, run once per step outside the step time, and
  subtracted from the scoring time. With the trainer's fused update
  (`train.fused_update`), scoring, reference, advantage and update are one
  program, timed as "update" (the other phases 0).
  """

  def __init__(self, trainer):
    if trainer.cfg.train.mini_batches != 1:
      raise ValueError("PhasedStep: train.mini_batches must be 1")
    self.trainer = trainer
    self.last_batch = None

  def __call__(self, state):
    """(new state, {phase: seconds, "step": total, "reference_only": seconds})."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from epgrpo_jax.parallel import distributed
    from epgrpo_jax.rollout.sampling import bucket
    from epgrpo_jax.training.batches import CompletionBatch, UpdateBatch
    from epgrpo_jax.training.trainer import RunState

    tr = self.trainer
    cfg, t = tr.cfg, tr.cfg.train
    P, G = t.prompts_per_step, t.num_generations
    times: dict[str, float] = {}
    start = tick = time.perf_counter()

    def lap(name: str, *wait) -> None:
      nonlocal tick
      jax.block_until_ready(wait)
      now = time.perf_counter()
      times[name] = now - tick
      tick = now

    examples = [tr.train_examples[i] for i in next(tr.data_iter)]
    key, sample_key = jax.random.split(state.key)
    out = tr.sampler.sample(tr.params(state.trainable), [e.prompt_ids for e in examples],
                            num_samples=G, key=sample_key)
    host = distributed.to_host(out)
    tokens_BxN, mask_BxN = host.tokens.reshape(P * G, -1), host.mask.reshape(P * G, -1)
    n = min(bucket(max(int(mask_BxN.sum(1).max()), 1), cfg.sampling.length_buckets),
            tokens_BxN.shape[1])
    tokens_BxN, mask_BxN = tokens_BxN[:, :n], mask_BxN[:, :n]
    rollout = distributed.place(tr.packed(CompletionBatch(
        prompt_ids=np.repeat(host.prompt_ids, G, axis=0),
        prompt_mask=np.repeat(host.prompt_mask, G, axis=0),
        completion=tokens_BxN, completion_mask=mask_BxN)), tr.shardings.rollout())
    lap("sample", rollout)

    texts = tr.decode(tokens_BxN, mask_BxN)
    rewards = tr.scorer.score(texts, [tr.gold(e) for e in examples for _ in range(G)])
    rewards_PxG = np.asarray(rewards.reward, np.float32).reshape(P, G)
    lap("reward")

    if tr.fused:  # one program: scoring, reference, advantage, update
      trainable, opt_state, m, scored = tr.fns.fused_update(
          state.trainable, state.opt_state, tr.policy.frozen, tr.policy.reference, rollout,
          rewards_PxG)
      lap("update", trainable, opt_state, m)
      times.update(scoring=0.0, reference=0.0, advantage=0.0, step=time.perf_counter() - start)
      self.last_batch = UpdateBatch(rollout=rollout, logp_old=scored.logp_old,
                                    logp_ref=scored.logp_ref,
                                    advantage=scored.advantage.reshape(P * G, -1))
      return RunState(trainable=trainable, opt_state=opt_state, key=key, step=state.step + 1), times
    if t.reuse_sampler_logprobs:  # the sampler's log-probs and entropies; the reference pass only
      logp_old, entropy = (jnp.asarray(x.reshape(P * G, -1)[:, :n]) for x in (host.logp, host.entropy))
      logp_ref = tr.fns.reference(state.trainable, tr.policy.frozen, tr.policy.reference, rollout)
    else:
      logp_old, entropy, logp_ref = tr.fns.score(state.trainable, tr.policy.frozen,
                                                 tr.policy.reference, rollout)
    lap("scoring", logp_old, entropy, logp_ref)

    shape = (P, G, -1)
    adv, _, adv_metrics = tr.advantage_fn(
        rewards_PxG, entropy.reshape(shape), logp_old.reshape(shape), logp_ref.reshape(shape),
        rollout.completion_mask.reshape(shape), cfg=cfg.advantage)
    lap("advantage", adv, adv_metrics)

    batch = UpdateBatch(rollout=rollout, logp_old=logp_old, logp_ref=logp_ref,
                        advantage=adv.reshape(P * G, -1))
    trainable, opt_state = state.trainable, state.opt_state
    self.last_batch = batch
    for _ in range(t.num_iterations):
      trainable, opt_state, m = tr.fns.update(trainable, opt_state, tr.policy.frozen, batch)
    lap("update", trainable, opt_state, m)
    times["step"] = time.perf_counter() - start

    ref_start = time.perf_counter()  # outside the step: the reference pass alone
    jax.block_until_ready(tr.fns.reference(trainable, tr.policy.frozen, tr.policy.reference, rollout))
    times["reference"] = min(time.perf_counter() - ref_start, times["scoring"])
    times["scoring"] -= times["reference"]
    new_state = RunState(trainable=trainable, opt_state=opt_state, key=key, step=state.step + 1)
    return new_state, times
