"""User-given paths: `~` expands in one way for every config key and command-line flag.

A config field typed `UserPath` (or `tuple[UserPath, ...]`) has `~` expanded where the config is
typed (`configlib.coerce`); a command's path flags take `type=path_flag`. Shells expand `~` only at
the start of a word, so `train.output_dir=~/runs/x` and `--out=~/x` reach the program unexpanded.
"""

from __future__ import annotations

import argparse
import os
import typing

from epgrpo_jax.io.errors import UserError

PATH_MARK = "user path"
UserPath = typing.Annotated[str, PATH_MARK]  # a config field that names a file or a directory


def expand_home(text: str) -> str:
  """`~` or `~user` at the start of `text` becomes that home directory; other text is unchanged.
  A `~user` with no home directory is an error (it would otherwise become a folder named `~user`)."""
  if not text.startswith("~"):
    return text
  out = os.path.expanduser(text)
  if out.startswith("~"):
    raise UserError(f"{text}: no home directory for {text.split('/')[0]!r}")
  return out


def is_user_path(tp) -> bool:
  """Whether the annotation `tp` is `UserPath`."""
  return typing.get_origin(tp) is typing.Annotated and PATH_MARK in tp.__metadata__


def path_flag(text: str) -> str:
  """The argparse `type=` of a flag that names a file or a directory: `~` expanded."""
  try:
    return expand_home(text)
  except UserError as e:
    raise argparse.ArgumentTypeError(str(e)) from None
