"""Orbax checkpoints of a run: trainable parameters, optimizer state, data iterator, PRNG, step.

Orbax writes each step into a temporary directory (`<step>.orbax-checkpoint-tmp-*`)
and renames it to `<step>` when every item is written, so a killed save never
leaves a step that `latest_step` returns; the next manager on the directory
deletes such leftovers. The manager keeps the newest `keep` steps. Saves and
restores are collective across processes.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers

log = logging.getLogger("epgrpo_jax.io.checkpointing")


class Checkpointer:
  """Saves and restores `(state pytree, data iterator, json metadata)` per step."""

  def __init__(self, directory: str | Path, *, keep: int = 3, async_save: bool = True):
    self.directory = Path(directory).absolute()
    options = ocp.CheckpointManagerOptions(
        preservation_policy=checkpoint_managers.LatestN(keep),
        enable_async_checkpointing=async_save,
        cleanup_tmp_directories=True,
        create=True,
    )
    self.manager = ocp.CheckpointManager(self.directory, options=options)
    self._last_saved: int | None = None

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state: Any, data_iterator: grain.DatasetIterator | None,
           meta: dict[str, Any], *, force: bool = True, inflight: dict | None = None) -> None:
    """Starts saving step `step` (asynchronously); a second save of the step just saved
    (e.g. the periodic save, then the one on SIGTERM) does nothing. `inflight`: host arrays of
    the rollouts drawn ahead (`training.staleness`), saved as the item "inflight"."""
    if step == self._last_saved:
      return
    items = {"state": ocp.args.StandardSave(state), "meta": ocp.args.JsonSave(meta)}
    if inflight:
      items["inflight"] = ocp.args.StandardSave(inflight)
    if data_iterator is not None:
      items["data"] = grain.checkpoint.CheckpointSave(data_iterator)
    self.manager.save(step, args=ocp.args.Composite(**items), force=force)
    self._last_saved = step

  def restore(self, step: int, abstract_state: Any, data_iterator: grain.DatasetIterator | None):
    """Restores into `abstract_state`'s structure/shardings and `data_iterator` (in place)."""
    check_shapes(self.directory / str(step), abstract_state)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
    items = {"state": ocp.args.StandardRestore(abstract), "meta": ocp.args.JsonRestore()}
    if data_iterator is not None:
      items["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
    restored = self.manager.restore(step, args=ocp.args.Composite(**items))
    return restored["state"], restored["meta"]

  def restore_inflight(self, step: int) -> dict:
    """The "inflight" item of step `step` as host arrays ({} when the step has none)."""
    if not (self.directory / str(step) / "inflight").is_dir():
      return {}
    restored = self.manager.restore(step, args=ocp.args.Composite(inflight=ocp.args.StandardRestore()))
    return restored["inflight"]

  def restore_trainable(self, step: int, abstract_trainable: Any) -> Any:
    """Only the trained weights (the "trainable" entry of the state), as `restore_trainable`.

    Reads through a separate read-only manager: this one has "state" registered
    for `StandardRestore` of the whole tree, which cannot restore a part of it.
    """
    self.manager.wait_until_finished()
    return restore_trainable(self.directory, step, abstract_trainable)

  def set_aside(self, steps: list[int], tag: str) -> None:
    """Renames the step directories `steps` to `<step>.<tag>` (kept, no longer steps)."""
    self.manager.wait_until_finished()
    if jax.process_index() == 0:
      for step in steps:
        src = self.directory / str(step)
        dst = self.directory / f"{step}.{tag}"
        n = 1
        while dst.exists():
          dst, n = self.directory / f"{step}.{tag}{n}", n + 1
        os.replace(src, dst)
    self.manager.reload()

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def committed_steps(directory: str | Path) -> list[int]:
  """The steps with a complete checkpoint under `directory` (sorted; [] if none or no
  directory). Unfinished saves (Orbax's temporary directories) are not steps."""
  directory = Path(directory)
  if not directory.is_dir():
    return []
  return sorted(ocp.utils.checkpoint_steps(directory))


# ----------------------------------------------------------------------------
# Reading the trained weights only (evaluation): no optimizer state, no data iterator.


@contextlib.contextmanager
def _quiet_absl():
  """Orbax's warnings about read-only options and the metadata it does not need, muted."""
  absl_log = logging.getLogger("absl")
  level = absl_log.level
  absl_log.setLevel(logging.ERROR)
  try:
    yield
  finally:
    absl_log.setLevel(level)


def _key_name(k: Any) -> str:
  for attr in ("key", "idx", "name"):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def _dotted(path: tuple[Any, ...]) -> str:
  names = [_key_name(k) for k in path]
  if names and names[-1] == "value":  # an nnx.Variable's own field
    names = names[:-1]
  return ".".join(names)


def tree_shapes(tree: Any) -> dict[str, tuple[int, ...]]:
  """Dotted path -> shape of each array (or array metadata) of `tree`."""
  return {_dotted(path): tuple(getattr(leaf, "shape", ()))
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def saved_shapes(step_dir: str | Path) -> dict[str, tuple[int, ...]]:
  """`tree_shapes` of a step's "state" item (read from the Orbax metadata, without loading
  the arrays)."""
  with _quiet_absl(), ocp.PyTreeCheckpointer() as ckptr:
    metadata = ckptr.metadata(Path(step_dir).absolute() / "state")
  return tree_shapes(getattr(metadata, "item_metadata", metadata))


def saved_trainable_shapes(step_dir: str | Path) -> dict[str, tuple[int, ...]]:
  """`saved_shapes` of the arrays under "trainable", their paths without that prefix."""
  prefix = "trainable."
  return {name[len(prefix):]: shape for name, shape in saved_shapes(step_dir).items()
          if name.startswith(prefix)}


def shape_difference(saved: dict[str, tuple[int, ...]],
                     wanted: dict[str, tuple[int, ...]]) -> str | None:
  """The first array of `wanted` (dotted path -> shape) that `saved` lacks or holds in
  another shape, or else one that only `saved` holds, in words; None when they agree."""
  for name, shape in wanted.items():
    if name not in saved:
      return f"the checkpoint has no array {name} {shape}"
    if saved[name] != shape:
      return f"{name} is saved with shape {saved[name]}, expected {shape}"
  extra = sorted(saved.keys() - wanted.keys())
  if extra:
    return (f"the checkpoint holds {len(extra)} array(s) not expected, e.g. "
            f"{extra[0]} {saved[extra[0]]}")
  return None


def check_shapes(step_dir: str | Path, abstract_state: Any) -> None:
  """Raises ValueError with the `shape_difference` of a step's "state" item and
  `abstract_state`. Checked before reading: Orbax's read of a mismatched array fails
  part-way and leaves its other reads pending."""
  difference = shape_difference(saved_shapes(step_dir), tree_shapes(abstract_state))
  if difference:
    raise ValueError(difference)


def restore_trainable(directory: str | Path, step: int, abstract_trainable: Any) -> Any:
  """The "trainable" part of step `step` under `directory` (RUN_DIR/checkpoints), in
  `abstract_trainable`'s structure, dtypes and shardings. Opens the checkpoints read-only:
  a concurrent training run is left alone (no clean-up of its temporary directories)."""
  with _quiet_absl():  # read_only=True warns about the options it implies
    options = ocp.CheckpointManagerOptions(read_only=True, enable_async_checkpointing=False)
    manager = ocp.CheckpointManager(Path(directory).absolute(), options=options)
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_trainable)
  restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
  args = ocp.args.PyTreeRestore(item={"trainable": abstract},
                                restore_args={"trainable": restore_args}, partial_restore=True)
  try:
    return manager.restore(step, args=ocp.args.Composite(state=args))["state"]["trainable"]
  finally:
    manager.close()
