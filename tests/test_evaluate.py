"""The evaluation command: pass@k, the scoring layer on hand-made completions,
prompt skips, restoring training checkpoints, bad input, and an end-to-end run
on a tiny random model over a 10-problem slice of each real benchmark."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from flax import nnx

from epgrpo_jax import evaluate as E
from epgrpo_jax.evaluation import checkpoints as C
from epgrpo_jax.evaluation import heldout as H
from epgrpo_jax.training import objective
from epgrpo_jax.data.evalsets import DATA_DIR_ENV, get_spec, load_benchmark, shipped_file
from epgrpo_jax.io.checkpointing import Checkpointer, restore_trainable
from epgrpo_jax.models import LoraConfig, from_pretrained, lora_layers
from epgrpo_jax.models._lora import folded_kernel
from epgrpo_jax.rewards import RewardScorer
from helpers import tiny_hf_dir

REPO = Path(__file__).resolve().parents[1]
NAMES = ("math500", "amc23", "minerva", "aime24", "aime25")  # shipped in epgrpo_jax/datasets


# ----------------------------------------------------------------------------
# pass@k and the scoring layer


def brute_pass_at_k(row: np.ndarray, k: int) -> float:
  """Share of the k-subsets of a problem's samples that hold a correct one."""
  subsets = list(itertools.combinations(range(len(row)), k))
  return sum(any(row[i] for i in sub) for sub in subsets) / len(subsets)


def test_summary_pass_at_k_matches_brute_force():
  rng = np.random.default_rng(0)
  for s in (4, 6, 8):
    correct = (rng.random((7, s)) < rng.random((7, 1))).astype(np.float32)
    correct[0], correct[1] = 0, 1  # none and all correct
    result = H.EvalResult(correct=correct, boxed=np.ones_like(correct), records=[])
    summary = result.summary()
    assert summary["accuracy"] == pytest.approx(correct.mean())
    for k in (4, 8):
      if k > s:
        assert f"pass@{k}" not in summary
        continue
      expected = np.mean([brute_pass_at_k(row, k) for row in correct])
      assert summary[f"pass@{k}"] == pytest.approx(expected, abs=1e-12)


def _golds() -> dict[str, object]:
  names = ("amc23", "aime24", "minerva")
  return {n: load_benchmark(n, limit=1)[0] for n in names}


def test_scoring_layer_on_hand_made_completions():
  """Known completions of real problems -> exact Acc, Fmt, pass@k, records and table."""
  problems = _golds()
  amc, aime = problems["amc23"], problems["aime24"]
  assert amc.answer == "27"  # a JSON float in the file
  right = lambda p: f"So the answer is $\\boxed{{{p.answer}}}$."
  wrong = "So the answer is $\\boxed{123456}$."
  unboxed = f"The answer is {amc.answer}."
  completions = {
      # 3 right (one written 27.0), 4 wrong but boxed, 1 right but not boxed.
      "amc23": [[right(amc), "\\boxed{27.0}", right(amc)] + [wrong] * 4 + [unboxed]],
      "aime24": [[wrong] * 7 + [right(aime)]],  # 1 of 8
      "minerva": [[wrong] * 8],  # none
  }
  with RewardScorer(num_workers=0) as scorer:
    results = {n: H.score_completions([problems[n]], c, scorer) for n, c in completions.items()}
  np.testing.assert_array_equal(results["amc23"].correct, [[1, 1, 1, 0, 0, 0, 0, 0]])
  np.testing.assert_array_equal(results["amc23"].boxed, [[1, 1, 1, 1, 1, 1, 1, 0]])
  ks = H.table_ks(8)
  assert ks == (4, 8)
  metrics = {n: H.benchmark_metrics(r, ks=ks) for n, r in results.items()}
  pass4 = lambda c: 1 - math.comb(8 - c, 4) / math.comb(8, 4)
  expected = {"amc23": (3 / 8, 7 / 8, pass4(3), 1.0), "aime24": (1 / 8, 1.0, pass4(1), 1.0),
              "minerva": (0.0, 1.0, 0.0, 0.0)}
  for name, (acc, fmt, p4, p8) in expected.items():
    m = metrics[name]
    assert (m["accuracy"], m["format"]) == (pytest.approx(acc), pytest.approx(fmt)), name
    assert (m["pass@4"], m["pass@8"]) == (pytest.approx(p4), pytest.approx(p8)), name
    assert (m["problems"], m["samples"], m["skipped"]) == (1, 8, 0)
  assert metrics["amc23"]["check_status"] == {"fast": 7, "no_answer": 1}
  record = results["aime24"].records[7]
  assert record == {"problem_id": aime.id, "sample": 7, "completion": right(aime),
                    "extracted": aime.answer, "gold": aime.answer, "correct": True,
                    "boxed": True, "status": "fast"}
  average = H.average_metrics(metrics, ks)
  assert average["accuracy"] == pytest.approx((3 / 8 + 1 / 8 + 0) / 3)
  assert average["pass@4"] == pytest.approx((pass4(3) + pass4(1)) / 3)
  table = H.markdown_table(metrics, average, ks).splitlines()
  assert table[0] == "| Benchmark | Acc | Fmt | pass@4 | pass@8 | Problems | Skipped |"
  assert table[2] == f"| amc23 | 37.50 | 87.50 | {100 * pass4(3):.2f} | 100.00 | 1 | 0 |"
  assert table[4] == "| minerva | 0.00 | 100.00 | 0.00 | 0.00 | 1 | 0 |"
  assert table[5].startswith("| Average | 16.67 | 95.83 |")


