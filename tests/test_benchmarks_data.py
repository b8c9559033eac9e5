"""Benchmark loading and answer checking on the real files shipped in epgrpo_jax/datasets.

The five benchmarks are loaded by name, which finds the package's gzipped
copies (see epgrpo_jax/datasets/README.md); nothing outside the repository is
read and nothing is skipped.

Self-match (a completion ending in \\boxed{<gold>} scores 1; the string fast
path is off, so every gold that is not a plain number goes through
math-verify, and plain numbers through the numeric rule): 100% on all five
benchmarks (MATH500 500/500, AMC23 40/40, Minerva 272/272, AIME24 30/30,
AIME25 30/30). The assertion is >= 99%.

Cross-match (the gold of the next row whose gold is a different value scores
0; default config, 2 CPU-seconds per check): MATH500 499/500 -- row 22 (gold
`5`) accepts row 23's gold `x=5`, because math-verify takes the value of an
assignment. Minerva 272/272, of which 3 pairs of large symbolic expressions
(e.g. two differential equations, or a damped-oscillator response against a
Laplace transform) run out of time inside sympy's simplify and score 0 as
counted timeouts; without the numeric rule of `rewards.answers._decide`, math-verify
would also accept row 265's `1.325e-27` for row 264's `2.88e-19` (it rounds
to 6 decimal places). AMC23, AIME24, AIME25: 100%. The assertion is >= 98%.
"""

from __future__ import annotations

import gzip
import json
import shutil

import numpy as np
import pytest

from epgrpo_jax.data import evalsets as B
from epgrpo_jax.io import catalog
from epgrpo_jax import rewards as R
from epgrpo_jax.rewards.answers import _decide

BENCH_DIR = catalog.DATA_DIR / "benchmarks"

ROWS = {"math500": 500, "amc23": 40, "minerva": 272, "aime24": 30, "aime25": 30}
AIME25_ANSWERS = [70, 588, 16, 117, 279, 504, 821, 77, 62, 81, 259, 510, 204, 60, 735, 468, 49,
                  82, 106, 336, 293, 237, 610, 149, 907, 113, 19, 248, 104, 240]


@pytest.fixture(scope="module")
def scorer():
  with R.RewardScorer(R.RewardConfig(timeout_s=10.0), num_workers=2) as s:
    yield s


@pytest.fixture(scope="module")
def loaded():
  """Each benchmark by name only: no data dir, no $EPGRPO_DATA_DIR, the hub switched off."""
  with pytest.MonkeyPatch.context() as mp:
    mp.delenv(B.DATA_DIR_ENV, raising=False)
    mp.setenv("HF_DATASETS_OFFLINE", "1")
    return {name: B.load_benchmark_with_stats(name) for name in ROWS}


# -- loading


def test_shipped_files_are_complete():
  """Every benchmark has its gzipped copy; the folder holds nothing the loader ignores."""
  shipped = {B.shipped_file(spec) for spec in B.BENCHMARKS.values()}
  assert shipped == set(BENCH_DIR.glob("*.jsonl.gz"))
  assert (catalog.DATA_DIR / "README.md").is_file()


@pytest.mark.parametrize("name", list(ROWS))
def test_rows_and_fields(name, loaded):
  problems, stats = loaded[name]
  assert stats.source == str(B.shipped_file(B.get_spec(name)))
  assert len(problems) == ROWS[name] == stats.rows == stats.loaded
  assert not sum(stats.skipped.values())
  assert len({p.id for p in problems}) == len(problems)
  for p in problems:
    assert isinstance(p.answer, str) and p.answer and p.answer == p.answer.strip()
    assert isinstance(p.problem, str) and len(p.problem) > 10
    assert not any(ch in p.problem for ch in "\x08\x0c")


