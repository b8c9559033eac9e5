"""`~` in a path the user gives expands the same way everywhere: every path key of the config
(through `UserPath`, where configs are typed) and every path flag of every command and benchmark
script (through `path_flag`). Shells leave `key=~/x` and `--flag=~/x` alone, so the program must."""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from epgrpo_jax import train as train_cli
from epgrpo_jax.io import configlib, paths
from epgrpo_jax.training.config import TrainConfig, load_config

REPO = Path(__file__).resolve().parents[1]
# A config field or flag with one of these words in its name names a file or a directory.
PATH_WORDS = {"dir", "file", "files", "path", "model", "out", "checkpoint", "config", "data", "json",
              "run", "runs"}


def path_like(name: str) -> bool:
  return bool(PATH_WORDS & set(re.split(r"[-_]", name.strip("-").lower())))
# Path flags whose values are not a bare path, expanded where they are split.
SPLIT_ELSEWHERE = {"--benchmark-file"}  # NAME=PATH: evalsets.parse_benchmark_files


def path_keys(cls=TrainConfig, prefix: str = "") -> dict[str, typing.Any]:
  """Dotted key -> annotation of every str or tuple-of-str field whose name says it is a path."""
  out = {}
  hints = typing.get_type_hints(cls, include_extras=True)
  for f in dataclasses.fields(cls):
    tp = hints[f.name]
    if dataclasses.is_dataclass(tp):
      out |= path_keys(tp, f"{prefix}{f.name}.")
      continue
    base = typing.get_args(tp)[0] if typing.get_origin(tp) is tuple else tp
    plain = typing.get_args(base)[0] if paths.is_user_path(base) else base
    if plain is str and path_like(f.name):
      out[prefix + f.name] = base
  return out


def test_every_path_key_of_the_config_is_a_user_path():
  keys = path_keys()
  assert {"model.path", "train.output_dir", "embedded.data_dir", "data.train_files",
          "data.heldout_file"} <= set(keys)
  assert not [k for k, tp in keys.items() if not paths.is_user_path(tp)]


@pytest.fixture
def home(tmp_path, monkeypatch):
  """HOME in a temporary directory, and the current directory elsewhere (checked for `~`)."""
  home, cwd = tmp_path / "home", tmp_path / "cwd"
  (home / "model").mkdir(parents=True)
  (home / "model" / "config.json").write_text("{}")
  (home / "train.jsonl").write_text('{"problem": "1+1", "answer": "2"}\n')
  cwd.mkdir()
  monkeypatch.setenv("HOME", str(home))
  monkeypatch.chdir(cwd)
  yield home
  assert not list(cwd.rglob("~*")), "a directory literally named ~ appeared"


def test_tilde_in_every_path_key_is_the_home_directory(home):
  values = {"model.path": "~/model", "train.output_dir": "~/runs/x", "embedded.data_dir": "~/cache",
            "data.train_files": "[~/train.jsonl]", "data.heldout_file": "~/train.jsonl"}
  assert set(values) == set(path_keys())  # a new path key needs a line here
  cfg = load_config(None, [f"{k}={v}" for k, v in values.items()])
  got = configlib.to_dict(cfg)
  for key in values:
    section, name = key.split(".")
    value = got[section][name]
    for v in (value if isinstance(value, list) else [value]):
      assert v.startswith(str(home) + "/"), (key, v)
  # The same in a config file, its `base:` and `--config` itself.
  (home / "base.yaml").write_text("train: {output_dir: ~/runs/base}\n")
  (home / "run.yaml").write_text("base: ~/base.yaml\nmodel: {path: ~/model}\n")
  cfg = load_config(paths.path_flag("~/run.yaml"))
  assert (cfg.train.output_dir, cfg.model.path) == (f"{home}/runs/base", f"{home}/model")
  # An override leaves other text alone (only a leading ~ is a home directory).
  assert load_config(None, ["train.output_dir=runs/a~b"]).train.output_dir == "runs/a~b"


