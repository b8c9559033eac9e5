"""Crashes, preemption, non-finite updates and unfinished checkpoint saves lose nothing.

The crash tests run `python -m epgrpo_jax.train` in subprocesses on one CPU device:
an uninterrupted reference run, and the same run killed with SIGKILL during a
checkpoint save and at a random moment, stopped with SIGTERM, and resumed each
time. Both must end with the same metrics and the same state, bit for bit.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from safetensors.numpy import load_file

from epgrpo_jax import train as train_cli
from epgrpo_jax.data import pipeline as data
from epgrpo_jax.training import loop as loop_mod
from epgrpo_jax.training import trainer as trainer_mod
from epgrpo_jax.io.checkpointing import Checkpointer, committed_steps
from epgrpo_jax.tasks import arithmetic

REPO = Path(__file__).resolve().parents[1]
STEPS = 10
SEED = 20240917  # the kill points
TMP_MARK = ".orbax-checkpoint-tmp"
# Metrics that measure time; every other metric of a step must match exactly.
TIMING = {"step_time", "sample_time", "update_time", "tokens_per_second",
          "sampling/tokens_per_second", "train/tokens_per_second", "perf/update_tflops", "perf/mfu",
          "rollout/wait_time"}
REWARD_MODULE = '''
def graded(completions, answers):
  """Deterministic rewards that differ within a group (a random policy never answers right)."""
  return [(sum(map(ord, c)) % 5) / 4 for c in completions]
'''


@pytest.fixture(scope="module")
def task(tmp_path_factory):
  """A one-layer random model with the arithmetic tokenizer, and an importable reward module."""
  root = tmp_path_factory.mktemp("resilience")
  assets = arithmetic.build_assets(
      root / "arith", seed=0, train_per_level=10, heldout_per_level=1, verbose=False,
      model_overrides=dict(num_layers=1, hidden_size=32, intermediate_size=64, num_heads=2,
                           num_kv_heads=1))
  (root / "resilience_reward.py").write_text(REWARD_MODULE)
  return assets, root


def overrides(task, out_dir: Path, *extra: str) -> list[str]:
  assets, _ = task
  return [f"model.path={assets.model_dir}", f"data.train_files=[{assets.train_file}]",
          "data.prompt_template={problem}", f"train.steps={STEPS}", "train.prompts_per_step=2",
          "train.num_generations=4", "sampling.max_new_tokens=8", "sampling.length_buckets=[8]",
          "lora.rank=2", "optim.learning_rate=1e-2", "optim.warmup_ratio=0.0",
          "reward.function=resilience_reward:graded", f"train.output_dir={out_dir}",
          "eval.before=false", "eval.after=false", "logging.progress=false",
          "logging.tensorboard=false", "logging.samples_every=0", "checkpoint.every=1",
          "checkpoint.keep=20", *extra]


# ----------------------------------------------------------------------------- reading runs


def step_records(run_dir: Path) -> dict[int, dict[str, Any]]:
  """The training metrics of each step."""
  out = {}
  for line in (run_dir / "metrics.jsonl").read_text().splitlines():
    record = json.loads(line)
    if "reward" in record:
      out[record["step"]] = {k: v for k, v in record.items() if k not in TIMING}
  return out


def load_state(step_dir: Path) -> dict[str, np.ndarray]:
  """Every array of a checkpoint's "state" item (trainable, optimizer, PRNG key) by path."""
  with ocp.PyTreeCheckpointer() as ckptr:
    metadata = ckptr.metadata(step_dir / "state")
    tree = getattr(metadata, "item_metadata", metadata)
    tree = getattr(tree, "tree", tree)
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    state = ckptr.restore(step_dir / "state", args=ocp.args.PyTreeRestore(restore_args=args))
  return {jax.tree_util.keystr(p): np.asarray(x)
          for p, x in jax.tree_util.tree_leaves_with_path(state)}


def load_meta(step_dir: Path) -> dict[str, int]:
  return json.loads((step_dir / "meta" / "metadata").read_text())


