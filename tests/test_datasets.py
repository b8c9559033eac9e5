"""Training and held-out data by name (the sets shipped in epgrpo_jax/datasets), by path, from
a folder saved by `datasets`, and by Hugging Face id (no network: a saved folder stands in)."""

from __future__ import annotations

import gzip
import json
import lzma

import pytest

from epgrpo_jax.data import evalsets as benchmarks
from epgrpo_jax.io import catalog
from epgrpo_jax.data import pipeline as data
from epgrpo_jax.training.config import load_config
from epgrpo_jax.io.records import data_stem, read_rows
from helpers import WhitespaceTokenizer

TRAIN = catalog.TRAIN_SETS["simplelr_math_l3to5"]


def _load(files, field="data.train_files", **cfg):
  cfg = data.DataConfig(prompt_template="{problem}", max_prompt_tokens=100_000, **cfg)
  renderer = data.PromptRenderer(WhitespaceTokenizer(), cfg)
  return data.load_examples(files, renderer, cfg, field=field)


@pytest.fixture(scope="module")
def by_name():
  return _load(["simplelr_math_l3to5"])


# -- the shipped files


def test_every_shipped_file_is_declared_and_documented():
  """The catalog, the package data of pyproject.toml and the README cover every data file."""
  files = {p.relative_to(catalog.DATA_DIR).as_posix() for p in catalog.DATA_DIR.rglob("*")
           if p.is_file()}
  listed = {TRAIN.file, *(f"benchmarks/{s.file}.gz" for s in benchmarks.BENCHMARKS.values()),
            "benchmarks/alt/aime24_skywork_or1.parquet",
            "benchmarks/alt/aime25_skywork_or1.parquet", "README.md"}
  assert files == listed
  readme = (catalog.DATA_DIR / "README.md").read_text()
  for f in files - {"README.md"}:
    assert f"`{f}`" in readme, f
  pyproject = (catalog.DATA_DIR.parents[1] / "pyproject.toml").read_text()
  for pattern in ("datasets/README.md", "datasets/*/*.jsonl.gz", "datasets/*/alt/*.parquet"):
    assert f'"{pattern}"' in pyproject


def test_train_set_by_name(by_name):
  examples, skips = by_name
  # Rows 5054 and 5158 have an empty gold answer upstream: skipped and counted.
  assert TRAIN.rows == 8523 and len(examples) == 8521 and skips == {"empty_answer": 2}
  first = examples[0]
  assert first.problem.startswith("Let $a$ and $b$ be the two real values of $x$")
  assert first.answer == "118" and first.id == "simplelr_qwen_level3to5_train.derived:0"
  assert catalog.train_set("SimpleLR_Qwen_Level3to5") == TRAIN  # alias, any case


def test_name_and_path_give_identical_rows(by_name, tmp_path):
  """The name, the shipped .gz by path, and a decompressed copy by path: the same examples."""
  plain = tmp_path / "simplelr_qwen_level3to5_train.derived.jsonl"
  plain.write_bytes(gzip.decompress(TRAIN.path.read_bytes()))
  fields = dict(problem_field="question", answer_field="answer")
  assert _load([str(TRAIN.path)], **fields) == by_name
  assert _load([str(plain)], **fields) == by_name
  assert read_rows(TRAIN.path) == read_rows(plain)


def test_heldout_by_name_uses_the_benchmark_loader():
  """`data.heldout_file=math500` reads MATH500's `problem` field, whatever the training
  fields are (the paper configs name `question` for their training set)."""
  examples, skips = _load(["math500"], field="data.heldout_file", problem_field="question")
  problems = benchmarks.load_benchmark("math500")
  assert [(e.id, e.problem, e.answer) for e in examples] == [
      (p.id, p.problem, p.answer) for p in problems]
  assert len(examples) == 500 and not sum(skips.values())
  minerva, _ = _load(["minerva_math"], field="data.heldout_file")  # gold from \boxed{} of solution
  assert len(minerva) == 272 and minerva[0].answer == "1.6"