def test_table_reports_skipped_and_empty_benchmarks():
  result = H.EvalResult(correct=np.array([[1.0, 0.0]]), boxed=np.array([[1.0, 1.0]]), records=[])
  metrics = {"a": H.benchmark_metrics(result, {"exceeds_context": 2}, ks=(4,)),
             "b": H.benchmark_metrics(None, {"prompt_too_long": 3}, ks=(4,))}
  assert metrics["a"]["pass@4"] is None  # 2 samples: no pass@4
  assert metrics["b"]["accuracy"] is None
  assert metrics["b"]["skipped_reasons"] == {"prompt_too_long": 3}
  average = H.average_metrics(metrics, (4,))
  assert (average["accuracy"], average["problems"], average["skipped"]) == (0.5, 1, 5)
  table = H.markdown_table(metrics, average, (4,)).splitlines()
  assert table[2:] == ["| a | 50.00 | 100.00 | – | 1 | 2 |", "| b | – | – | – | 0 | 3 |",
                       "| Average | 50.00 | 100.00 | – | 1 | 5 |"]
  assert H.skip_note(metrics, 4096, 300, 16) == (
      "Skipped prompts (not scored): a exceeds_context=2; b prompt_too_long=3 (model context "
      "4096 tokens, 16 kept for the completion, --max-prompt-tokens 300).")
  assert H.skip_note({"a": H.benchmark_metrics(result)}, 4096, 0, 16) == ""


def test_long_prompts_are_skipped_and_counted(qwen_tokenizer_dir):
  from epgrpo_jax.data.pipeline import DataConfig, PromptRenderer
  from epgrpo_jax.models import load_tokenizer
  renderer = PromptRenderer(load_tokenizer(qwen_tokenizer_dir),
                            DataConfig(prompt_template=H.EVAL_TEMPLATE))
  assert renderer.text("P").endswith("within \\boxed{}.<|im_end|>\n<|im_start|>assistant\n")
  problems = load_benchmark("aime25", limit=10)
  lengths = [len(renderer.ids(p.problem)) for p in problems]
  cut = sorted(lengths)[5]
  examples, skipped = H.render_examples(problems, renderer, max_new_tokens=16,
                                        context_tokens=10_000, max_prompt_tokens=cut)
  assert len(examples) == sum(n <= cut for n in lengths) and skipped == {
      "prompt_too_long": sum(n > cut for n in lengths)}
  examples, skipped = H.render_examples(problems, renderer, max_new_tokens=100,
                                        context_tokens=cut + 100)
  assert skipped == {"exceeds_context": sum(n > cut for n in lengths)}
  assert [e.id for e in examples] == [p.id for p, n in zip(problems, lengths) if n <= cut]
  assert all(len(e.prompt_ids) <= cut for e in examples)