def part(state: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
  return {k: v for k, v in state.items() if k.startswith(prefix)}


def assert_same_arrays(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
  assert a.keys() == b.keys()
  different = [k for k in a if not np.array_equal(a[k], b[k])]
  assert not different, f"arrays differ: {different[:5]}"


def unfinished_saves(ckpt_dir: Path) -> list[str]:
  return sorted(p.name for p in ckpt_dir.iterdir() if TMP_MARK in p.name) if ckpt_dir.is_dir() else []


# ----------------------------------------------------------------------------- processes


class Run:
  """One `python -m epgrpo_jax.train` process; its stdout and stderr go to files."""

  def __init__(self, name: str, args: list[str], env: dict[str, str], log_dir: Path):
    self.name = name
    self.out_path, self.err_path = log_dir / f"{name}.out", log_dir / f"{name}.err"
    with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
      self.proc = subprocess.Popen([sys.executable, "-m", "epgrpo_jax.train", *args], cwd=REPO,
                                   env=env, stdout=out, stderr=err)

  @property
  def stdout(self) -> str:
    return self.out_path.read_text()

  @property
  def stderr(self) -> str:
    return self.err_path.read_text()

  def wait_for(self, what: str, cond: Callable[[], bool], *, poll_s: float = 0.002,
               timeout_s: float = 900) -> None:
    """Polls `cond` while the process runs; fails if it exits first."""
    deadline = time.monotonic() + timeout_s
    while not cond():
      if self.proc.poll() is not None:
        raise AssertionError(f"{self.name} exited ({self.proc.returncode}) before {what}:\n"
                             f"{self.stderr[-3000:]}")
      if time.monotonic() > deadline:
        self.proc.kill()
        raise AssertionError(f"{self.name}: no {what} after {timeout_s}s")
      time.sleep(poll_s)

  def finish(self, timeout_s: float = 900) -> int:
    try:
      return self.proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
      self.proc.kill()
      raise

  def kill(self, sig: int) -> int:
    self.proc.send_signal(sig)
    return self.finish()


def new_steps(run_dir: Path, before: bytes, restored: int) -> list[int]:
  """Steps of the training records a resumed leg has written to metrics.jsonl. The leg restores
  step `restored` (0: a fresh start), drops the records of later steps and a cut last line from
  the file as it found it (`before`), then appends its own."""
  path = run_dir / "metrics.jsonl"
  if not path.is_file():
    return []
  now = path.read_bytes()
  complete = lambda raw: [json.loads(l) for l in raw.split(b"\n")[:-1]]  # whole lines only
  stale = bool(before) and (not before.endswith(b"\n") or
                            any(r["step"] > restored for r in complete(before)))
  if stale and now.startswith(before):
    return []  # the leg has not repaired the file yet: later steps there are the killed leg's
  return [r["step"] for r in complete(now) if "reward" in r and r["step"] > restored]


def read(path: Path) -> bytes:
  return path.read_bytes() if path.is_file() else b""


@pytest.fixture(scope="module", params=[0, 1], ids=["synchronous", "one step stale"])
def crash_runs(task, tmp_path_factory, request):
  """An uninterrupted run and the same run killed and resumed; what each leg saw. Synchronous,
  and with rollout.max_staleness=1 (the checkpoints then hold the batch sampled ahead).

  The reference runs at the same time as the interrupted legs (they use one core each).
  """
  _, root = task
  base = tmp_path_factory.mktemp("crash")
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1",
             PYTHONPATH=os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p))
  ref_dir, run_dir = base / "reference", base / "interrupted"
  ckpt = run_dir / "checkpoints"
  staleness = f"rollout.max_staleness={request.param}"
  args = overrides(task, run_dir, staleness)
  rng = np.random.default_rng(SEED)
  seen: dict[str, Any] = {}
  reference = Run("reference", overrides(task, ref_dir, staleness), env, base)
  runs = [reference]
  try:
    # Leg 1: SIGKILL as soon as the save of step s1 has started (its temporary directory exists).
    s1 = int(rng.integers(1, 3))
    leg = Run("leg1", args, env, base)
    runs.append(leg)
    leg.wait_for(f"the save of step {s1}",
                 lambda: any(n.startswith(f"{s1}{TMP_MARK}") for n in unfinished_saves(ckpt)),
                 poll_s=0.001)
    seen["leg1"] = dict(s1=s1, rc=leg.kill(signal.SIGKILL), unfinished=unfinished_saves(ckpt),
                        committed=committed_steps(ckpt))

    # Leg 2: resume; SIGKILL at a random moment after step s2's metrics line.
    s2 = s1 + int(rng.integers(1, 3))
    delay = float(rng.uniform(0.0, 0.25))
    before, restored = read(run_dir / "metrics.jsonl"), max(committed_steps(ckpt), default=0)
    leg = Run("leg2", args, env, base)
    runs.append(leg)
    leg.wait_for(f"step {s2}", lambda: s2 in new_steps(run_dir, before, restored), poll_s=0.01)
    time.sleep(delay)
    seen["leg2"] = dict(s2=s2, delay=delay, rc=leg.kill(signal.SIGKILL), stderr=leg.stderr,
                        committed=committed_steps(ckpt))

    # Leg 3: resume; SIGTERM right after its first step.
    before, restored = read(run_dir / "metrics.jsonl"), max(committed_steps(ckpt), default=0)
    leg = Run("leg3", args, env, base)
    runs.append(leg)
    leg.wait_for("a step", lambda: bool(new_steps(run_dir, before, restored)), poll_s=0.01)
    first = new_steps(run_dir, before, restored)[0]
    seen["leg3"] = dict(first=first, rc=leg.kill(signal.SIGTERM), stdout=leg.stdout,
                        stderr=leg.stderr, committed=committed_steps(ckpt),
                        unfinished=unfinished_saves(ckpt))

    # Leg 4: resume to the end.
    leg = Run("leg4", args, env, base)
    runs.append(leg)
    seen["leg4"] = dict(rc=leg.finish(), stdout=leg.stdout, stderr=leg.stderr)
    ref_rc = reference.finish()
  finally:
    for run in runs:
      if run.proc.poll() is None:
        run.proc.kill()
  assert ref_rc == 0, reference.stderr[-3000:]
  assert seen["leg4"]["rc"] == 0, seen["leg4"]["stderr"][-3000:]
  return dict(reference=ref_dir, interrupted=run_dir, legs=seen)


