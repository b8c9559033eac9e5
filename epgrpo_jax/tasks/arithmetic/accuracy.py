"""Sampling completions of the task's prompts and their exact-answer accuracy."""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np

from epgrpo_jax.rewards import extract_boxed
from epgrpo_jax.rollout.sampling import Sampler, SamplingConfig
from epgrpo_jax.tasks.arithmetic.problems import is_correct


def generate(model, tokenizer, prompts: Sequence[str], *, num_samples: int = 1,
             max_new_tokens: int = 64, temperature: float = 1.0, key=None,
             prompts_per_call: int = 128) -> list[list[str]]:
  """`num_samples` completions of each rendered prompt (temperature 0: greedy).

  Uses `epgrpo_jax.rollout.sampling.Sampler` (plain temperature sampling, no top-k or
  top-p), `prompts_per_call` prompts at a time (the last call padded with
  repeats, so each shape compiles once). Stop tokens and padding are stripped.
  """
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