# ----------------------------------------------------------------------------
# Training checkpoints


def save_run(run_dir: Path, model, *, full: bool, steps_to_save=(3, 7),
             config: dict | None = None):
  """A run directory as the trainer writes it: checkpoints/<step> with trainable,
  opt_state and key; config.yaml when `config` is given. Returns the saved trainable."""
  _, trainable, _ = nnx.split(model, nnx.Param if full else nnx.LoRAParam, ...)
  tx, _ = objective.make_optimizer(1e-3, 10, warmup_ratio=0.1, weight_decay=0.0, max_grad_norm=1.0)
  ckpt = Checkpointer(run_dir / "checkpoints", async_save=False)
  saved = None
  for i, step in enumerate(steps_to_save):
    saved = jax.tree.map(lambda x: x + i, trainable)  # each step differs; the last one is kept
    tree = {"trainable": saved, "opt_state": tx.init(saved),
            "key": jax.random.key_data(jax.random.key(step))}
    ckpt.save(step, tree, None, {"step": step})
  again = ckpt.restore_trainable(steps_to_save[-1], trainable)  # the saving instance reads too
  assert jax.tree.all(jax.tree.map(lambda x, y: bool(jnp.array_equal(x, y)), again, saved))
  ckpt.close()
  if config is not None:
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
  return saved


LORA = LoraConfig(rank=4, alpha=8.0, targets=("q", "v", "up"))
RUN_CONFIG = {"model": {"full_finetune": False},
              "lora": {"rank": 4, "alpha": 8.0, "targets": ["q", "v", "up"]}}


def set_adapters(model, std: float) -> None:
  """Random nonzero LoRA B matrices (numpy RNG: no per-shape jax compiles)."""
  for i, layer in enumerate(lora_layers(model)):
    value = np.random.default_rng(i).normal(0, std, layer.lora_b.shape)
    layer.lora_b[...] = jnp.asarray(value, jnp.float32)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("lora_run")
  model_dir = tiny_hf_dir(tmp)
  model = from_pretrained(model_dir, lora=LORA)
  set_adapters(model, 0.3)  # nonzero, as after training
  saved = save_run(tmp / "run", model, full=False, config=RUN_CONFIG)
  return model_dir, tmp / "run", saved


def test_restore_lora_checkpoint(lora_run):
  model_dir, run_dir, saved = lora_run
  for where in (run_dir, run_dir / "checkpoints", run_dir / "checkpoints" / "7"):
    ref = C.resolve_checkpoint(where)
    assert (ref.step, ref.run_dir, ref.full_finetune) == (7, run_dir, False)
    assert (ref.lora_rank, ref.lora_targets) == (4, ("q", "v", "up"))
  assert C.resolve_checkpoint(run_dir / "checkpoints" / "3").step == 3
  assert C.checkpoint_lora(ref, None, None) == LORA
  restored = C.load_policy(model_dir, checkpoint=ref, lora=LORA)
  # The reference: the base model with the saved adapters, not merged.
  expected = from_pretrained(model_dir, lora=LORA)
  graphdef, _, rest = nnx.split(expected, nnx.LoRAParam, ...)
  expected = nnx.merge(graphdef, saved, rest)
  base = from_pretrained(model_dir)
  pairs = list(zip(lora_layers(restored), lora_layers(expected)))
  assert len(pairs) == 2 * 3  # 2 layers x (q, v, up)
  for got, want in pairs:
    assert got.merged and not want.merged
    np.testing.assert_array_equal(got.lora_b[...], want.lora_b[...])
    np.testing.assert_allclose(got.base.kernel[...], folded_kernel(want), atol=1e-6)
    assert np.abs(want.delta()).max() > 1e-2  # the adapters do change the kernels
  def kernels(m):
    return [k for p, k in nnx.to_flat_state(nnx.state(m, nnx.Param)) if p[-1] == "kernel"]
  changed = [not np.array_equal(x[...], y[...]) for x, y in zip(kernels(restored), kernels(base))]
  assert sum(changed) == 6
  # The Checkpointer method and the read-only function agree.
  abstract = nnx.split(from_pretrained(model_dir, lora=LORA), nnx.LoRAParam, ...)[1]
  ckpt = Checkpointer(run_dir / "checkpoints", async_save=False)
  a = ckpt.restore_trainable(7, abstract)
  ckpt.close()
  b = restore_trainable(run_dir / "checkpoints", 7, abstract)
  same = lambda x, y, z: bool(jnp.array_equal(x, y) and jnp.array_equal(x, z))
  assert jax.tree.all(jax.tree.map(same, a, b, saved))