@pytest.mark.slow
def test_a_killed_save_leaves_no_checkpoint_that_resume_picks_up(crash_runs):
  leg1, leg2 = crash_runs["legs"]["leg1"], crash_runs["legs"]["leg2"]
  s1 = leg1["s1"]
  assert leg1["rc"] == -signal.SIGKILL
  # The kill caught the save of step s1 unfinished: only its temporary directory exists.
  unfinished = [n for n in leg1["unfinished"] if n.startswith(f"{s1}{TMP_MARK}")]
  assert unfinished, leg1
  assert leg1["committed"] == list(range(1, s1))
  # The next run resumed from the step before (or started afresh) and removed the leftover.
  if s1 > 1:
    assert f"at step {s1 - 1}" in leg2["stderr"], leg2["stderr"][-2000:]
  else:
    assert "resumed from" not in leg2["stderr"]
  assert not (crash_runs["interrupted"] / "checkpoints" / unfinished[0]).exists()
  assert leg2["rc"] == -signal.SIGKILL and leg2["committed"], leg2


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_at_the_current_step_and_exits_zero(crash_runs):
  legs = crash_runs["legs"]
  leg3 = legs["leg3"]
  ckpt = crash_runs["interrupted"] / "checkpoints"
  assert leg3["rc"] == 0, leg3["stderr"][-3000:]
  assert "received SIGTERM: stopping after this step and saving a checkpoint" in leg3["stderr"]
  stop_lines = [l for l in leg3["stdout"].splitlines() if l.startswith("stopped by signal")]
  assert len(stop_lines) == 1, leg3["stdout"]
  stopped = int(stop_lines[0].split("at step ")[1].split(";")[0])
  assert stop_lines[0] == f"stopped by signal at step {stopped}; checkpoint saved in {ckpt}"
  # The signal came after the leg's first step: that step or the next one is the last.
  assert stopped in (leg3["first"], leg3["first"] + 1) and stopped < STEPS
  assert leg3["committed"][-1] == stopped and not leg3["unfinished"]
  assert load_meta(ckpt / str(stopped))["step"] == stopped
  # The last leg continued from there to the end.
  assert f"resumed from {ckpt} at step {stopped}" in legs["leg4"]["stderr"]
  assert json.loads((crash_runs["interrupted"] / "summary.json").read_text())["steps"] == STEPS


