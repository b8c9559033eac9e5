"""The embedded default task: multi-step integer arithmetic with a verifiable answer.

Everything the offline default needs is built here, reproducibly from a seed,
and cached under a data directory:

* problems such as ``Compute 7*5-3*2.`` in six difficulty levels (`LEVELS`),
  each with a step-by-step solution, one binary operation per line, in the
  usual order, ending in the boxed answer::

      7*5=35
      3*2=6
      35-6=29
      \\boxed{29}

  a train split balanced by level and a disjoint held-out split (JSONL rows:
  problem, answer, level, solution, expression);
* a byte-level BPE tokenizer trained on the task text with Qwen2's
  pre-tokenizer (every digit is its own token), saved as a Hugging Face
  tokenizer with a ChatML chat template;
* a randomly initialised tiny Qwen2 model, saved as a Hugging Face directory.

`evaluate_accuracy` samples answers and checks the last ``\\boxed{}`` exactly;
`warm_start` runs the supervised phase (`epgrpo_jax.supervised.sft`) once and caches it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

from epgrpo_jax.io import catalog
from epgrpo_jax.rewards import extract_boxed
from epgrpo_jax.io.records import read_rows

VERSION = "arithmetic-v1"
PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, IM_START, IM_END)
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
PROMPT_TEMPLATE = "{problem}"  # the user message: the bare problem
_MAX_VALUE = 999  # every operand, intermediate result and answer lies in [0, _MAX_VALUE]


# ----------------------------------------------------------------------------- problems

@dataclasses.dataclass(frozen=True)
class Level:
  """A difficulty level: expression templates, operand ranges, and a result bound.

  In a template, an upper-case letter is an operand drawn from `big`, a
  lower-case one from `small`; each ``~`` becomes ``+`` or ``-``. Every
  intermediate result and the answer lie in ``[0, max_value]``.
  """

  templates: tuple[str, ...]
  small: tuple[int, int] = (0, 9)
  big: tuple[int, int] = (10, 99)
  max_value: int = 999
  heldout_fraction: float = 0.2  # the share of the level's problems reserved for held-out


LEVELS: dict[int, Level] = {
    1: Level(("a~b",), max_value=9, heldout_fraction=0.3),  # one step of the single-digit table
    2: Level(("a~b~c",), max_value=9),  # two steps, single digits throughout
    3: Level(("a~b~c~d",), max_value=9),  # three steps, single digits throughout
    4: Level(("a*b",), small=(2, 9), heldout_fraction=0.3),  # the times table: 2-digit results
    5: Level(("a*b~c", "a~b*c"), small=(2, 9)),  # precedence, then 2-digit +- 1-digit
    6: Level(("a*b~c*d", "(a+b)*c"), small=(2, 9)),  # 2-digit +- 2-digit, 2-digit * 1-digit
}


def _tokenize_expr(expr: str) -> list[int | str]:
  return [int(t) if t.isdigit() else t for t in re.findall(r"\d+|[-+*()]", expr)]


def _apply(a: int, op: str, b: int) -> int:
  return a + b if op == "+" else a - b if op == "-" else a * b


def solve(expr: str, slip: float = 0.0, rng: random.Random | None = None) -> tuple[list[str], int]:
  """Evaluates `expr` one binary operation at a time, in the usual order.

  Innermost parentheses first; within a group, ``*`` left to right, then
  ``+``/``-`` left to right. Returns the steps ``"a op b=c"`` and the value.
  With `slip` > 0, each result is, with that probability, replaced by a near
  miss (one digit off by one) that later steps then use: an imperfect
  demonstrator, whose final answer is then usually wrong.
  """
  toks = _tokenize_expr(expr)
  steps = []
  while len(toks) > 1:
    if ")" in toks:
      j = toks.index(")")
      i = max(k for k in range(j) if toks[k] == "(")
    else:
      i, j = -1, len(toks)
    group = toks[i + 1:j]
    if len(group) == 1:  # "(x)" -> "x"
      toks[i:j + 1] = group
      continue
    ops = [k for k, t in enumerate(group) if t == "*"] or [k for k, t in enumerate(group)
                                                         if t in ("+", "-")]
    k = ops[0]
    a, op, b = group[k - 1], group[k], group[k + 1]
    c = _apply(a, op, b)
    if slip and rng is not None and rng.random() < slip:
      c = _near_miss(c, rng)
    steps.append(f"{a}{op}{b}={c}")
    group[k - 1:k + 2] = [c]
    toks[i + 1:j] = group
  return steps, int(toks[0])


def _near_miss(c: int, rng: random.Random) -> int:
  """`c` with one digit moved up or down by one (never `c`; the sign is kept)."""
  if c < 0:
    return -_near_miss(-c, rng)
  digits = list(str(c))
  i = rng.randrange(len(digits))
  d = int(digits[i]) + rng.choice((-1, 1))
  if d < 0 or d > 9 or (d == 0 and i == 0 and len(digits) > 1):
    d = int(digits[i]) - (d - int(digits[i]))
  digits[i] = str(d)
  return int("".join(digits))


def solution_text(steps: Sequence[str], answer: int) -> str:
  """The reference completion: one step a line, then the boxed answer."""
  return "".join(s + "\n" for s in steps) + f"\\boxed{{{answer}}}"


def problem_text(expr: str) -> str:
  return f"Compute {expr}."


def _sample_expr(level: Level, rng: random.Random) -> str:
  out = []
  for ch in rng.choice(level.templates):
    if ch.isalpha():
      lo, hi = level.big if ch.isupper() else level.small
      out.append(str(rng.randint(lo, hi)))
    elif ch == "~":
      out.append(rng.choice("+-"))
    else:
      out.append(ch)
  return "".join(out)


def _valid(expr: str, max_value: int) -> bool:
  steps, value = solve(expr)
  return all(0 <= int(s.split("=")[1]) <= max_value for s in steps) and 0 <= value <= max_value


def make_problem(expr: str, level: int) -> dict[str, Any]:
  """A JSONL row: problem, answer (a string, as in math datasets), level, solution."""
  steps, value = solve(expr)
  return {"problem": problem_text(expr), "answer": str(value), "level": level,
          "solution": solution_text(steps, value), "expression": expr}


def _is_heldout(expr: str, seed: int, fraction: float) -> bool:
  h = int.from_bytes(hashlib.sha256(f"{seed}:{expr}".encode()).digest()[:8], "big")
  return h / 2**64 < fraction


def generate_splits(seed: int = 0, train_per_level: int = 1500, heldout_per_level: int = 50,
                    levels: dict[int, Level] | None = None) -> tuple[list[dict], list[dict]]:
  """Train and held-out rows, reproducible from `seed`, with disjoint expressions.

  Which split an expression may go to is fixed by a hash of (seed, expression),
  so the splits never share a problem. Each level gets (up to)
  `heldout_per_level` held-out problems and exactly `train_per_level` train
  rows: distinct problems while the level has enough of them, then its train
  problems again (level 1 has about 90), so that train is balanced by level.
  """
  levels = LEVELS if levels is None else levels
  train, heldout = [], []
  for lvl, spec in levels.items():
    rng = random.Random(f"{seed}:{VERSION}:{lvl}")
    seen: set[str] = set()
    rows_t, rows_h = [], []
    misses = 0
    while (len(rows_t) < train_per_level or len(rows_h) < heldout_per_level) and misses < 2000:
      expr = _sample_expr(spec, rng)
      if expr in seen or not _valid(expr, min(spec.max_value, _MAX_VALUE)):
        misses += 1
        continue
      misses = 0
      seen.add(expr)
      target, want = ((rows_h, heldout_per_level) if _is_heldout(expr, seed, spec.heldout_fraction)
                      else (rows_t, train_per_level))
      if len(target) < want:
        target.append(make_problem(expr, lvl))
    if not rows_t:
      raise ValueError(f"level {lvl}: no train problem could be generated")
    unique = len(rows_t)
    rows_t += [rows_t[i % unique] for i in range(train_per_level - unique)]
    train += rows_t
    heldout += rows_h
  random.Random(f"{seed}:{VERSION}:shuffle").shuffle(train)
  random.Random(f"{seed}:{VERSION}:shuffle-heldout").shuffle(heldout)
  return train, heldout


# ----------------------------------------------------------------------------- answers

def is_correct(completion: str, answer: str | int) -> bool:
  """Exact integer match of the last boxed answer."""
  boxed = extract_boxed(completion)
  if boxed is None:
    return False
  boxed = boxed.strip()
  if not re.fullmatch(r"-?\d+", boxed):
    return False
  return int(boxed) == int(answer)


# ----------------------------------------------------------------------------- tokenizer

def chat_prompt(problem: str) -> str:
  """The rendered chat prompt (what the tokenizer's chat template produces)."""
  return f"{IM_START}user\n{problem}{IM_END}\n{IM_START}assistant\n"


# Qwen2's pre-tokenizer regex: digits are split one by one (`\p{N}`), words keep a
# leading non-letter (`\boxed`), punctuation keeps a leading space and trailing newlines.
QWEN2_PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
                           r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")


def build_tokenizer(corpus: Iterable[str], vocab_size: int = 384):
  """A byte-level BPE tokenizer (`tokenizers.Tokenizer`) trained on `corpus`.

  The pipeline is exactly Qwen2's (NFC, Qwen2's split regex, byte level), since
  transformers 5 loads any `model_type: qwen2` directory with `Qwen2Tokenizer`,
  which rebuilds that pipeline around the saved vocabulary and merges: the
  raw tokenizer and `AutoTokenizer` then encode identically. Every digit is
  its own token; any text encodes (256-byte base alphabet).
  """
  from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE())
  tok.normalizer = normalizers.NFC()
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                min_frequency=2, show_progress=False)
  special = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))
  pieces = (p for text in corpus for p in special.split(text) if p)  # no merge spans a special
  tok.train_from_iterator(pieces, trainer)
  return tok


