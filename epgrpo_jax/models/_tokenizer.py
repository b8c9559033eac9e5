"""Tokenizer loading, prompt rendering and stop tokens for local HF directories.

Nothing here downloads: the tokenizer is read from a local directory only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Sequence

from epgrpo_jax.io.errors import MissingFileError, UserError
from epgrpo_jax.models._config import ModelConfig

# Used when the tokenizer has no chat template and no template is configured.
PLAIN_TEMPLATE = "Question: {problem}\nAnswer:"
# Tokens that end a turn or a document in the Qwen family (used where the vocabulary has them).
_EOS_TOKENS = ("<|im_end|>", "<|endoftext|>")


def load_tokenizer(directory: str | Path):
  """`transformers.AutoTokenizer` from a local directory (never from the hub)."""
  # transformers warns at import that PyTorch is absent: noise for a JAX user. The user's own
  # TRANSFORMERS_VERBOSITY wins.
  os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
  from transformers import AutoTokenizer  # 1.2 s to import; after the verbosity is set

  directory = Path(directory)
  if not directory.is_dir():
    raise MissingFileError(f"{directory}: tokenizer directory not found")
  config = directory / "tokenizer_config.json"
  if not config.exists():
    raise MissingFileError(f"{config}: missing (needed to load the tokenizer)")
  vocab = directory / "tokenizer.json"
  if not vocab.exists() and not ((directory / "vocab.json").exists()
                                 and (directory / "merges.txt").exists()):
    raise MissingFileError(f"{vocab}: missing (and no vocab.json + merges.txt either)")
  try:
    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
  except Exception as e:  # transformers raises many kinds; keep the message on one line
    msg = " ".join(str(e).split())
    raise UserError(f"{directory}: cannot load the tokenizer "
                     f"({type(e).__name__}: {msg})") from None


def render_prompt(tokenizer, problem: str, *, template: str | None = None,
                  system: str | None = None) -> str:
  """The prompt text for one problem.

  Without `template`, the tokenizer's chat template (if it has one) renders a
  user turn (after an optional `system` turn; else the template's default
  system prompt) followed by the assistant header. Otherwise `template` (default
  `PLAIN_TEMPLATE`) has `{problem}` replaced by the problem, and `system`, if
  given, is put in front with a blank line.
  """
  if template is None and getattr(tokenizer, "chat_template", None):
    messages = [{"role": "system", "content": system}] if system is not None else []
    messages.append({"role": "user", "content": problem})
    try:
      return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # jinja2 raises several types for a broken template
      where = Path(getattr(tokenizer, "name_or_path", "") or ".") / "tokenizer_config.json"
      raise UserError(f"{where}: the chat template cannot render a prompt "
                      f"({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None
  template = PLAIN_TEMPLATE if template is None else template
  if "{problem}" not in template:
    raise UserError(f"prompt template: must contain '{{problem}}', got {template!r}")
  text = template.replace("{problem}", problem)  # not str.format: LaTeX braces stay literal
  return text if system is None else f"{system}\n\n{text}"


def _token_id(tokenizer, token: str) -> int | None:
  """The id of `token` if it is a whole token of the vocabulary, else None."""
  i = tokenizer.convert_tokens_to_ids(token)
  unk = getattr(tokenizer, "unk_token_id", None)
  if i is None or (unk is not None and i == unk and token != tokenizer.unk_token):
    return None
  return int(i)


def _ids(value: Any) -> list[int]:
  if value is None:
    return []
  if isinstance(value, int):
    return [value]
  return [int(v) for v in value]


def stop_token_ids(tokenizer, model_cfg: ModelConfig | None = None, *,
                   model_dir: str | Path | None = None) -> tuple[int, ...]:
  """Sorted ids that end a completion.

  The union of the tokenizer's `eos_token`, `<|im_end|>` and `<|endoftext|>`
  (where the vocabulary has them), the model config's `eos_token_id`, and the
  `eos_token_id` of `generation_config.json` in `model_dir` (default: the
  directory the tokenizer was loaded from).
  """
  ids: set[int] = set(_ids(getattr(tokenizer, "eos_token_id", None)))
  for token in _EOS_TOKENS:
    i = _token_id(tokenizer, token)
    if i is not None:
      ids.add(i)
  if model_cfg is not None:
    ids.update(model_cfg.eos_ids)
  model_dir = model_dir if model_dir is not None else getattr(tokenizer, "name_or_path", None)
  if model_dir:
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
      try:
        ids.update(_ids(json.loads(gen.read_text()).get("eos_token_id")))
      except (json.JSONDecodeError, TypeError, ValueError) as e:
        raise UserError(f"{gen}: invalid eos_token_id ({e})") from None
  return tuple(sorted(ids))


def encode_prompts(tokenizer, texts: Sequence[str] | Iterable[str]) -> list[list[int]]:
  """Token ids of each prompt text, with at most one BOS.

  The texts are encoded without special tokens; a BOS is prepended only where
  the tokenizer would add one and the text (e.g. a rendered chat template) does
  not already start with it. Qwen2.5 adds none.
  """
  texts = list(texts)
  if not texts:
    return []
  ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
  bos = getattr(tokenizer, "bos_token_id", None)
  if bos is None:
    return [list(map(int, x)) for x in ids]
  with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
  adds_bos = len(with_special) > 0 and with_special[0] == bos
  return [([bos] if adds_bos and (not x or x[0] != bos) else []) + list(map(int, x)) for x in ids]


def check_vocab(tokenizer, cfg: ModelConfig, model_dir: str | Path) -> None:
  """Raises unless every token id the tokenizer can produce has a row in the model's embedding
  (an id past the table would read garbage: NaN losses, never an error)."""
  if len(tokenizer) > cfg.vocab_size:
    raise UserError(f"{Path(model_dir) / 'tokenizer.json'}: {len(tokenizer)} tokens, but the "
                    f"model's vocab_size is {cfg.vocab_size} (config.json); tokenizer and model "
                    f"do not belong together")