def test_answer_types_kept_as_strings(loaded):
  amc = loaded["amc23"][0]
  assert amc[0].answer == "27" and all("." not in p.answer for p in amc)
  aime24 = loaded["aime24"][0]
  assert aime24[7].answer == "025" and aime24[0].id == "60"
  assert [p.answer for p in loaded["aime25"][0]] == [str(a) for a in AIME25_ANSWERS]
  math500 = loaded["math500"][0]
  assert math500[0].answer == r"\left( 3, \frac{\pi}{2} \right)"
  assert math500[0].id == "test/precalculus/807.json" and math500[0].meta["level"] == 2


def test_aime25_bad_escapes_repaired(loaded):
  problems, stats = loaded["aime25"]
  assert stats.repaired == 3
  assert problems[18].problem.count(r"\frac") == 5
  assert r"\triangle DEF" in problems[19].problem
  assert r"\frac{m}{n}" in problems[27].problem
  # Real tabs elsewhere stay (MATH500 row 17 is Asymptote code).
  assert "\treturn" in loaded["math500"][0][17].problem


def test_minerva_gold_from_solution(loaded):
  answers = [p.answer for p in loaded["minerva"][0]]
  assert answers[0] == "1.6" and answers[1] == "4.5e33"
  assert answers[5] == r"\arcsin(10/13)"  # was np.arcsin(10/13)
  assert r"-1/3" in answers and r"-3/2" in answers  # were -1./3, -3./2
  assert r"\frac{1}{2a}(e^{a*t} - e^{-a*t})" in answers  # was \exp{a*t} ...
  assert all("$" not in a and "\n" not in a for a in answers)
  assert r"\frac{37}{4} m" in answers  # a symbol, not a unit word: kept (as the harness does)


def test_minerva_answer_cleaning():
  assert B.minerva_answer(r"5 \text{ m}") == "5"
  assert B.minerva_answer(r"\text{m}") == r"\text{m}"
  assert B.minerva_answer(r"2 \mathrm{~s}") == "2"
  assert B.minerva_answer("x_{0} \\cos t+$ $y\n") == r"x_{0} \cos t+ y"


def test_alt_parquet_layouts(loaded):
  alt25 = B.load_benchmark("aime25", path=BENCH_DIR / "alt" / "aime25_skywork_or1.parquet")
  assert len(alt25) == 30 and alt25[19].answer == r"336^\circ"
  assert alt25[0].problem.startswith("Find the sum of all integer bases")
  for p, q in zip(alt25, loaded["aime25"][0]):
    assert R.check(p.answer, q.answer), (p.answer, q.answer)
  alt24 = B.load_benchmark("aime24", path=BENCH_DIR / "alt" / "aime24_skywork_or1.parquet")
  assert len(alt24) == 30 and not any("think step by step" in p.problem for p in alt24)
  jsonl24 = {p.problem[:60]: p.answer for p in loaded["aime24"][0]}
  matched = [(p.answer, jsonl24[p.problem[:60]]) for p in alt24 if p.problem[:60] in jsonl24]
  assert len(matched) >= 20 and all(R.check(a, b) for a, b in matched)


def _plain_copy(name: str, folder) -> None:
  """The shipped benchmark `name`, decompressed into `folder` under its usual file name."""
  spec = B.get_spec(name)
  folder.mkdir(parents=True, exist_ok=True)
  (folder / spec.file).write_bytes(gzip.decompress(B.shipped_file(spec).read_bytes()))


