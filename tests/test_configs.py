"""The shipped configs load, default.yaml and `--print-config` give the dataclass defaults, the README
runs."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from epgrpo_jax.io import catalog
from epgrpo_jax.io import configlib
from epgrpo_jax.data import pipeline as data
from epgrpo_jax.training.config import CONFIG_DIR, TrainConfig, load_config

from helpers import tiny_hf_dir

ROOT = Path(__file__).resolve().parents[1]
REAL_SMOKE_CONFIG = "qwen2.5-0.5b-real-smoke.yaml"  # tests/test_real_model.py runs it
PAPER_CONFIGS = sorted(p.name for pattern in ("qwen*.yaml", "llama*.yaml") for p in CONFIG_DIR.glob(pattern)
                       if p.name != REAL_SMOKE_CONFIG)
EMBEDDED_CONFIGS = sorted(p.name for p in CONFIG_DIR.glob("*.yaml")
                          if p.name not in PAPER_CONFIGS and p.name != REAL_SMOKE_CONFIG)


def test_default_file_equals_dataclass_defaults():
  """An empty config and configs/default.yaml are the same run."""
  from_file = configlib.to_dict(load_config(CONFIG_DIR / "default.yaml"))
  assert from_file == configlib.to_dict(TrainConfig())


def test_print_config_output_loads_back_to_the_same_config(tmp_path):
  """`--print-config` prints every key with its value, as a config file that is the same run."""
  env = dict(os.environ, EPGRPO_COMPILATION_CACHE="")
  proc = subprocess.run([sys.executable, "-m", "epgrpo_jax.train", "--print-config"], cwd=tmp_path,
                        capture_output=True, text=True, env=env, timeout=300, check=True)
  (tmp_path / "printed.yaml").write_text(proc.stdout)
  printed = load_config(tmp_path / "printed.yaml")
  assert printed == TrainConfig()
  assert configlib.to_dict(printed) == configlib.to_dict(TrainConfig())
  # Every key is printed, with its value (nothing is left to the defaults).
  assert configlib.load_yaml(tmp_path / "printed.yaml") == configlib.to_dict(TrainConfig())


@pytest.mark.parametrize("name", EMBEDDED_CONFIGS)
def test_embedded_configs_load(name):
  cfg = load_config(CONFIG_DIR / name)
  assert cfg.model.path == "embedded"
  assert cfg.train.num_generations >= 2


@pytest.mark.parametrize("name", PAPER_CONFIGS)
def test_paper_configs_load_with_a_local_model(name, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # their data are named sets shipped in the package: any cwd works
  family = dict(model_type="llama", attention_bias=False) if name.startswith("llama") else {}
  model_dir = tiny_hf_dir(tmp_path / "model", **family)
  cfg = load_config(CONFIG_DIR / name, [f"model.path={model_dir}"])
  assert cfg.data.train_files == ("simplelr_math_l3to5",) and cfg.data.heldout_file == "math500"
  [train] = [data.resolve_source(f) for f in cfg.data.train_files]
  assert train.path == catalog.TRAIN_SETS["simplelr_math_l3to5"].path and train.path.is_file()
  assert data.resolve_source(cfg.data.heldout_file, "data.heldout_file").kind == "benchmark"
  # Section VII of the paper: lr 5e-6, warm-up 0.1, beta 0.001, clip 0.2, 16 prompts per step.
  assert cfg.optim.learning_rate == 5e-6 and cfg.optim.warmup_ratio == 0.1
  assert cfg.loss.beta == 0.001 and cfg.loss.eps_low == cfg.loss.eps_high == 0.2
  assert cfg.train.prompts_per_step == 16
  assert cfg.train.packing  # MATH-length completions: packing won on a GPU (docs/benchmarks.md)
  expected_g = 10 if "more-rollouts" in name else 8
  assert cfg.train.num_generations == expected_g
  assert cfg.sampling.temperature == (1.2 if "higher-temp" in name else 1.0)
  ep = "epgrpo" in name
  a = cfg.advantage
  assert (a.entropy_gate, a.progress_signal, a.zero_variance_anchor) == (ep, ep, ep)


def test_real_smoke_config_loads_with_a_local_model(tmp_path, monkeypatch):
  monkeypatch.chdir(ROOT)  # its data path is relative to the repository root
  cfg = load_config(CONFIG_DIR / REAL_SMOKE_CONFIG, [f"model.path={tiny_hf_dir(tmp_path)}"])
  t, lora = cfg.train, cfg.lora
  assert (t.steps, t.prompts_per_step, t.num_generations, cfg.sampling.max_new_tokens) == (3, 1, 8, 256)
  assert lora.rank == 32 and set(lora.targets) == {"q", "k", "v", "o", "gate", "up", "down"}
  assert cfg.model.param_dtype == "bfloat16" and not cfg.model.full_finetune


def test_paper_config_without_model_path_is_a_one_line_error(monkeypatch):
  monkeypatch.chdir(ROOT)
  with pytest.raises(ValueError, match=r"^model\.path: not a directory: /path/to/Qwen2\.5-3B$"):
    load_config(CONFIG_DIR / "qwen2.5-3b-epgrpo.yaml")


def test_readme_python_examples_run():
  """Every ```python block of the README runs as written."""
  blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
  assert blocks
  for block in blocks:
    exec(compile(block, "README.md", "exec"), {})


def _train_commands(text: str) -> list[list[str]]:
  """The arguments of every `python -m epgrpo_jax.train ...` command in a ```bash block
  (continuation lines joined)."""
  text = "\n".join(re.findall(r"```bash\n(.*?)```", text, re.S)).replace("\\\n", " ")
  return [shlex.split(m.split("#")[0]) for m in
          re.findall(r"python -m epgrpo_jax\.train([^\n&;|]*)", text)]


def test_documented_train_commands_resolve(tmp_path, monkeypatch):
  """Each training command of the README, docs/distributed.md and docs/training.md names a
  config file and keys that exist, with valid values (parsed, not run; a local tiny model stands in for
  the checkpoint directories they name)."""
  from epgrpo_jax.train import parse_args
  monkeypatch.chdir(ROOT)
  model_dir = tiny_hf_dir(tmp_path / "model")
  commands = [c for name in ("README.md", "docs/distributed.md", "docs/training.md")
              for c in _train_commands((ROOT / name).read_text())]
  assert len(commands) >= 6
  for argv in commands:
    args = parse_args(argv)
    overrides = [f"model.path={model_dir}" if o.startswith("model.path=") else o
                 for o in args.overrides]
    cfg = load_config(args.config, overrides)
    assert isinstance(cfg, TrainConfig), argv
