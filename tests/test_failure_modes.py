"""A catalogue of bad inputs: each gives one exact error line (exit 2, no traceback) or a counted skip."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from epgrpo_jax import train as train_cli
from epgrpo_jax.data import pipeline as data
from epgrpo_jax.rewards import RewardScorer
from epgrpo_jax.tasks import arithmetic
from helpers import WhitespaceTokenizer

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
  return arithmetic.build_assets(tmp_path_factory.mktemp("arith"), seed=0, train_per_level=20,
                                 heldout_per_level=2, verbose=False)


def run_cli(capsys, *argv: str) -> tuple[int, str]:
  code = train_cli.main(list(argv))
  err = capsys.readouterr().err.strip().splitlines()
  errors = [l for l in err if l.startswith("error:") or "Traceback" in l]
  assert not any("Traceback" in l for l in err)
  return code, errors[-1] if errors else ""


def _tree(directory: Path) -> dict[str, bytes]:
  return {str(f.relative_to(directory)): f.read_bytes() for f in sorted(directory.rglob("*"))
          if f.is_file()}


@pytest.fixture
def untouched_cwd(tmp_path, monkeypatch):
  """Runs the test in a directory holding a user's config.yaml and an earlier run under the
  default train.output_dir, and checks afterwards that nothing there changed or appeared."""
  cwd = tmp_path / "cwd"
  (cwd / "runs" / "default" / "checkpoints" / "5").mkdir(parents=True)
  (cwd / "config.yaml").write_text("train: {steps: 7}\n")
  (cwd / "runs" / "default" / "config.yaml").write_text("train: {steps: 5}\n")
  (cwd / "runs" / "default" / "metrics.jsonl").write_text('{"step": 5, "reward": 0.5}\n')
  (cwd / "runs" / "default" / "checkpoints" / "5" / "state").write_bytes(b"\x00" * 64)
  monkeypatch.chdir(cwd)
  before = _tree(cwd)
  yield cwd
  assert _tree(cwd) == before


# (overrides, expected error line). Each is checked before any model or data is loaded.
CONFIG_CASES = [
    (["train.steps=abc"], "error: train.steps: expected an integer, got 'abc'"),
    (["train.stepz=3"], "error: train.stepz: unknown key (did you mean train.steps?)"),
    (["foo.bar=1"], "error: foo: unknown key"),
    (["train.steps=0"], "error: train.steps: must be > 0, got 0"),
    (["optim.learning_rate=-1"], "error: optim.learning_rate: must be > 0, got -1.0"),
    (["optim.warmup_ratio=1.5"], "error: optim.warmup_ratio: must be in [0, 1), got 1.5"),
    (["train.num_generations=1"], "error: train.num_generations: GRPO-family advantages need G >= 2 "
                                  "responses per prompt, got 1"),
    (["train.mini_batches=3"], "error: train.mini_batches: 3 does not divide the 64 sequences of a step"),
    (["lora.rank=0"], "error: lora.rank: must be > 0, got 0"),
    (["lora.targets=[q,x]"], "error: lora.targets: unknown ['x']; choose from "
                             "['q', 'k', 'v', 'o', 'gate', 'up', 'down']"),
    (["advantage.num_buckets=0"], "error: advantage.num_buckets: must be >= 1, got 0"),
    (["advantage.gamma=-1"], "error: advantage.gamma: must be a number > 0, got -1.0"),
    (["advantage.entropy_gate=maybe"], "error: advantage.entropy_gate: expected true or false, got 'maybe'"),
    (["sampling.top_p=1.5"], "error: sampling.top_p: must be in (0, 1], got 1.5"),
    (["loss.aggregation=foo"], "error: loss.aggregation: unknown 'foo'; use one of "
                               "('token_mean', 'seq_mean_token_mean', 'seq_sum_max_len')"),
    (["loss.eps_low=1.5"], "error: loss.eps_low: must be in [0, 1), got 1.5"),
    (["model.dtype=float64"], "error: model.dtype: must be float32 or bfloat16, got 'float64'"),
    (["model.path=/nonexistent-dir"], "error: model.path: not a directory: /nonexistent-dir"),
    (["data.train_files=[/nope.jsonl]"], "error: data.train_files: file not found: /nope.jsonl"),
    (["data.heldout_file=math501"], "error: data.heldout_file: 'math501' is neither a file nor a "
                                    "known data set (simplelr_math_l3to5, math500, amc23, minerva, "
                                    "aime24, aime25)"),
    (["data.prompt_template=no placeholder"], "error: data.prompt_template: must contain {problem}"),
    (["checkpoint.keep=0"], "error: checkpoint.keep: must be > 0, got 0"),
    (["eval.top_p=0"], "error: eval.top_p: must be in (0, 1], got 0.0"),
    (["reward.fallback=bogus"], "error: reward.fallback: must be one of ('none', 'answer_is', "
                                "'last_number', 'any'), got 'bogus'"),
    (["train.steps"], "error: override 'train.steps': expected key=value, e.g. train.steps=100"),
    (["mesh.data=3"], "error: mesh: data*fsdp*tensor = 3 but there are 8 devices"),
    (["train.output_dir=/proc/epgrpo-run"], None),  # checked below: starts with the field name
    (["optim.learning_rate=.nan"], "error: optim.learning_rate: must be a finite number, got nan"),
    (["optim.learning_rate=.inf"], "error: optim.learning_rate: must be a finite number, got inf"),
    (["optim.max_grad_norm=.nan"], "error: optim.max_grad_norm: must be a finite number, got nan"),
    (["advantage.gamma=inf"], "error: advantage.gamma: must be a finite number, got 'inf'"),
    (["loss.beta=-.inf"], "error: loss.beta: must be a finite number, got -inf"),
    (["train.output_dir="], "error: train.output_dir: empty (an unset shell variable?); name a "
                            "directory"),
    (["rollout.max_staleness=-1"], "error: rollout.max_staleness: must be >= 0, got -1"),
    (["rollout.max_staleness=1", "rollout.devices=8"], "error: rollout.devices: 8 leaves no device "
                                                       "for training (there are 8)"),
    (["train.seed=-1"], "error: train.seed: must be in [0, 2**32), got -1"),
    (["train.seed=4294967296"], "error: train.seed: must be in [0, 2**32), got 4294967296"),
    (["train.steps=99999999999999999999"], "error: train.steps: out of the 64-bit integer range, "
                                           "got 99999999999999999999"),
]


@pytest.mark.parametrize("overrides,expected", CONFIG_CASES, ids=[c[0][0] for c in CONFIG_CASES])
@pytest.mark.usefixtures("untouched_cwd")
def test_config_errors(capsys, overrides, expected):
  code, line = run_cli(capsys, *overrides)
  assert code == 2
  if expected is None:
    assert line.startswith("error: train.output_dir: not writable: /proc/epgrpo-run"), line
  else:
    assert line == expected


@pytest.mark.usefixtures("untouched_cwd")
def test_config_file_errors(capsys, tmp_path):
  code, line = run_cli(capsys, "--config", str(tmp_path / "missing.yaml"))
  assert (code, line) == (2, f"error: --config: file not found: {tmp_path / 'missing.yaml'}")
  bad = tmp_path / "bad.yaml"
  bad.write_text("train: {steps: 3\n")
  code, line = run_cli(capsys, "--config", str(bad))
  assert code == 2 and line.startswith(f"error: {bad}: invalid YAML")
  listy = tmp_path / "list.yaml"
  listy.write_text("- 1\n- 2\n")
  code, line = run_cli(capsys, "--config", str(listy))
  assert (code, line) == (2, f"error: {listy}: top level must be a mapping of sections")
  missing_base = tmp_path / "child.yaml"
  missing_base.write_text("base: nowhere.yaml\n")
  code, line = run_cli(capsys, "--config", str(missing_base))
  assert (code, line) == (2, f"error: --config: file not found: {tmp_path / 'nowhere.yaml'}")
  cases = {
      "number.yaml": ("3\n", "top level must be a mapping of sections"),
      "loop_a.yaml": ("base: loop_b.yaml\n", "base: loop_a.yaml makes a loop (loop_a.yaml -> "
                                              "loop_b.yaml -> loop_a.yaml)"),
      "loop_b.yaml": ("base: loop_a.yaml\n", None),
      "self.yaml": ("base: self.yaml\n", "base: self.yaml makes a loop (self.yaml -> self.yaml)"),
      "base_number.yaml": ("base: 3\n", "base: must be a file name, got 3"),
      "twice.yaml": ("train: {steps: 1}\ntrain: {steps: 2}\n", "key 'train' given twice (line 2)"),
  }
  for name, (text, _) in cases.items():
    (tmp_path / name).write_text(text)
  for name, (_, expected) in cases.items():
    if expected is None:
      continue
    code, line = run_cli(capsys, "--config", str(tmp_path / name))
    where = tmp_path / ("loop_b.yaml" if name == "loop_a.yaml" else name)
    assert (code, line) == (2, f"error: {where}: {expected}"), line
  latin = tmp_path / "latin1.yaml"
  latin.write_bytes(b"train: {output_dir: caf\xe9}\n")
  assert run_cli(capsys, "--config", str(latin)) == (2, f"error: {latin}: not UTF-8 text")


def test_unknown_flag_is_a_usage_error(capsys):
  with pytest.raises(SystemExit) as e:
    train_cli.main(["--bogus"])
  assert e.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "unrecognized arguments: --bogus" in err[0]


def _run_args(task, tmp_path, *extra):
  return [f"model.path={task.model_dir}", f"data.train_files=[{task.train_file}]",
          "data.prompt_template={problem}", f"train.output_dir={tmp_path / 'run'}",
          "logging.progress=false", *extra]


def test_model_dir_errors_name_the_file(capsys, task, tmp_path):
  broken = tmp_path / "model"
  shutil.copytree(task.model_dir, broken)
  (broken / "model.safetensors").write_bytes(b"not a safetensors file")
  code, line = run_cli(capsys, *_run_args(task, tmp_path, f"model.path={broken}"))
  assert code == 2 and line.startswith(f"error: {broken / 'model.safetensors'}: unreadable"), line

  (broken / "model.safetensors").unlink()
  code, line = run_cli(capsys, *_run_args(task, tmp_path, f"model.path={broken}"))
  assert code == 2 and line == (f"error: {broken}: no model.safetensors or "
                                "model.safetensors.index.json"), line

  shutil.copyfile(task.model_dir / "model.safetensors", broken / "model.safetensors")
  cfg = json.loads((broken / "config.json").read_text())
  cfg["intermediate_size"] += 1
  (broken / "config.json").write_text(json.dumps(cfg))
  code, line = run_cli(capsys, *_run_args(task, tmp_path, f"model.path={broken}"))
  assert code == 2 and "model.layers.0.mlp.gate_proj.weight" in line and "shape" in line, line
  assert line.startswith(f"error: {broken / 'model.safetensors'}: tensor")

  cfg["intermediate_size"] -= 1
  cfg["model_type"] = "gemma"
  (broken / "config.json").write_text(json.dumps(cfg))
  code, line = run_cli(capsys, *_run_args(task, tmp_path, f"model.path={broken}"))
  assert (code, line) == (2, f"error: {broken / 'config.json'}: model_type: unsupported 'gemma'; "
                             "known: llama, qwen2, qwen3")

  cfg["model_type"] = "qwen2"
  (broken / "config.json").write_text(json.dumps(cfg))
  (broken / "tokenizer.json").unlink()
  code, line = run_cli(capsys, *_run_args(task, tmp_path, f"model.path={broken}"))
  assert code == 2 and line.startswith("error: ") and str(broken / "tokenizer.json") in line, line


def test_no_usable_row_is_an_error(capsys, task, tmp_path):
  empty = tmp_path / "empty.jsonl"
  empty.write_text('{"question": "1+1"}\n')
  code, line = run_cli(capsys, *_run_args(task, tmp_path, f"data.train_files=[{empty}]"))
  assert code == 2
  assert line == (f"error: {empty}: no usable row (skipped: missing_problem=1; fields "
                  "data.problem_field='problem', data.answer_field='answer')")


def test_bad_rows_are_skipped_and_counted(tmp_path):
  path = tmp_path / "rows.jsonl"
  lines = [
      json.dumps({"problem": "What is 1+1?", "answer": "2"}).encode(),
      b'{"problem": "broken json", ',
      b'{"problem": "\xff\xfe not utf-8", "answer": "1"}',
      json.dumps(["not", "an", "object"]).encode(),
      json.dumps({"answer": "3"}).encode(),
      json.dumps({"problem": "no answer"}).encode(),
      json.dumps({"problem": "   ", "answer": "4"}).encode(),
      json.dumps({"problem": "empty answer", "answer": ""}).encode(),
      json.dumps({"problem": " ".join(["word"] * 50), "answer": "5"}).encode(),
      json.dumps({"problem": "unparsable gold", "answer": "\\frac{"}).encode(),
      json.dumps({"problem": "What is 2+2?", "answer": 4.0}).encode(),
      b"",
  ]
  path.write_bytes(b"\n".join(lines))
  cfg = data.DataConfig(prompt_template="{problem}", max_prompt_tokens=20)
  renderer = data.PromptRenderer(WhitespaceTokenizer(), cfg)
  examples, skips = data.load_examples([path], renderer, cfg, answer_ok=lambda a: a != "\\frac{")
  assert [(e.problem, e.answer) for e in examples] == [("What is 1+1?", "2"), ("What is 2+2?", "4")]
  assert dict(skips) == {"bad_json": 1, "not_utf8": 1, "not_an_object": 1, "missing_problem": 1,
                         "missing_answer": 1, "empty_problem": 1, "empty_answer": 1,
                         "prompt_too_long": 1, "unparsable_answer": 1}


def test_rows_that_are_not_text_or_not_parsable_are_skipped_with_the_real_checks(tmp_path):
  from epgrpo_jax.training.build import answer_parses
  path = tmp_path / "rows.jsonl"
  lines = [
      json.dumps({"problem": "What is 1+1?", "answer": "2"}),
      json.dumps({"problem": "a list answer", "answer": [1, 2]}),
      json.dumps({"problem": {"text": "an object problem"}, "answer": "3"}),
      json.dumps({"problem": "a bool answer", "answer": True}),
      json.dumps({"problem": "unparsable gold", "answer": "\\frac{"}),
      json.dumps({"problem": "unclosed box", "answer": "\\boxed{3"}),
      json.dumps({"problem": "What is half?", "answer": "\\frac{1}{2}"}),
  ]
  # A UTF-8 byte-order mark before the first row is not part of it.
  path.write_bytes(b"\xef\xbb\xbf" + "\n".join(lines).encode())
  cfg = data.DataConfig(prompt_template="{problem}")
  examples, skips = data.load_examples([path], data.PromptRenderer(WhitespaceTokenizer(), cfg), cfg,
                                       answer_ok=answer_parses)
  assert [e.answer for e in examples] == ["2", "\\frac{1}{2}"]
  assert dict(skips) == {"answer_not_text": 2, "problem_not_text": 1, "unparsable_answer": 2}


def _raising_checker(answer: str, gold: str) -> bool:
  raise RuntimeError("checker bug")


def test_a_raising_reward_check_scores_zero_and_is_counted():
  with RewardScorer(num_workers=0, checker=_raising_checker) as scorer:
    result = scorer.score(["\\boxed{x^2}", "\\boxed{2}"], ["x**2 + 0", "2"])
  assert result.accuracy.tolist() == [0.0, 1.0]  # the second is decided by the fast path
  assert result.errors == 1 and result.status[0] == "error"


def test_cli_error_has_no_traceback_in_a_real_process(tmp_path):
  env = dict(os.environ, EPGRPO_COMPILATION_CACHE="")
  proc = subprocess.run([sys.executable, "-m", "epgrpo_jax.train", "train.steps=-5"], cwd=REPO,
                        capture_output=True, text=True, env=env, timeout=120)
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines()[-1] == "error: train.steps: must be > 0, got -5"
  assert "Traceback" not in proc.stderr
  debug = subprocess.run([sys.executable, "-m", "epgrpo_jax.train", "--debug", "train.steps=-5"],
                         cwd=REPO, capture_output=True, text=True, env=env, timeout=120)
  assert debug.returncode == 2 and "Traceback" in debug.stderr


def test_a_bug_inside_a_step_keeps_its_traceback(capsys, task, tmp_path, monkeypatch):
  # A ValueError from inside the step is a bug, not bad input: `main` lets it propagate (the
  # interpreter then prints the traceback and exits 1), where it used to become exit 2.
  from epgrpo_jax.training import trainer as trainer_mod

  def broken_step(self, *args, **kwargs):
    raise ValueError("operands could not be broadcast together")

  monkeypatch.setattr(trainer_mod.Trainer, "step", broken_step)
  with pytest.raises(ValueError, match="could not be broadcast"):
    train_cli.main(_run_args(task, tmp_path, "train.steps=2", "eval.every=0"))


def test_model_dir_value_errors_name_the_file_and_key(capsys, task, tmp_path):
  broken = tmp_path / "model"
  shutil.copytree(task.model_dir, broken)
  good = json.loads((broken / "config.json").read_text())
  cases = [([1, 2], "expected a JSON object, got list"),
           ({**good, "hidden_size": "32"}, "hidden_size: expected an integer, got '32'"),
           ({**good, "num_hidden_layers": True}, "num_hidden_layers: expected an integer, got True"),
           ({**good, "rope_theta": None}, "rope_theta, rms_norm_eps: must be numbers")]
  for cfg, expected in cases:
    (broken / "config.json").write_text(json.dumps(cfg))
    code, line = run_cli(capsys, *_run_args(task, tmp_path, f"model.path={broken}"))
    assert code == 2 and line.startswith(f"error: {broken / 'config.json'}: {expected}"), line
  (broken / "config.json").write_text(json.dumps(good))
  tok_cfg = json.loads((broken / "tokenizer_config.json").read_text())
  tok_cfg["chat_template"] = "{% for m in messages %}{{ m.content | nosuchfilter }}{% endfor %}"
  (broken / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
  code, line = run_cli(capsys, *_run_args(task, tmp_path, f"model.path={broken}",
                                          "data.use_chat_template=true"))
  assert code == 2 and "tokenizer_config.json: the chat template cannot render a prompt" in line, line


@pytest.mark.parametrize("name,kind", [("policy", "file"), ("checkpoints", "file"),
                                       ("metrics.jsonl", "dir"), ("summary.json", "dir")])
def test_outputs_of_the_wrong_kind_stop_the_run_before_the_model_loads(capsys, task, tmp_path,
                                                                       monkeypatch, name, kind):
  """A file where the run writes a directory (or the reverse) is named at start, not when the run
  writes it at its end; it is left as it was."""
  from epgrpo_jax.training import trainer as trainer_mod
  run_dir = tmp_path / "run"
  run_dir.mkdir()
  if kind == "file":
    (run_dir / name).write_text("a user's file\n")
  else:
    (run_dir / name).mkdir()
    (run_dir / name / "note.txt").write_text("a user's file\n")
  before = _tree(run_dir)

  def no_load(*args, **kwargs):
    raise AssertionError("the model loaded before the output paths were checked")

  monkeypatch.setattr(trainer_mod, "from_pretrained", no_load)
  code, line = run_cli(capsys, *_run_args(task, tmp_path, f"train.output_dir={run_dir}"))
  what = ("exists and is not a directory" if kind == "file" else "is a directory")
  assert code == 2 and line.startswith(f"error: train.output_dir: {run_dir / name} {what}"), line
  assert _tree(run_dir) == before


def test_evaluate_out_with_a_results_file_of_the_wrong_kind(tmp_path, task):
  out = tmp_path / "eval"
  (out / "results.json").mkdir(parents=True)
  proc = subprocess.run([sys.executable, "-m", "epgrpo_jax.evaluate", "--model", str(task.model_dir),
                         "--benchmarks", "amc23", "--limit", "1", "--max-new-tokens", "16",
                         "--out", str(out)],
                        cwd=REPO, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr
  assert proc.stderr.strip().splitlines()[-1] == (
      f"error: --out: {out / 'results.json'} is a directory (it is written as a file); move it "
      f"away"), proc.stderr
  assert "Traceback" not in proc.stderr


def test_equal_ids_and_file_names_keep_each_rows_own_answer(task, tmp_path):
  """Two training files of the same name in different folders, a held-out file named like them,
  and a `data.id_field` whose values repeat: every example is rewarded against its own answer
  (gold answers were once looked up by id, and rows got another row's answer)."""
  from epgrpo_jax.training.config import TrainConfig
  from epgrpo_jax.training.trainer import Trainer
  files = {}
  for folder, answers in (("a", ("12", "13")), ("b", ("34", "35")), ("heldout", ("56", "57"))):
    (tmp_path / folder).mkdir()
    files[folder] = tmp_path / folder / "train.jsonl"
    files[folder].write_text("".join(json.dumps({"uid": 7, "problem": f"1 + {a} = ?", "answer": a})
                                     + "\n" for a in answers))
  cfg = TrainConfig().override(
      f"model.path={task.model_dir}", f"data.train_files=[{files['a']},{files['b']}]",
      f"data.heldout_file={files['heldout']}", "data.id_field=uid", "data.prompt_template={problem}",
      "train.prompts_per_step=4", "train.num_generations=2", f"train.output_dir={tmp_path / 'run'}",
      "logging.progress=false")
  trainer = Trainer(cfg)
  try:
    examples = trainer.train_examples + trainer.heldout
    assert sorted(e.answer for e in examples) == ["12", "13", "34", "35", "56", "57"]
    for e in examples:
      assert e.problem == f"1 + {e.answer} = ?"
      assert trainer.gold(e).raw == e.answer
      assert trainer.scorer.score([f"\\boxed{{{e.answer}}}"], [trainer.gold(e)]).reward[0] == 1.0
  finally:
    trainer.close()


@pytest.fixture
def tool_paths(tmp_path):
  """A run directory with a metrics line and a dumped group, a file and a directory in the way."""
  run = tmp_path / "run"
  run.mkdir()
  (run / "metrics.jsonl").write_text('{"step": 1, "reward": 0.5}\n{"step": 2, "reward": 0.7}\n')
  response = {"reward": 1.0, "token_ids": [1, 2], "tokens": ["a", "b"], "advantage": [0.1, 0.2]}
  (run / "samples.jsonl").write_text(json.dumps({"step": 2, "group": 0, "responses": [response]}) + "\n")
  (tmp_path / "a_file").write_text("mine\n")
  (tmp_path / "a_dir").mkdir()
  return tmp_path


# (command module, arguments, expected error line); {t} is the test's directory.
TOOL_CASES = [
    ("tools.plot", ["{t}/run", "--out", "{t}/a_file"], "error: --out {t}/a_file: exists and is not a directory"),
    ("tools.plot", ["{t}/run", "--out", "{t}/a_file/plots"],
     "error: --out {t}/a_file/plots: cannot create (Not a directory)"),
    ("tools.plot", ["{t}/no_run"], "error: {t}/no_run: no metrics.jsonl (not a run directory?)"),
    ("tools.plot", ["{t}/a_file"], "error: {t}/a_file: no metrics.jsonl (not a run directory?)"),
    ("tools.heatmap", ["{t}/run", "--out", "{t}/a_dir"],
     "error: --out {t}/a_dir: is a directory; name the file to write"),
    ("tools.heatmap", ["{t}/run", "--out", "{t}/a_file/page.html"],
     "error: --out {t}/a_file: exists and is not a directory"),
    ("tools.heatmap", ["{t}/no_run"], "error: {t}/no_run/samples.jsonl: not found (the run dumps "
                                      "samples every logging.samples_every steps)"),
    ("tools.heatmap", ["{t}/run", "--step", "7"], "error: --step 7: no samples at that step; steps with "
                                                  "samples: 2"),
    ("tools.heatmap", ["--checkpoint", "{t}/no_run"],
     "error: --checkpoint {t}/no_run: no config.yaml (not a run directory)"),
    ("experiments.compare", ["--report-only", "--out", "{t}/a_file"],
     "error: --out {t}/a_file: exists and is not a directory"),
]


@pytest.mark.parametrize("module,argv,expected", TOOL_CASES)
def test_tools_give_one_line_errors_with_exit_2(tool_paths, capsys, module, argv, expected):
  import importlib
  main = importlib.import_module(f"epgrpo_jax.{module}").main
  before = _tree(tool_paths)
  code = main([a.format(t=tool_paths) for a in argv])
  err = capsys.readouterr().err
  assert (code, err) == (2, expected.format(t=tool_paths) + "\n")
  assert _tree(tool_paths) == before  # nothing written, nothing in the way changed


def test_a_tool_error_is_one_line_in_a_real_process(tool_paths):
  proc = subprocess.run([sys.executable, "-m", "epgrpo_jax.tools.plot", "run", "--out", "a_file"],
                        cwd=tool_paths, capture_output=True, text=True, timeout=120,
                        env=dict(os.environ, MPLCONFIGDIR=str(tool_paths / "mpl")))
  assert (proc.returncode, proc.stderr) == (2, "error: --out a_file: exists and is not a directory\n")