@pytest.mark.slow
def test_killed_and_resumed_run_matches_an_uninterrupted_one(crash_runs):
  ref, run = crash_runs["reference"], crash_runs["interrupted"]
  expected, got = step_records(ref), step_records(run)
  assert sorted(expected) == sorted(got) == list(range(1, STEPS + 1))
  # Each step's record once: the resumed legs dropped the records of the steps they redid.
  assert [r["step"] for r in _records(run / "metrics.jsonl") if "reward" in r] == sorted(got)
  for step in expected:
    assert got[step] == expected[step], f"step {step}"
  # The runs learned something, so that equal numbers mean equal work.
  assert any(r["grad_norm"] > 0 and r["reward_std"] > 0 for r in expected.values())
  last_ref, last_run = ref / "checkpoints" / str(STEPS), run / "checkpoints" / str(STEPS)
  assert_same_arrays(load_state(last_ref), load_state(last_run))
  assert load_meta(last_ref) == load_meta(last_run)
  assert_same_arrays(load_file(ref / "policy" / "model.safetensors"),
                     load_file(run / "policy" / "model.safetensors"))
  final = load_state(last_ref)
  assert any(np.abs(v).max() > 0 for k, v in part(final, "['trainable']").items()
             if "lora_b" in k)  # the adapters moved from their zero start


def _records(path: Path) -> list[dict[str, Any]]:
  """Every line of a JSON Lines file, parsed (a line that does not parse fails the test)."""
  return [json.loads(line) for line in path.read_text().splitlines()]