def test_a_checkpoint_of_another_model_is_refused_naming_the_array(lora_run, tmp_path):
  _, run_dir, _ = lora_run
  wider = tiny_hf_dir(tmp_path, name="wider", intermediate_size=96)
  with pytest.raises(ValueError) as err:
    C.load_policy(wider, checkpoint=C.resolve_checkpoint(run_dir), lora=LORA)
  assert str(err.value) == (
      f"--checkpoint {run_dir / 'checkpoints' / '7'}: does not fit the model in {wider} "
      "(layers.0.mlp.up.lora_b is saved with shape (4, 64), expected (4, 96)); "
      "is --model the run's base model?")


def test_lora_settings_without_run_config(lora_run, tmp_path):
  model_dir, run_dir, _ = lora_run
  bare = tmp_path / "bare"
  (bare / "checkpoints").mkdir(parents=True)
  os.symlink(run_dir / "checkpoints" / "7", bare / "checkpoints" / "7")
  ref = C.resolve_checkpoint(bare)
  assert ref.run_config is None
  with pytest.raises(ValueError, match="--lora-alpha"):
    C.checkpoint_lora(ref, None, None)
  assert C.checkpoint_lora(ref, None, 8.0) == LORA  # rank and targets from the saved shapes
  with pytest.raises(ValueError, match="rank 4"):
    C.checkpoint_lora(ref, 8, 8.0)


def test_restore_full_finetune_checkpoint(tmp_path):
  model_dir = tiny_hf_dir(tmp_path)
  model = from_pretrained(model_dir)
  saved = save_run(tmp_path / "run", model, full=True, steps_to_save=(5,),
                   config={"model": {"full_finetune": True}, "lora": {"rank": 32, "alpha": 64}})
  ref = C.resolve_checkpoint(tmp_path / "run")
  assert ref.full_finetune and C.checkpoint_lora(ref, None, None) is None
  restored = C.load_policy(model_dir, checkpoint=ref)
  got = nnx.split(restored, nnx.Param, ...)[1]
  assert jax.tree.all(jax.tree.map(lambda x, y: bool(jnp.array_equal(x, y)), got, saved))


# ----------------------------------------------------------------------------
# Bad input: one line on stderr, exit 2


def _one_line_exit_2(code, capsys, *needles):
  err = capsys.readouterr().err.strip()
  assert code == 2, err
  assert len(err.splitlines()) == 1 and "Traceback" not in err, err
  for n in needles:
    assert n in err, err


def test_cli_unknown_benchmark_subprocess():
  proc = subprocess.run([sys.executable, "-m", "epgrpo_jax.evaluate", "--model", "x",
                         "--benchmarks", "math500,gsm9k"], capture_output=True, text=True,
                        cwd=REPO, timeout=120)
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines() == [
      "python -m epgrpo_jax.evaluate: error: benchmark 'gsm9k': unknown; known: math500, amc23, "
      "minerva, aime24, aime25"]


