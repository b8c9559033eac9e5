"""The project's error types, and which exit code each gets from a command.

`UserError`: bad input the user can fix (a config value, a file, a path, a flag). Commands
print it as one line naming the field or file and exit 2. `RunError`: a run that stops for a
documented reason (for instance repeated non-finite updates); one line, exit 1. Anything else
is a bug in the project or a library: the command lets it propagate with its traceback (exit 1).
"""

from __future__ import annotations


class UserError(ValueError):
  """Bad input, named in the message (`train.steps: must be > 0, got 0`)."""


class MissingFileError(UserError, FileNotFoundError):
  """An input file or directory the user named does not exist."""


class RunError(RuntimeError):
  """A run that stops for a documented reason; its message says what to do next."""
