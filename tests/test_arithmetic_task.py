"""The embedded arithmetic task: generator, splits, tokenizer, cached assets, evaluation."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from epgrpo_jax.io import catalog
from epgrpo_jax.rewards import extract_boxed
from epgrpo_jax.tasks import arithmetic as A

SMALL = dict(train_per_level=40, heldout_per_level=8)


@pytest.fixture(scope="module")
def splits():
  return A.generate_splits(seed=7, **SMALL)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
  return A.build_assets(tmp_path_factory.mktemp("data"), seed=3, verbose=False, **SMALL)


# ----------------------------------------------------------------------------- problems

def _value(expr: str) -> int:
  assert re.fullmatch(r"[0-9+\-*()]+", expr)
  return eval(expr)  # noqa: S307 - digits, + - * and parentheses only (checked above)


@pytest.mark.parametrize("expr,steps,value", [
    ("3+4", ["3+4=7"], 7),
    ("9-2-3", ["9-2=7", "7-3=4"], 4),
    ("2+3*4", ["3*4=12", "2+12=14"], 14),
    ("7*5-3*2", ["7*5=35", "3*2=6", "35-6=29"], 29),
    ("(8+9)*9", ["8+9=17", "17*9=153"], 153),
    ("(2+3)*(4-1)", ["2+3=5", "4-1=3", "5*3=15"], 15),
])
def test_solve_steps_in_usual_order(expr, steps, value):
  assert A.solve(expr) == (steps, value)


def test_solutions_are_correct(splits):
  for row in splits[0] + splits[1]:
    expr = row["expression"]
    assert row["problem"] == f"Compute {expr}."
    assert row["answer"] == str(_value(expr))
    lines = row["solution"].split("\n")
    assert lines[-1] == f"\\boxed{{{row['answer']}}}"
    for line in lines[:-1]:
      lhs, rhs = line.split("=")
      assert _value(lhs) == int(rhs), line
    assert extract_boxed(row["solution"]) == row["answer"]
    assert A.is_correct(row["solution"], row["answer"])
    spec = A.LEVELS[row["level"]]
    assert all(0 <= int(l.split("=")[1]) <= spec.max_value for l in lines[:-1])


def test_generator_reproducible_from_seed(splits):
  assert A.generate_splits(seed=7, **SMALL) == splits
  assert A.generate_splits(seed=8, **SMALL) != splits


def test_splits_disjoint_balanced_and_shuffled(splits):
  train, heldout = splits
  train_exprs = {r["expression"] for r in train}
  heldout_exprs = [r["expression"] for r in heldout]
  assert not train_exprs & set(heldout_exprs)
  assert len(set(heldout_exprs)) == len(heldout_exprs)
  for level in A.LEVELS:
    assert sum(r["level"] == level for r in train) == SMALL["train_per_level"]
    assert 0 < sum(r["level"] == level for r in heldout) <= SMALL["heldout_per_level"]
  # Shuffled: a prefix of the held-out split already mixes several levels.
  assert len({r["level"] for r in heldout[:12]}) >= 3
  assert {"problem", "answer", "level", "solution"} <= set(train[0])


@pytest.mark.parametrize("text,boxed", [
    ("\\boxed{12}", "12"),
    ("a \\boxed{1} then \\boxed{2}", "2"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("no box", None),
    ("\\boxed{3", None),
])
def test_extract_boxed(text, boxed):
  assert extract_boxed(text) == boxed


def test_is_correct_exact_integers():
  assert A.is_correct("1+2=3\n\\boxed{3}", "3")
  assert A.is_correct("\\boxed{ 3 }", 3)
  assert not A.is_correct("\\boxed{4}", "3")
  assert not A.is_correct("\\boxed{3.0}", "3")
  assert not A.is_correct("3", "3")


# ----------------------------------------------------------------------------- tokenizer

def test_tokenizer_digits_and_round_trip(splits):
  tok = A.build_tokenizer(A.chat_prompt(r["problem"]) + r["solution"] + A.IM_END
                          for r in splits[0])
  for d in "0123456789":
    assert len(tok.encode(d).ids) == 1
  assert tok.encode("90817").tokens == list("90817")
  for r in splits[0][:50]:
    text = A.chat_prompt(r["problem"]) + r["solution"] + A.IM_END
    enc = tok.encode(text)
    assert tok.decode(enc.ids, skip_special_tokens=False) == text
    digits = [t for t in enc.tokens if any(c.isdigit() for c in t)]
    assert all(len(t) == 1 for t in digits)
  assert tok.decode(tok.encode("héllo ✓ 12").ids) == "héllo ✓ 12"  # any text encodes
  for special in A.SPECIAL_TOKENS:
    assert tok.encode(special).ids == [tok.token_to_id(special)]
  # The chat scaffolding costs few tokens.
  assert len(tok.encode(A.chat_prompt("Compute 1+2.")).ids) <= 14


def test_tokenizer_dir_loads_with_auto_tokenizer(assets):
  from tokenizers import Tokenizer
  from transformers import AutoTokenizer

  tok = AutoTokenizer.from_pretrained(assets.model_dir)
  raw = Tokenizer.from_file(str(assets.model_dir / "tokenizer.json"))
  cfg = json.loads((assets.model_dir / "tokenizer_config.json").read_text())
  assert cfg["eos_token"] == "<|im_end|>" and cfg["pad_token"] == "<|endoftext|>"
  assert "chat_template" in cfg
  assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
  assert tok.eos_token_id == raw.token_to_id("<|im_end|>")
  rendered = tok.apply_chat_template([{"role": "user", "content": "Compute 7*5-3*2."}],
                                     add_generation_prompt=True, tokenize=False)
  assert rendered == A.chat_prompt("Compute 7*5-3*2.")
  for r in assets.train_rows()[:100]:  # AutoTokenizer encodes exactly like tokenizer.json
    text = A.chat_prompt(r["problem"]) + r["solution"] + A.IM_END
    assert tok(text, add_special_tokens=False)["input_ids"] == raw.encode(text).ids
  assert tok.decode(tok("12+7=19\n")["input_ids"]) == "12+7=19\n"


# ----------------------------------------------------------------------------- assets

def test_build_assets_layout_and_model(assets):
  from epgrpo_jax.models import from_pretrained, load_hf_config

  assert assets.root.name.startswith("arithmetic-v1-seed3-")
  for path in (assets.train_file, assets.heldout_file, assets.model_dir / "config.json",
               assets.model_dir / "model.safetensors", assets.model_dir / "tokenizer.json"):
    assert path.exists(), path
  cfg = load_hf_config(assets.model_dir)
  raw = json.loads((assets.model_dir / "tokenizer.json").read_text())
  assert cfg.vocab_size == len(raw["model"]["vocab"])
  assert cfg.eos_token_id == raw["model"]["vocab"]["<|im_end|>"]
  model = from_pretrained(assets.model_dir)
  assert model.cfg == cfg
  rows = assets.train_rows()
  assert len(rows) == SMALL["train_per_level"] * len(A.LEVELS)
  assert assets.manifest["seed"] == 3
  assert not list(assets.root.parent.glob(".tmp-*"))


def test_build_assets_idempotent(assets, capsys):
  before = {p: p.stat().st_mtime_ns for p in assets.root.rglob("*")}
  again = A.build_assets(assets.root.parent, seed=3, **SMALL)
  assert again == assets
  assert {p: p.stat().st_mtime_ns for p in assets.root.rglob("*")} == before
  assert "built" not in capsys.readouterr().out


def test_build_assets_same_seed_same_files(assets, tmp_path):
  other = A.build_assets(tmp_path, seed=3, verbose=False, **SMALL)
  for name in ("train.jsonl", "heldout.jsonl", "model/tokenizer.json", "model/config.json",
               "model/model.safetensors"):
    assert (other.root / name).read_bytes() == (assets.root / name).read_bytes(), name


def test_killed_build_leaves_no_cache(tmp_path, monkeypatch):
  def boom(*args, **kwargs):
    raise KeyboardInterrupt  # as if killed half-way through writing the model

  monkeypatch.setattr("epgrpo_jax.tasks.arithmetic.assets._save_random_model", boom)
  with pytest.raises(KeyboardInterrupt):
    A.build_assets(tmp_path, seed=1, verbose=False, **SMALL)
  assert list(tmp_path.iterdir()) == []


def test_stale_temp_dir_of_dead_process_is_removed(tmp_path):
  proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                        capture_output=True, text=True, check=True)
  dead_pid = int(proc.stdout)
  final = tmp_path / "thing"
  stale = tmp_path / f".tmp-thing-{dead_pid}-abcd"
  stale.mkdir()
  (stale / "half.bin").write_bytes(b"x")
  assert A.atomic_build(final, lambda tmp: (tmp / "ok").write_text("1"))
  assert not stale.exists() and (final / "ok").read_text() == "1"
  assert not A.atomic_build(final, lambda tmp: pytest.fail("must not rebuild"))
  assert sorted(p.name for p in tmp_path.iterdir()) == ["thing"]


def test_default_data_dir_env(monkeypatch, tmp_path):
  monkeypatch.setenv("EPGRPO_DATA_DIR", str(tmp_path))
  assert catalog.cache_dir() == tmp_path
  monkeypatch.delenv("EPGRPO_DATA_DIR")
  assert catalog.cache_dir() == Path.home() / ".cache" / "epgrpo_jax"


# ----------------------------------------------------------------------------- evaluation

def test_evaluate_accuracy_random_model(assets):
  import jax
  from transformers import AutoTokenizer

  from epgrpo_jax.models import from_pretrained

  tok = AutoTokenizer.from_pretrained(assets.model_dir)
  model = from_pretrained(assets.model_dir)
  problems = assets.heldout_rows()[:6]
  out = A.evaluate_accuracy(model, tok, problems, num_samples=2, temperature=1.0,
                            max_new_tokens=8, key=jax.random.key(0))
  assert set(out) >= {"accuracy", "format", "by_level", "per_problem", "all_correct",
                      "all_wrong", "completions"}
  assert 0.0 <= out["accuracy"] <= 1.0 and len(out["per_problem"]) == 6
  assert len(out["completions"]) == 6 and all(len(c) == 2 for c in out["completions"])
  assert set(out["by_level"]) == {r["level"] for r in problems}
  greedy = A.evaluate_accuracy(model, tok, problems, num_samples=1, temperature=0.0,
                               max_new_tokens=8)
  assert len(greedy["completions"][0]) == 1


def test_slipped_demonstrations(splits):
  rows = splits[0]
  assert A.slipped_rows(rows, 0.0, seed=0) == rows
  slipped = A.slipped_rows(rows, 0.5, seed=0)
  assert slipped == A.slipped_rows(rows, 0.5, seed=0)
  wrong = [r for r in slipped if not A.is_correct(r["solution"], r["answer"])]
  assert 0.2 * len(rows) < len(wrong) < len(rows)
  for r in slipped:  # a slip is a near miss, and later steps use the slipped value
    lines = r["solution"].split("\n")
    assert lines[-1].startswith("\\boxed{")
    values = [int(l.split("=")[1]) for l in lines[:-1]]
    assert lines[-1] == f"\\boxed{{{values[-1]}}}"
    assert len(lines) - 1 == len(A.solve(r["expression"])[0])


def test_warm_start_cached(assets, capsys):
  path = A.warm_start(assets, steps=3, batch_size=4, buckets=(64,), log_every=1)
  assert (path / "model.safetensors").exists() and (path / "tokenizer_config.json").exists()
  record = json.loads((path / "sft.json").read_text())
  assert len(record["losses"]) == 3 and not (path / "sft_data.jsonl").exists()
  assert "warm start done" in capsys.readouterr().out
  assert A.warm_start(assets, steps=3, batch_size=4, buckets=(64,), log_every=1) == path
  assert "[sft]" not in capsys.readouterr().out  # cached: no training
  assert A.warm_start(assets, steps=3, batch_size=4, buckets=(64,), slip=0.3) != path