def test_resolution_order(tmp_path, monkeypatch):
  monkeypatch.delenv(B.DATA_DIR_ENV, raising=False)
  shipped = str(B.shipped_file(B.get_spec("aime24")))
  # Nothing given: the copy shipped with the package.
  assert B.load_benchmark_with_stats("aime24")[1].source == shipped
  # data_dir may be the data root (with a benchmarks/ folder) or the folder itself, and
  # its files may be gzipped; a data dir without the file falls through to the shipped copy.
  _plain_copy("aime24", tmp_path / "root" / "benchmarks")
  problems, stats = B.load_benchmark_with_stats("aime24", data_dir=tmp_path / "root", limit=5)
  assert len(problems) == 5
  assert stats.source == str(tmp_path / "root" / "benchmarks" / "aime24.jsonl")
  shutil.copyfile(shipped, tmp_path / "aime24.jsonl.gz")
  assert B.load_benchmark_with_stats("aime24", data_dir=tmp_path)[1].source == str(
      tmp_path / "aime24.jsonl.gz")
  assert B.load_benchmark_with_stats("aime25", data_dir=tmp_path / "empty")[1].source == str(
      B.shipped_file(B.get_spec("aime25")))
  # The environment variable is used when no data_dir finds the file, before the shipped copy.
  _plain_copy("aime25", tmp_path / "env")
  monkeypatch.setenv(B.DATA_DIR_ENV, str(tmp_path / "env"))
  problems, stats = B.load_benchmark_with_stats("aime25", data_dir=tmp_path / "empty")
  assert len(problems) == 30 and stats.source == str(tmp_path / "env" / "aime25.jsonl")
  # An explicit path wins.
  f = tmp_path / "mine.jsonl"
  f.write_text(json.dumps({"problem": "What is 1+1?", "answer": 2}) + "\n")
  assert B.load_benchmark("aime24", path=f) == [B.Problem("0", "What is 1+1?", "2")]
  with pytest.raises(FileNotFoundError, match="file not found"):
    B.load_benchmark("aime24", path=tmp_path / "missing.jsonl")


def test_name_and_path_give_the_same_problems(loaded):
  for name in ROWS:
    assert B.load_benchmark(name, path=B.shipped_file(B.get_spec(name))) == loaded[name][0]


def test_offline_without_any_copy_is_one_clear_line(tmp_path, monkeypatch):
  """A package without its data files (simulated) and no network: one line saying what to pass."""
  monkeypatch.delenv(B.DATA_DIR_ENV, raising=False)
  monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
  monkeypatch.setattr(catalog, "DATA_DIR", tmp_path / "no-package-data")
  with pytest.raises(FileNotFoundError) as e:
    B.load_benchmark("aime24", data_dir=tmp_path)
  msg = str(e.value)
  assert "\n" not in msg and msg.startswith("benchmark 'aime24': no local file")
  assert str(tmp_path / "no-package-data" / "benchmarks" / "aime24.jsonl.gz") in msg
  assert "pass --benchmark-file aime24=PATH (expected a JSONL with fields problem, answer)" in msg
  with pytest.raises(FileNotFoundError, match="minerva=PATH"):
    B.load_benchmark("minerva_math")
  with pytest.raises(KeyError, match="unknown"):
    B.load_benchmark("gsm8k")


def test_saved_dataset_and_hub_id_as_benchmark_file(tmp_path, monkeypatch):
  """--benchmark-file NAME=FOLDER (save_to_disk) and NAME=hf:OWNER/NAME[:SPLIT], no network."""
  datasets = pytest.importorskip("datasets")
  rows = [{"problem": "What is 2+3?", "answer": 5.0, "id": "a"},
          {"problem": "What is 2*3?", "answer": 6.0, "id": "b"}]
  datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)}).save_to_disk(tmp_path / "saved")
  expected = [B.Problem("a", "What is 2+3?", "5"), B.Problem("b", "What is 2*3?", "6")]
  assert B.load_benchmark("amc23", path=tmp_path / "saved") == expected
  asked = []

  def load_dataset(dataset_id, split):  # stands in for the hub: the saved folder
    asked.append((dataset_id, split))
    return datasets.load_from_disk(str(tmp_path / "saved"))["test"]

  monkeypatch.setattr(datasets, "load_dataset", load_dataset)
  problems, stats = B.load_benchmark_with_stats("amc23", path="hf:someone/amc:test")
  assert problems == expected and stats.source == "hf:someone/amc[test]"
  assert B.load_benchmark("aime24", path="someone/aime") == expected
  assert asked == [("someone/amc", "test"), ("someone/aime", "train")]  # aime24's usual split