def save_tokenizer(tok, directory: str | Path) -> Path:
  """Writes tokenizer.json and a tokenizer_config.json (with the chat template).

  The class is `Qwen2Tokenizer` (what transformers 5 uses for a qwen2 model
  directory anyway); its pipeline is the one `build_tokenizer` trains with.
  """
  directory = Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  tok.save(str(directory / "tokenizer.json"))
  added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False,
                                     "rstrip": False, "single_word": False, "special": True}
           for t in SPECIAL_TOKENS}
  config = {
      "tokenizer_class": "Qwen2Tokenizer",
      "added_tokens_decoder": added,
      "additional_special_tokens": [IM_START],
      "bos_token": None,
      "eos_token": IM_END,
      "pad_token": PAD,
      "unk_token": None,
      "add_bos_token": False,
      "add_prefix_space": False,
      "clean_up_tokenization_spaces": False,
      "model_max_length": 512,
      "chat_template": CHAT_TEMPLATE,
  }
  (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
  return directory


# ----------------------------------------------------------------------------- model and assets

def tiny_model_config(vocab_size: int, *, eos_token_id: int, pad_token_id: int, **overrides):
  """The tiny Qwen2 of the embedded default (sized for 2 CPU cores)."""
  from epgrpo_jax.models import ModelConfig

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
  from flax import nnx

  from epgrpo_jax.models import Qwen2, save_pretrained

  cfg = tiny_model_config(tok.get_vocab_size(), eos_token_id=tok.token_to_id(IM_END),
                          pad_token_id=tok.token_to_id(PAD), **overrides)
  save_pretrained(Qwen2(cfg, rngs=nnx.Rngs(seed)), directory)
  gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
         "pad_token_id": tok.token_to_id(PAD)}
  (directory / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


# ----------------------------------------------------------------------------- evaluation

def generate(model, tokenizer, prompts: Sequence[str], *, num_samples: int = 1,
             max_new_tokens: int = 64, temperature: float = 1.0, key=None,
             prompts_per_call: int = 128) -> list[list[str]]:
  """`num_samples` completions of each rendered prompt (temperature 0: greedy).

  Uses `epgrpo_jax.rollout.sampling.Sampler` (plain temperature sampling, no top-k or
  top-p), `prompts_per_call` prompts at a time (the last call padded with
  repeats, so each shape compiles once). Stop tokens and padding are stripped.
  """
  import jax
  import numpy as np

  from epgrpo_jax.rollout.sampling import Sampler, SamplingConfig

  key = jax.random.key(0) if key is None else key
  eos = [tokenizer.eos_token_id] + [e for e in model.cfg.eos_ids if e != tokenizer.eos_token_id]
  pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
  sampler = Sampler(SamplingConfig(temperature=max(temperature, 0.0), greedy=temperature <= 0,
                                   max_new_tokens=max_new_tokens), eos_ids=eos, pad_id=pad)
  ids = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
  out: list[list[str]] = []
  for start in range(0, len(ids), prompts_per_call):
    chunk = ids[start:start + prompts_per_call]
    n_real = len(chunk)
    chunk = chunk + [chunk[i % n_real] for i in range(min(prompts_per_call, len(ids)) - n_real)]
    key, sub = jax.random.split(key)
    res = sampler.sample(model, chunk, num_samples, sub, max_new_tokens=max_new_tokens)
    tokens, mask = np.asarray(res.tokens), np.asarray(res.mask)
    for i in range(n_real):
      row = []
      for g in range(num_samples):
        t = [x for x, m in zip(tokens[i, g].tolist(), mask[i, g].tolist()) if m and x not in eos]
        row.append(tokenizer.decode(t, skip_special_tokens=True))
      out.append(row)
  return out


def evaluate_accuracy(model, tokenizer, problems: Sequence[dict[str, Any]], num_samples: int = 4,
                      temperature: float = 1.0, max_new_tokens: int = 64, key=None,
                      prompt_template: str = "{problem}") -> dict[str, Any]:
  """Sampled accuracy on `problems` (rows with problem, answer and optionally level).

  Prompts are rendered with the tokenizer's chat template around
  `prompt_template`. Returns `accuracy` (mean correctness over all samples),
  `format` (share of samples with a boxed answer), `by_level` {level:
  accuracy}, `per_problem` (mean correctness of each problem), `all_correct`
  and `all_wrong` (shares of problems whose samples are all right / all
  wrong: the zero-variance groups of GRPO), and `completions`.
  """
  import numpy as np

  contents = [prompt_template.replace("{problem}", r["problem"]) for r in problems]
  prompts = [tokenizer.apply_chat_template([{"role": "user", "content": c}],
                                           add_generation_prompt=True, tokenize=False)
             for c in contents]
  texts = generate(model, tokenizer, prompts, num_samples=num_samples,
                   max_new_tokens=max_new_tokens, temperature=temperature, key=key)
  correct = np.array([[is_correct(t, r["answer"]) for t in row]
                      for row, r in zip(texts, problems)], float).reshape(len(problems), num_samples)
  boxed = np.array([[extract_boxed(t) is not None for t in row] for row in texts], float)
  levels = np.array([r.get("level", 0) for r in problems])
  per_problem = correct.mean(axis=1)
  return {
      "accuracy": float(correct.mean()),
      "format": float(boxed.mean()),
      "by_level": {int(l): float(per_problem[levels == l].mean()) for l in sorted(set(levels))},
      "per_problem": per_problem.tolist(),
      "all_correct": float(np.mean(per_problem == 1.0)),
      "all_wrong": float(np.mean(per_problem == 0.0)),
      "num_samples": num_samples,
      "completions": texts,
  }


# ----------------------------------------------------------------------------- warm start

# The supervised warm start of the embedded default (`EmbeddedConfig` in
# `epgrpo_jax/training/config.py` repeats steps, batch size and rate). It stops just after
# the model learns to copy operands: at seed 0 the held-out accuracy is about 41%
# sampled at T = 1 and 55% greedy, near 80% on levels 1-2 and near 0% on level 5.
WARM_START: dict[str, Any] = dict(steps=800, batch_size=16, lr=3e-3, warmup_ratio=0.05,
                                  schedule="constant", weight_decay=0.01, log_every=100)
WARM_START_SLIP = 0.0  # share of demonstration steps with a near-miss result (0: exact)


def slipped_rows(rows: Sequence[dict[str, Any]], slip: float, seed: int) -> list[dict[str, Any]]:
  """`rows` whose solutions come from an imperfect demonstrator (see `solve`)."""
  rng = random.Random(f"{seed}:{VERSION}:slip")
  return [dict(r, solution=solution_text(*solve(r["expression"], slip, rng))) for r in rows]


def sft_config(assets: Assets, out: str | Path | None = None, **overrides):
  """The `SFTConfig` of the warm start on `assets` (train split, `WARM_START`)."""
  from epgrpo_jax.supervised.sft import SFTConfig

  kw = {**WARM_START, "seed": assets.seed, **overrides}
  return SFTConfig(model=str(assets.model_dir), data=str(assets.train_file),
                   out=None if out is None else str(out), **kw)


def warm_start(assets: Assets, *, steps: int | None = None, learning_rate: float | None = None,
               batch_size: int | None = None, seed: int | None = None, progress: bool = True,
               slip: float = WARM_START_SLIP, **overrides) -> Path:
  """The warm-started model directory: SFT on the train split, run once and cached.

  Unset arguments take `WARM_START`'s values (seed: the assets' seed); other
  `SFTConfig` fields may be overridden by name. `slip` > 0 trains on
  demonstrations with that share of near-miss step results (`slipped_rows`).
  Cached under `assets.root/sft-{hash of the settings}/` with the same atomic
  rename as `build_assets`; `sft.json` there records the loss history and time.
  """
  from epgrpo_jax.supervised.sft import sft

  if not 0.0 <= slip < 1.0:
    raise ValueError(f"slip: must be in [0, 1), got {slip}")
  named = dict(steps=steps, lr=learning_rate, batch_size=batch_size, seed=seed)
  overrides.update({k: v for k, v in named.items() if v is not None})
  cfg = sft_config(assets, verbose=progress, **overrides)
  key = {k: v for k, v in dataclasses.asdict(cfg).items()
         if k not in ("model", "data", "out", "verbose", "log_every")}
  key["slip"] = slip
  final = assets.root / f"sft-{_digest(key)}"

  def build(tmp: Path) -> None:
    run = dataclasses.replace(cfg, out=str(tmp))
    data = tmp / "sft_data.jsonl"
    if slip:
      _write_jsonl(data, slipped_rows(assets.train_rows(), slip, cfg.seed))
      run = dataclasses.replace(run, data=str(data))
    result = sft(run)
    data.unlink(missing_ok=True)
    (tmp / "sft.json").write_text(json.dumps(
        {"config": key, "seconds": round(result.seconds, 2), "losses": result.losses,
         "skipped": result.skipped}) + "\n")

  t0 = time.time()
  if atomic_build(final, build) and progress:
    print(f"[arithmetic] warm start done in {time.time() - t0:.1f}s: {final}", flush=True)
  return final