def test_print_config_shows_the_expanded_output_dir(home, capsys):
  assert train_cli.main(["--print-config", "train.output_dir=~/runs/x"]) == 0
  assert f"output_dir: {home}/runs/x" in capsys.readouterr().out


def test_a_tilde_user_without_a_home_is_a_one_line_error(home, capsys):
  assert train_cli.main(["--print-config", "train.output_dir=~no-such-user-epgrpo/x"]) == 2
  assert capsys.readouterr().err == ("error: train.output_dir: ~no-such-user-epgrpo/x: no home "
                                     "directory for '~no-such-user-epgrpo'\n")


def _path_flags() -> list[tuple[str, str, str]]:
  """(file, flag, its `type=` source) of every add_argument in the package and benchmarks whose
  name says it takes a path and whose value is text (no action, no int/float type)."""
  found = []
  files = sorted([*(REPO / "epgrpo_jax").rglob("*.py"), *(REPO / "benchmarks").glob("*.py")])
  for path in files:
    for node in ast.walk(ast.parse(path.read_text())):
      if not (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument"
              and node.args and isinstance(node.args[0], ast.Constant)):
        continue
      kw = {k.arg: ast.unparse(k.value) for k in node.keywords}
      flag = node.args[0].value
      tp = kw.get("type", "str")
      if path_like(flag) and "action" not in kw and (tp in ("str", "Path") or "path_flag" in tp):
        found.append((str(path.relative_to(REPO)), flag, tp))
  return found


def test_every_path_flag_of_every_command_expands_tilde():
  flags = _path_flags()
  assert {("epgrpo_jax/tools/plot.py", "--out"), ("epgrpo_jax/tools/heatmap.py", "--out"),
          ("epgrpo_jax/train.py", "--config"), ("epgrpo_jax/sft.py", "--data"),
          ("epgrpo_jax/evaluate.py", "--checkpoint"),
          ("epgrpo_jax/experiments/compare.py", "--out")} <= {(f, n) for f, n, _ in flags}
  missing = [(f, n) for f, n, tp in flags if "path_flag" not in tp and n not in SPLIT_ELSEWHERE]
  assert not missing, f"give these type=path_flag (epgrpo_jax.io.paths): {missing}"


def test_flag_values_expand_in_the_commands(home):
  from epgrpo_jax import evaluate
  from epgrpo_jax.tools import heatmap, plot
  args = plot.parse_args(["~/a", "~/b", "--out=~/plots"])
  assert (args.runs, args.out) == ([f"{home}/a", f"{home}/b"], f"{home}/plots")
  args = heatmap.parse_args(["~/a", "--out=~/page.html"])
  assert (args.run, args.out) == (f"{home}/a", f"{home}/page.html")
  args = evaluate.parse_args(["--model=~/model", "--out=~/eval", "--data-dir=~/data",
                              "--benchmarks=aime24", "--benchmark-file=aime24=~/a.jsonl"])
  assert (args.model, args.out, args.data_dir) == (f"{home}/model", f"{home}/eval", f"{home}/data")
  assert args.benchmark_files == {"aime24": f"{home}/a.jsonl"}


def test_a_tool_writes_under_home_in_a_real_process(home, tmp_path):
  # No shell: the process gets `~/run` literally, as from `--out=~/x` or a quoted argument.
  (home / "run").mkdir()
  (home / "run" / "metrics.jsonl").write_text('{"step": 1, "reward": 0.5}\n{"step": 2, "reward": 0.7}\n')
  proc = subprocess.run([sys.executable, "-m", "epgrpo_jax.tools.plot", "~/run", "--out=~/plots"],
                        cwd=tmp_path / "cwd", capture_output=True, text=True, timeout=120,
                        env=dict(os.environ, HOME=str(home), MPLCONFIGDIR=str(tmp_path / "mpl")))
  assert proc.returncode == 0, proc.stderr
  assert (home / "plots" / "reward.png").is_file()
