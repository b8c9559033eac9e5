"""An export interrupted at any point leaves the earlier model directory, or the new one, whole,
and every other file of the directory as it was."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from epgrpo_jax.models import _hf_io, from_pretrained, save_pretrained
from helpers import random_model, tiny_config


class Interrupted(BaseException):
  """Stands for Ctrl-C or a kill at one point of the export."""


def digests(directory: Path) -> dict[str, str]:
  return {p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
          for p in sorted(directory.rglob("*")) if p.is_file()}


def interrupt(*_, **__):
  raise Interrupted


def interrupt_unless_ignoring_errors(path, ignore_errors=False, **kw):
  if not ignore_errors:
    raise Interrupted
  return REAL_RMTREE(path, ignore_errors=ignore_errors, **kw)


REAL_RMTREE = shutil.rmtree

# point of the interruption -> (what to patch, which model the directory must then hold)
POINTS = {
    "writing the weights": ((_hf_io, "save_file"), "old"),
    "copying the user's files": ((shutil, "copy2"), "old"),
    "the exchange": ((_hf_io, "_exchange"), "old"),
    "removing the old directory": ((shutil, "rmtree"), "new"),
}


@pytest.fixture(scope="module")
def models():
  cfg = tiny_config()
  return random_model(cfg, seed=0), random_model(cfg, seed=1)


@pytest.mark.parametrize("point", POINTS)
def test_an_interrupted_export_leaves_one_whole_model(models, tmp_path, monkeypatch, point):
  old_model, new_model = models
  directory = save_pretrained(old_model, tmp_path / "policy")
  (directory / "notes.txt").write_text("the user's own file\n")
  (directory / "eval").mkdir()
  (directory / "eval" / "results.md").write_text("| acc |\n")
  before = digests(directory)
  reference = save_pretrained(new_model, tmp_path / "reference")
  new_weights = digests(reference)["model.safetensors"]

  (target, name), expected = POINTS[point]
  fake = interrupt_unless_ignoring_errors if name == "rmtree" else interrupt
  monkeypatch.setattr(target, name, fake)
  with pytest.raises(Interrupted):
    save_pretrained(new_model, directory)
  monkeypatch.undo()

  after = digests(directory)
  for extra in ("notes.txt", "eval/results.md"):
    assert after[extra] == before[extra]
  if expected == "old":
    assert after == before
  else:
    assert after["model.safetensors"] == new_weights
    assert set(after) == set(before)
  from_pretrained(directory)  # loads


def test_an_export_over_a_directory_keeps_its_other_files(models, tmp_path):
  old_model, new_model = models
  directory = save_pretrained(old_model, tmp_path / "policy")
  (directory / "notes.txt").write_text("kept\n")
  save_pretrained(new_model, directory)
  assert (directory / "notes.txt").read_text() == "kept\n"
  assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # nothing left behind
