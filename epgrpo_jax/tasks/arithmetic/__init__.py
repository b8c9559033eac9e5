"""The embedded default task: multi-step integer arithmetic with a verifiable answer.

Everything the offline default needs is built here, reproducibly from a seed,
and cached under a data directory:

* `problems`: problems such as ``Compute 7*5-3*2.`` in six difficulty levels
  (`LEVELS`), each with a step-by-step solution ending in the boxed answer; a
  train split balanced by level and a disjoint held-out split (JSONL rows:
  problem, answer, level, solution, expression);
* `tokenizer`: a byte-level BPE tokenizer trained on the task text with Qwen2's
  pre-tokenizer (every digit is its own token), saved as a Hugging Face
  tokenizer with a ChatML chat template;
* `assets`: the cached build (splits, tokenizer and a randomly initialised tiny
  Qwen2 model, saved as a Hugging Face directory);
* `accuracy`: `evaluate_accuracy` samples answers and checks the last ``\\boxed{}`` exactly;
* `warmstart`: `warm_start` runs the supervised phase (`epgrpo_jax.supervised.sft`) once and
  caches it.
"""

from epgrpo_jax.tasks.arithmetic.accuracy import evaluate_accuracy, generate
from epgrpo_jax.tasks.arithmetic.assets import Assets, atomic_build, build_assets, tiny_model_config
from epgrpo_jax.tasks.arithmetic.problems import (LEVELS, VERSION, Level, generate_splits, is_correct,
                                                  make_problem, problem_text, solution_text, solve)
from epgrpo_jax.tasks.arithmetic.tokenizer import (CHAT_TEMPLATE, IM_END, IM_START, PAD, PROMPT_TEMPLATE,
                                                   QWEN2_PRETOKENIZE_REGEX, SPECIAL_TOKENS, build_tokenizer,
                                                   chat_prompt, save_tokenizer)
from epgrpo_jax.tasks.arithmetic.warmstart import (WARM_START, WARM_START_SLIP, sft_config, slipped_rows,
                                                   warm_start)