def test_cli_bad_model_dir_subprocess(tmp_path):
  proc = subprocess.run([sys.executable, "-m", "epgrpo_jax.evaluate", "--model",
                         str(tmp_path / "nope")], capture_output=True, text=True, cwd=REPO,
                        timeout=120)
  assert proc.returncode == 2
  expected = f"error: --model {tmp_path / 'nope'}: not a directory"
  assert proc.stderr.strip().splitlines() == [expected]


def test_cli_bad_inputs(lora_run, tmp_path, capsys, monkeypatch):
  model_dir, run_dir, _ = lora_run
  monkeypatch.delenv("EPGRPO_DATA_DIR", raising=False)
  monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
  cases = [
      (["--model", str(model_dir), "--benchmarks", "aime24", "--benchmark-file",
        f"aime24={tmp_path / 'missing.jsonl'}", "--max-new-tokens", "16"],
       (f"benchmark 'aime24': file not found: {tmp_path / 'missing.jsonl'}",)),
      (["--model", str(model_dir), "--benchmark-file", "aime24"], ("expected NAME=PATH",)),
      (["--model", str(model_dir), "--benchmarks", "amc23", "--benchmark-file", "aime24=x.jsonl"],
       ("aime24 is not in --benchmarks",)),
      (["--model", str(model_dir), "--max-new-tokens", "256"], ("leaves no room",)),
      (["--model", str(tmp_path)], ("no config.json",)),
      (["--model", str(model_dir), "--samples", "0"], ("--samples", "must be >= 1")),
      (["--model", str(model_dir), "--checkpoint", str(tmp_path / "missing")], ("not found",)),
      (["--model", str(model_dir), "--checkpoint", str(tmp_path)],
       ("no checkpoint step directory",)),
      (["--model", str(model_dir), "--checkpoint", str(model_dir)], ("pass it as --model",)),
      (["--model", str(model_dir), "--checkpoint", str(run_dir), "--lora-rank", "8"],
       ("adapters of rank 4",)),
      (["--checkpoint", str(run_dir)], ("--model: required",)),
  ]
  for argv, needles in cases:
    _one_line_exit_2(_main(argv), capsys, *needles)


def _main(argv: list[str]) -> int:
  """`evaluate.main` in-process; argparse errors exit through SystemExit."""
  try:
    return E.main(argv)
  except SystemExit as e:
    return e.code


# ----------------------------------------------------------------------------
# End to end