def test_names_in_a_config(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # names do not depend on the working directory
  cfg = load_config(None, ["data.train_files=[simplelr_math_l3to5,aime24]",
                           "data.heldout_file=aime25"])
  assert cfg.data.train_files == ("simplelr_math_l3to5", "aime24")
  kinds = [data.resolve_source(f).kind for f in cfg.data.train_files]
  assert kinds == ["train_set", "benchmark"]
  examples, _ = _load(cfg.data.train_files)
  assert len(examples) == 8521 + 30


@pytest.mark.parametrize("field, value, message", [
    ("train_files", "simplelr_math", "data.train_files: 'simplelr_math' is neither a file nor a "
     "known data set (simplelr_math_l3to5, math500, amc23, minerva, aime24, aime25)"),
    ("heldout_file", "math501", "data.heldout_file: 'math501' is neither a file nor a known data "
     "set (simplelr_math_l3to5, math500, amc23, minerva, aime24, aime25)"),
    ("heldout_file", "data/missing.jsonl", "data.heldout_file: file not found: data/missing.jsonl"),
])
def test_unknown_name_is_a_one_line_error_naming_the_field(field, value, message, tmp_path,
                                                           monkeypatch):
  monkeypatch.chdir(tmp_path)
  override = f"data.{field}=[{value}]" if field == "train_files" else f"data.{field}={value}"
  with pytest.raises(ValueError) as e:
    load_config(None, [override])
  assert str(e.value) == message


def test_a_folder_that_is_not_a_saved_dataset(tmp_path):
  with pytest.raises(ValueError, match=r"^data\.train_files: .* is a folder, but not a data set "
                     r"saved with datasets' save_to_disk$"):
    data.DataConfig(train_files=(str(tmp_path),))


def test_hub_id_needs_the_datasets_library(monkeypatch):
  monkeypatch.setattr(catalog, "has_datasets", lambda: False)
  with pytest.raises(ValueError, match=r"^data\.train_files: 'someone/math' is neither a file nor "
                     r"a known data set .*; as a Hugging Face dataset id it needs the `datasets` "
                     r"library \(pip install 'epgrpo-jax\[datasets\]'\)$"):
    data.DataConfig(train_files=("someone/math",))


def test_hub_reference_parsing():
  assert catalog.hf_reference("someone/math") == ("someone/math", None)
  assert catalog.hf_reference("hf:someone/math:test") == ("someone/math", "test")
  assert catalog.hf_reference("someone/math-v1.5:train") == ("someone/math-v1.5", "train")
  for not_an_id in ("math500", "data/train.jsonl", "data/train.jsonl.gz", "a/b/c", "/abs/x"):
    assert catalog.hf_reference(not_an_id) is None, not_an_id


# -- compressed files


def test_compressed_json_lines_and_arrays(tmp_path):
  rows = [{"problem": "What is 1+1?", "answer": "2"}, {"problem": "What is 2+2?", "answer": 4}]
  text = "".join(json.dumps(r) + "\n" for r in rows).encode()
  (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(text))
  (tmp_path / "a.jsonl.xz").write_bytes(lzma.compress(text))
  (tmp_path / "b.json.gz").write_bytes(gzip.compress(json.dumps(rows).encode()))
  for name in ("a.jsonl.gz", "a.jsonl.xz", "b.json.gz"):
    assert read_rows(tmp_path / name) == rows, name
  examples, _ = _load([str(tmp_path / "a.jsonl.gz")])
  assert [e.id for e in examples] == ["a:0", "a:1"] and data_stem("x/a.jsonl.gz") == "a"
  (tmp_path / "bad.jsonl.gz").write_bytes(b"not gzip")
  with pytest.raises(ValueError, match=r"bad\.jsonl\.gz: unreadable \.gz file"):
    read_rows(tmp_path / "bad.jsonl.gz")


# -- Hugging Face `datasets`


@pytest.fixture
def saved(tmp_path):
  """A DatasetDict (train, test) and a plain Dataset written with `save_to_disk`."""
  datasets = pytest.importorskip("datasets")
  train = [{"question": f"What is {i}+{i}?", "gt": str(2 * i)} for i in range(6)]
  test = [{"question": "What is 10*10?", "gt": "100"}]
  datasets.DatasetDict({"train": datasets.Dataset.from_list(train),
                        "test": datasets.Dataset.from_list(test)}).save_to_disk(tmp_path / "dict")
  datasets.Dataset.from_list(test).save_to_disk(tmp_path / "single")
  return tmp_path, train, test


def test_saved_dataset_folders(saved):
  tmp_path, train, test = saved
  fields = dict(problem_field="question", answer_field="gt")
  examples, _ = _load([str(tmp_path / "dict")], **fields)
  assert [(e.problem, e.answer) for e in examples] == [(r["question"], r["gt"]) for r in train]
  assert examples[0].id == "dict:0"
  heldout, _ = _load([str(tmp_path / "dict")], field="data.heldout_file", **fields)
  assert [e.problem for e in heldout] == ["What is 10*10?"]  # the held-out field reads "test"
  single, _ = _load([str(tmp_path / "single")], **fields)  # a plain Dataset has no splits
  assert [e.answer for e in single] == ["100"]
  cfg = load_config(None, [f"data.train_files=[{tmp_path / 'dict'}]",
                           f"data.heldout_file={tmp_path / 'single'}",
                           "data.problem_field=question", "data.answer_field=gt"])
  assert data.resolve_source(cfg.data.heldout_file, "data.heldout_file").kind == "saved"


def test_hub_id_through_datasets(saved, monkeypatch):
  import datasets
  tmp_path, train, test = saved
  asked = []

  def load_dataset(dataset_id, split):  # stands in for the hub: the saved folder
    asked.append((dataset_id, split))
    return datasets.load_from_disk(str(tmp_path / "dict"))[split]

  monkeypatch.setattr(datasets, "load_dataset", load_dataset)
  fields = dict(problem_field="question", answer_field="gt")
  examples, _ = _load(["someone/arith"], **fields)
  assert [e.answer for e in examples] == [r["gt"] for r in train]
  assert examples[0].id == "arith:0"
  heldout, _ = _load(["someone/arith"], field="data.heldout_file", **fields)
  assert [e.answer for e in heldout] == ["100"]
  again, _ = _load(["hf:someone/arith:test"], **fields)
  assert again == heldout
  assert asked == [("someone/arith", "train"), ("someone/arith", "test"),
                   ("someone/arith", "test")]