def test_skipped_rows_are_counted(tmp_path, caplog):
  f = tmp_path / "b.jsonl"
  lines = [json.dumps({"problem": "p1", "answer": "1"}), json.dumps({"problem": "p2"}),
           json.dumps({"answer": "3"}), "{not json", json.dumps({"problem": " ", "answer": 4}),
           json.dumps([1, 2]), "", json.dumps({"problem": "p6", "answer": 6.0, "id": 9})]
  f.write_bytes(("\n".join(lines) + "\n").encode() + b'{"problem": "\xff", "answer": 1}\n')
  problems, stats = B.load_benchmark_with_stats("math500", path=f)
  assert [(p.id, p.answer) for p in problems] == [("0", "1"), ("9", "6")]
  assert stats.skipped == {"missing_answer": 1, "missing_problem": 2, "bad_json": 1,
                           "not_an_object": 1, "not_utf8": 1}
  assert "skipped" in caplog.text
  assert len(B.load_benchmark("math500", path=f, limit=1)) == 1


def test_json_array_and_verl_parquet(tmp_path):
  pa = pytest.importorskip("pyarrow")
  import pyarrow.parquet as pq
  rows = [{"prompt": [{"role": "user", "content": "Q1 Let's think step by step and output "
                       "the final answer within \\boxed{}."}],
           "reward_model": {"ground_truth": "12", "style": "rule"}, "extra_info": {"index": 4}},
          {"prompt": [{"role": "user", "content": "Q2"}],
           "reward_model": {"ground_truth": None, "style": "rule"}, "extra_info": {"index": 5}}]
  pq.write_table(pa.Table.from_pylist(rows), tmp_path / "v.parquet")
  problems, stats = B.load_benchmark_with_stats("aime25", path=tmp_path / "v.parquet")
  assert problems == [B.Problem("4", "Q1", "12")] and stats.skipped == {"missing_answer": 1}
  (tmp_path / "a.json").write_text(json.dumps([{"question": "Q", "answer": 1.5}]))
  assert B.load_benchmark("amc23", path=tmp_path / "a.json") == [B.Problem("0", "Q", "1.5")]


def test_parse_benchmark_files():
  assert B.parse_benchmark_files(["aime24=/x/a.jsonl", "minerva_math=b.parquet"]) == {
      "aime24": "/x/a.jsonl", "minerva": "b.parquet"}
  with pytest.raises(ValueError, match="NAME=PATH"):
    B.parse_benchmark_files(["aime24"])


# -- answers through the checker


def _next_different(golds: list[R.Gold], i: int) -> int:
  """The next row whose gold is not the same value as row i's."""
  cfg = R.RewardConfig()
  j = (i + 1) % len(golds)
  while (golds[j].norm == golds[i].norm
         or _decide(R.light_normalise(golds[j].text), golds[i], cfg)):
    j = (j + 1) % len(golds)
  return j


@pytest.mark.parametrize("name", list(ROWS))
def test_gold_scores_itself(name, loaded, scorer):
  problems = loaded[name][0]
  golds = [p.answer for p in problems]
  completions = [f"Putting it together, the answer is $\\boxed{{{g}}}$." for g in golds]
  res = scorer.score(completions, golds, R.RewardConfig(fast_path=False, timeout_s=10.0))
  misses = [(i, golds[i], res.status[i]) for i in np.flatnonzero(res.accuracy != 1)]
  assert res.accuracy.mean() >= 0.99, misses
  assert res.format.all()


@pytest.mark.parametrize("name", list(ROWS))
def test_other_rows_gold_scores_zero(name, loaded, scorer):
  problems = loaded[name][0]
  golds = [R.parse_gold(p.answer) for p in problems]
  others = [_next_different(golds, i) for i in range(len(golds))]
  completions = [f"So $\\boxed{{{problems[j].answer}}}$." for j in others]
  res = scorer.score(completions, golds, R.RewardConfig(timeout_s=2.0))
  hits = [(i, golds[i].raw, problems[others[i]].answer)
          for i in np.flatnonzero(res.accuracy != 0)]
  assert 1 - res.accuracy.mean() >= 0.98, hits
  assert res.errors == 0