@pytest.mark.slow
def test_end_to_end_tiny_model_on_five_benchmarks(tmp_path, capsys, monkeypatch,
                                                  qwen_tokenizer_dir):
  """A random 2-layer, hidden-32 model with the real Qwen tokenizer and a LoRA
  checkpoint; 10 problems of each benchmark (by name: the shipped copies) x 4
  samples x 16 new tokens."""
  monkeypatch.delenv(DATA_DIR_ENV, raising=False)
  overrides = dict(tie_word_embeddings=True, max_position_embeddings=4096)
  model_dir = tiny_hf_dir(tmp_path, tokenizer=qwen_tokenizer_dir, **overrides)
  model = from_pretrained(model_dir, lora=LORA)
  set_adapters(model, 0.1)
  save_run(tmp_path / "run", model, full=False, steps_to_save=(2,),
           config={**RUN_CONFIG, "model": {"full_finetune": False, "path": str(model_dir)}})
  out = tmp_path / "out"
  code = E.main(["--checkpoint", str(tmp_path / "run"), "--benchmarks", ",".join(NAMES),
                 "--limit", "10", "--samples", "4",
                 "--max-new-tokens", "16", "--out", str(out), "--seed", "1"])
  printed = capsys.readouterr().out
  assert code == 0

  table = (out / "results.md").read_text()
  assert "| Benchmark | Acc | Fmt | pass@4 | Problems | Skipped |" in table
  assert "pass@8" not in table
  for name in (*NAMES, "Average"):
    assert f"| {name} |" in table and f"| {name} |" in printed

  results = json.loads((out / "results.json").read_text())
  assert list(results["benchmarks"]) == list(NAMES)
  for name, m in [*results["benchmarks"].items(), ("Average", results["average"])]:
    for key in ("accuracy", "format", "pass@4"):
      assert 0.0 <= m[key] <= 1.0, (name, key)
    assert m["skipped"] == 0
  assert results["average"]["problems"] == 50
  cfg = results["config"]
  assert (cfg["checkpoint_step"], cfg["samples"], cfg["max_new_tokens"]) == (2, 4, 16)
  assert cfg["lora"] == {"rank": 4, "alpha": 8.0, "targets": ["q", "v", "up"]}
  assert cfg["model"] == str(model_dir)
  assert cfg["benchmark_files"] == {n: str(shipped_file(get_spec(n))) for n in NAMES}

  records = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
  assert len(records) == 200
  fields = {"benchmark", "problem_id", "sample", "completion", "extracted", "gold", "correct",
            "boxed", "status", "num_tokens", "finished"}
  assert all(set(r) == fields for r in records)
  for name in NAMES:
    mine = [r for r in records if r["benchmark"] == name]
    problems = load_benchmark(name, limit=10)
    assert [(r["problem_id"], r["sample"]) for r in mine] == [
        (p.id, s) for p in problems for s in range(4)]
    assert [r["gold"] for r in mine[::4]] == [p.answer for p in problems]
    acc = np.mean([r["correct"] for r in mine])
    assert results["benchmarks"][name]["accuracy"] == pytest.approx(acc)
    assert all(1 <= r["num_tokens"] <= 16 for r in mine)


def _files(directory: Path) -> dict[str, bytes]:
  return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def test_an_interrupted_evaluation_leaves_the_earlier_one_whole(tmp_path, capsys, monkeypatch,
                                                                qwen_tokenizer_dir):
  monkeypatch.delenv(DATA_DIR_ENV, raising=False)
  model_dir = tiny_hf_dir(tmp_path, tokenizer=qwen_tokenizer_dir, max_position_embeddings=4096)
  out = tmp_path / "out"
  argv = ["--model", str(model_dir), "--benchmarks", "amc23,aime24", "--limit", "2",
          "--samples", "1", "--max-new-tokens", "8", "--out", str(out), "--no-progress"]
  assert E.main(argv) == 0
  before = _files(out)
  assert set(before) == {"results.md", "results.json", "samples.jsonl"}

  calls = []
  real = E.evaluate_examples

  def interrupted(*args, **kwargs):  # Ctrl-C during the second benchmark
    calls.append(1)
    if len(calls) == 2:
      raise KeyboardInterrupt
    return real(*args, **kwargs)

  monkeypatch.setattr(E, "evaluate_examples", interrupted)
  assert E.main(argv + ["--seed", "7"]) == 130
  assert len(calls) == 2
  after = _files(out)
  assert {k: v for k, v in after.items() if not k.startswith(".")} == before
  monkeypatch.setattr(E, "evaluate_examples", real)
  assert E.main(argv) == 0  # the next run clears the interrupted one's temporary file
  before = _files(out)
  assert set(before) == {"results.md", "results.json", "samples.jsonl"}
  capsys.readouterr()

  # A benchmark with no usable row stops before the model loads, where it used to be averaged out.
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"problem": "What is 1+1?"}\n{"answer": "2"}\n')
  code = _main(["--model", str(model_dir), "--benchmarks", "amc23,aime24",
                "--benchmark-file", f"aime24={bad}", "--out", str(out)])
  err = capsys.readouterr().err.strip().splitlines()  # the loader's warning, then the error
  assert code == 2 and "Traceback" not in "\n".join(err)
  assert err[-1] == (f"error: --benchmarks aime24: no usable problem in {bad} (skipped: "
                     "missing_answer=1, missing_problem=1)")
  assert _files(out) == before
