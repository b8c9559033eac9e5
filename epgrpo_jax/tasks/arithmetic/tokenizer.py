"""The task's chat format and its byte-level BPE tokenizer (Qwen2's pre-tokenizer: every digit is
its own token), saved as a Hugging Face tokenizer with a ChatML chat template."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, IM_START, IM_END)
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
PROMPT_TEMPLATE = "{problem}"  # the user message: the bare problem


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