def _untimed(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
  return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


def _cut_after(path: Path, last_step: int, torn: int) -> None:
  """Keeps the lines of steps <= last_step and the first `torn` bytes of the next line: a run
  killed while writing that line."""
  lines = path.read_text().splitlines(keepends=True)
  keep = next(i for i, line in enumerate(lines) if json.loads(line)["step"] > last_step)
  path.write_text("".join(lines[:keep]) + lines[keep][:torn])


def test_a_resume_after_a_torn_write_logs_each_record_once(task, tmp_path, monkeypatch):
  # A run killed while writing step 4's records, after its step-3 records and with its latest
  # checkpoint at step 2: the resumed run redoes steps 3 and 4. Every line of every JSON Lines
  # output parses afterwards, and holds the uninterrupted run's records, each once.
  _, root = task
  monkeypatch.syspath_prepend(str(root))
  extra = ("train.steps=4", "checkpoint.every=2", "logging.samples_every=1", "logging.samples_count=1")
  reference, run = tmp_path / "reference", tmp_path / "run"
  assert train_cli.main(overrides(task, reference, *extra)) == 0
  shutil.copytree(reference, run)
  shutil.rmtree(run / "checkpoints" / "4")
  shutil.rmtree(run / "policy")
  (run / "summary.json").unlink()
  _cut_after(run / "metrics.jsonl", 3, torn=20)
  _cut_after(run / "samples.jsonl", 3, torn=50)
  assert train_cli.main(overrides(task, run, *extra)) == 0
  expected, got = _records(reference / "metrics.jsonl"), _records(run / "metrics.jsonl")
  assert [r["step"] for r in got if "reward" in r] == [1, 2, 3, 4]
  assert _untimed(got) == _untimed(expected)
  assert _records(run / "samples.jsonl") == _records(reference / "samples.jsonl")
  assert [r["step"] for r in _records(run / "samples.jsonl")] == [1, 2, 3, 4]


# ----------------------------------------------------------------------------- non-finite updates


NAN_AT = {3, 5, 6}  # optimizer updates (= steps here) whose gradients get a NaN


class FaultyTrainer(trainer_mod.Trainer):
  """The real trainer, with NaN advantages in the updates in `NAN_AT` (so their loss and
  gradients are NaN), passed to the real update: NaN advantages in the batch of a separate
  update, NaN rewards (hence advantages) into the fused one."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    update, fused_update, calls = self.fns.update, self.fns.fused_update, itertools.count(1)

    def faulty(trainable, opt_state, frozen, batch, **update_kwargs):
      if next(calls) in NAN_AT:
        batch = batch.replace(advantage=batch.advantage * jnp.nan)
      return update(trainable, opt_state, frozen, batch, **update_kwargs)

    def faulty_fused(trainable, opt_state, frozen, reference, rollout, rewards_PxG):
      if next(calls) in NAN_AT:
        rewards_PxG = rewards_PxG * np.nan
      return fused_update(trainable, opt_state, frozen, reference, rollout, rewards_PxG)

    self.fns.update, self.fns.fused_update = faulty, faulty_fused


def test_nan_gradient_skips_the_update_and_repeated_ones_stop_the_run(task, tmp_path, capsys,
                                                                        monkeypatch):
  _, root = task
  monkeypatch.syspath_prepend(str(root))
  monkeypatch.setattr(loop_mod, "Trainer", FaultyTrainer)
  run_dir = tmp_path / "run"
  code = train_cli.main(overrides(task, run_dir, "train.steps=8", "train.max_consecutive_skips=2",
                                  "checkpoint.keep=10"))
  err = capsys.readouterr().err
  ckpt = run_dir / "checkpoints"
  assert code == 1, err[-3000:]
  assert err.strip().splitlines()[-1] == (
      f"error: TrainingError: 2 consecutive non-finite updates at step 6; saved the last good "
      f"state to {ckpt} (run with --debug for the traceback)")
  assert "Traceback" not in err
  assert "step 3: non-finite loss or gradient, update skipped (1 in a row, 1 in all)" in err
  assert "step 6: non-finite loss or gradient, update skipped (2 in a row, 3 in all)" in err

  records = step_records(run_dir)
  assert sorted(records) == [1, 2, 3, 4, 5, 6]
  assert [records[s]["skipped_updates"] for s in range(1, 7)] == [0, 0, 1, 1, 2, 3]
  # The fault is NaN advantages (the update has no test-only hook), so loss and gradients are NaN.
  assert records[3]["grad_norm"] == "nan" and records[3]["loss"] == "nan"
  assert np.isfinite(records[4]["grad_norm"])

  assert committed_steps(ckpt) == [1, 2, 3, 4, 5, 6]
  states = {s: load_state(ckpt / str(s)) for s in (1, 2, 3, 4, 6)}
  # A skipped update leaves the parameters and the optimizer state as they were...
  for prefix in ("['trainable']", "['opt_state']"):
    assert_same_arrays(part(states[3], prefix), part(states[2], prefix))
    assert_same_arrays(part(states[6], prefix), part(states[4], prefix))
  # ...while good updates change them (so the equalities above are not vacuous).
  lora_b = lambda s: {k: v for k, v in part(s, "['trainable']").items() if "lora_b" in k}
  for a, b in ((1, 2), (3, 4)):
    assert any(not np.array_equal(x, lora_b(states[b])[k]) for k, x in lora_b(states[a]).items())
  counters = lambda s: {k: load_meta(ckpt / str(s))[k]
                        for k in ("step", "consecutive_skips", "skipped_updates")}
  assert counters(3) == {"step": 3, "consecutive_skips": 1, "skipped_updates": 1}
  assert counters(4) == {"step": 4, "consecutive_skips": 0, "skipped_updates": 1}  # reset
  assert counters(6) == {"step": 6, "consecutive_skips": 2, "skipped_updates": 3}


# ----------------------------------------------------------------------------- checkpoints


def test_restore_ignores_an_unfinished_save_and_takes_the_latest_complete_step(tmp_path):
  directory = tmp_path / "checkpoints"
  ckpt = Checkpointer(directory, keep=3)
  it = data.batch_iterator(10, 2, seed=0)
  for step in (1, 2):
    next(it)
    ckpt.save(step, {"w": jnp.arange(4.0) * step}, it, {"step": step})
    ckpt.save(step, {"w": jnp.zeros(4)}, it, {"step": -1})  # saving the same step again: no-op
  expected_next = next(it)
  ckpt.close()
  # A save killed before its final rename: step 3's temporary directory, partly written.
  unfinished = directory / f"3{TMP_MARK}-1700000000"
  shutil.copytree(directory / "2", unfinished)
  shutil.rmtree(unfinished / "state")
  assert committed_steps(directory) == [1, 2]

  ckpt = Checkpointer(directory, keep=3)
  try:
    assert ckpt.latest_step() == 2
    it2 = data.batch_iterator(10, 2, seed=0)
    state, meta = ckpt.restore(2, {"w": jnp.zeros(4)}, it2)
    np.testing.assert_array_equal(state["w"], np.arange(4.0) * 2)
    assert meta == {"step": 2}
    np.testing.assert_array_equal(next(it2), expected_next)  # the data position too
    assert not unfinished.exists()  # the leftover is cleaned up
    with pytest.raises(ValueError, match="already exists"):  # an older run's step is never
      ckpt.save(2, {"w": jnp.zeros(4)}, None, {"step": 2})    # silently kept or overwritten
  finally:
    ckpt.close()


def test_a_restore_into_other_shapes_is_refused_before_any_array_is_read(tmp_path):
  ckpt = Checkpointer(tmp_path / "checkpoints", async_save=False)
  try:
    ckpt.save(1, {"a": {"w": jnp.zeros((2, 3))}, "b": jnp.zeros(())}, None, {"step": 1})
    for wanted, message in [
        ({"a": {"w": jnp.zeros((2, 4))}, "b": jnp.zeros(())},
         r"^a\.w is saved with shape \(2, 3\), expected \(2, 4\)$"),
        ({"a": {"w": jnp.zeros((2, 3)), "v": jnp.zeros(1)}, "b": jnp.zeros(())},
         r"^the checkpoint has no array a\.v \(1,\)$"),
        ({"a": {"w": jnp.zeros((2, 3))}},
         r"^the checkpoint holds 1 array\(s\) not expected, e\.g\. b \(\)$")]:
      with pytest.raises(ValueError, match=message):
        ckpt.restore(1, wanted, None)
    state, _ = ckpt.restore(1, {"a": {"w": jnp.ones((2, 3))}, "b": jnp.ones(())}, None)
    np.testing.assert_array_equal(state["a"]["w"], np.zeros((2, 3)))
  finally:
    ckpt.close()


def test_resume_false_on_a_directory_with_checkpoints_is_an_error(tmp_path, capsys):
  run_dir = tmp_path / "run"
  ckpt = Checkpointer(run_dir / "checkpoints", async_save=False)
  ckpt.save(4, {"w": jnp.zeros(2)}, None, {"step": 4})
  ckpt.close()
  code = train_cli.main([f"train.output_dir={run_dir}", "checkpoint.resume=false"])
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and "Traceback" not in "\n".join(err)
  assert err[-1] == (f"error: checkpoint.resume: false, but {run_dir / 'checkpoints'} holds "
                     "checkpoints (latest step 4); remove them or choose another train.output_dir")


def _hashes(directory: Path) -> dict[str, bytes]:
  return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*"))
          if p.is_file()}


def test_a_damaged_latest_checkpoint_is_set_aside_and_the_run_resumes_before_it(task, tmp_path,
                                                                               capsys, monkeypatch):
  monkeypatch.syspath_prepend(str(task[1]))  # the reward module
  run_dir = tmp_path / "run"
  ckpt = run_dir / "checkpoints"
  assert train_cli.main(overrides(task, run_dir, "train.steps=3")) == 0
  assert committed_steps(ckpt) == [1, 2, 3]
  for f in (ckpt / "3").rglob("*"):  # damage step 3: every file of it cut to nothing
    if f.is_file():
      f.write_bytes(b"")
  damaged = _hashes(ckpt / "3")
  capsys.readouterr()

  # A config that does not fit any checkpoint: one line, exit 2, and the run directory as it was.
  before = _hashes(run_dir)
  code = train_cli.main(overrides(task, run_dir, "train.steps=4", "lora.rank=4"))
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and "Traceback" not in "\n".join(err), err[-5:]
  assert err[-1].startswith(f"error: checkpoint.resume: no checkpoint in {ckpt} restores into "
                            "this config (step 3: "), err[-1]
  # step 2 of another LoRA rank: the array and both shapes are named
  assert any("step 2 cannot be restored (ValueError: " in line and "lora_a is saved with shape "
             "(32, 2), expected (32, 4))" in line for line in err), err
  assert _hashes(run_dir) == before

  # The same config: step 3 is renamed, never deleted, and the run goes on from step 2.
  assert train_cli.main(overrides(task, run_dir, "train.steps=4")) == 0
  err = capsys.readouterr().err
  assert "resumed from step 2; the newer checkpoint(s) of step 3 could not be restored" in err
  assert _hashes(ckpt / "3.damaged") == damaged
  assert committed_steps(ckpt) == [1, 2, 3, 4]


def test_model_path_inside_the_output_dir_is_refused(task, tmp_path, capsys):
  assets, _ = task
  run_dir = tmp_path / "run"
  shutil.copytree(assets.model_dir, run_dir / "policy")
  before = _hashes(run_dir)
  code = train_cli.main(overrides(task, run_dir, f"model.path={run_dir / 'policy'}"))
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and err[-1].startswith(f"error: model.path: {run_dir / 'policy'} lies inside "
                                          f"train.output_dir ({run_dir})"), err[-1]
  assert _hashes(run_dir) == before
