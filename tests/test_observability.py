"""Observability: metrics files, TensorBoard events, progress lines, plots, the token heat map."""

from __future__ import annotations

import html.parser
import io
import json
import math
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epgrpo_jax.tools import heatmap
from epgrpo_jax.tools import plot
from epgrpo_jax.io.metrics import (MetricsWriter, Progress, read_metrics, read_tensorboard_scalars,
                                tb_tag, token_strings)

# Every metric issue 8 lists, written at every training step.
STEP_KEYS = (
    # TRL names
    "reward", "reward_std", "frac_reward_zero_std", "completions/mean_length",
    "completions/min_length", "completions/max_length", "completions/clipped_ratio", "entropy",
    "kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "grad_norm",
    "learning_rate", "step_time", "num_tokens",
    # throughput
    "sampling/tokens_per_second", "train/tokens_per_second",
    # EP-GRPO diagnostics
    "ep/gate_mean", "ep/gate_std", "ep/outcome_adv_mean", "ep/outcome_adv_abs_mean",
    "ep/progress_adv_mean", "ep/progress_adv_abs_mean", "ep/polarity_flip_frac",
    "ep/anchor_groups_frac", "ep/zero_variance_frac", "ep/bucket_occupancy_min",
    "ep/bucket_occupancy_max", "ep/bucket_empty_frac",
    # sampler/trainer mismatch (TRL's and verl's names)
    "sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
    "rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/chi2_token", "rollout_corr/chi2_seq",
    "rollout_corr/rollout_is_ratio_fraction_high", "rollout_corr/rollout_is_ratio_fraction_low",
    "rollout_corr/rollout_is_seq_fraction_high", "rollout_corr/rollout_is_seq_fraction_low",
)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PER_TOKEN = ("entropy", "gate", "outcome", "signal", "progress", "advantage", "tau", "bucket")


# ----------------------------------------------------------------------------
# helpers


def check_png(path: Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.image

  data = path.read_bytes()
  assert data[:8] == PNG_SIGNATURE, path
  assert len(data) > 1000, path
  img = matplotlib.image.imread(path)
  assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100, (path, img.shape)
  assert float(img[..., :3].std()) > 0.01, f"{path} is blank"


class PageParser(html.parser.HTMLParser):
  """Checks nesting, counts token spans, collects attributes that could load anything."""

  VOID = {"meta", "br", "img", "input", "link", "hr", "col", "source", "wbr"}

  def __init__(self):
    super().__init__(convert_charrefs=True)
    self.stack: list[str] = []
    self.errors: list[str] = []
    self.spans = 0
    self.token_spans = 0
    self.token_text: list[str] = []
    self.loaders: list[tuple[str, str]] = []
    self._in_token = False

  def handle_starttag(self, tag, attrs):
    attrs = dict(attrs)
    for name in ("src", "href", "data", "action"):
      if name in attrs and tag != "span":
        self.loaders.append((tag, attrs[name]))
    if tag == "span":
      self.spans += 1
      if "tok" in (attrs.get("class") or "").split():
        self.token_spans += 1
        self._in_token = True
        self.token_text.append("")
    if tag not in self.VOID:
      self.stack.append(tag)

  def handle_endtag(self, tag):
    if tag in self.VOID:
      return
    if not self.stack or self.stack[-1] != tag:
      self.errors.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'}")
      return
    self.stack.pop()
    if tag == "span":
      self._in_token = False

  def handle_data(self, data):
    if self._in_token:
      self.token_text[-1] += data


def parse_page(text: str) -> PageParser:
  p = PageParser()
  p.feed(text)
  p.close()
  assert not p.errors, p.errors[:5]
  assert p.stack == [], p.stack
  return p


def write_metrics(run_dir: Path, steps: int, seed: int, *, skip: tuple[str, ...] = ()) -> Path:
  """A synthetic run directory: metrics.jsonl with training steps and held-out lines."""
  rng = np.random.default_rng(seed)
  run_dir.mkdir(parents=True)
  lines = [{"step": 0, "heldout/accuracy": 0.2, "heldout/pass@4": 0.4}]
  for s in range(1, steps + 1):
    rec = {"step": s, "reward": min(1.0, 0.2 + 0.02 * s + 0.1 * rng.standard_normal()),
           "entropy": 1.5 - 0.01 * s + 0.05 * rng.standard_normal(),
           "grad_norm": abs(0.5 + 0.2 * rng.standard_normal()), "kl": 1e-3 * s,
           "frac_reward_zero_std": float(rng.uniform(0.3, 0.7))}
    lines.append({k: v for k, v in rec.items() if k not in skip})
  lines.append({"step": steps, "heldout/accuracy": 0.35, "heldout/pass@4": 0.6})
  (run_dir / "metrics.jsonl").write_text("".join(json.dumps(l) + "\n" for l in lines))
  return run_dir


def synthetic_group(lengths=(7, 3, 12), seed: int = 0) -> dict:
  """A samples.jsonl group record with awkward tokens (markup, newlines, control, empty)."""
  rng = np.random.default_rng(seed)
  pool = ["7", "*", "5", "=", "35", "\n", "<b>", "&amp;", '"q"', " ", "", "\x07", "\\boxed", "{",
          "}", "<|im_end|>"]
  responses = []
  for g, n in enumerate(lengths):
    tau = np.cumsum(rng.uniform(0.1, 1.0, n))
    tau /= tau[-1]
    outcome = float(rng.standard_normal())
    gate = rng.uniform(0, 1, n)
    progress = 0.2 * rng.standard_normal(n)
    responses.append({
        "sample": g, "completion": "x", "reward": float(g % 2), "extracted": str(g),
        "outcome_adv": outcome, "anchor": float(np.sign(outcome)), "length": n,
        "token_ids": list(range(n)), "tokens": [pool[i % len(pool)] for i in range(g, g + n)],
        "entropy": rng.uniform(0, 3, n).round(4).tolist(), "gate": gate.round(4).tolist(),
        "outcome": (gate * outcome).round(4).tolist(), "signal": (0.01 * rng.standard_normal(n)).tolist(),
        "progress": progress.round(4).tolist(), "advantage": (gate * outcome + progress).tolist(),
        "tau": tau.round(4).tolist(), "bucket": np.minimum(np.floor(tau * 10), 9).astype(int).tolist()})
  return {"step": 3, "group": 1, "problem_id": "train:1", "prompt": "Compute 7*5 < 40 & ...",
          "answer": "35", "zero_variance": False, "reward_mean": 0.33, "responses": responses}


# ----------------------------------------------------------------------------
# fast tests


def test_tb_tag_maps_at_sign_and_odd_characters():
  assert tb_tag("heldout/pass@4") == "heldout/pass_at_4"
  assert tb_tag("ep/gate mean(x)") == "ep/gate_mean_x_"
  assert tb_tag("completions/mean_length") == "completions/mean_length"


def test_read_metrics_skips_a_truncated_last_line_with_a_warning(tmp_path, caplog):
  w = MetricsWriter(tmp_path, tensorboard=False)
  w.write(1, {"reward": 0.5})
  w.write(2, {"reward": 0.75})
  w.close()
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 3, "rew')  # a run killed mid-write
  recs = read_metrics(tmp_path)
  assert [r["step"] for r in recs] == [1, 2]
  assert "metrics.jsonl:3: skipped (invalid JSON)" in caplog.text


def test_a_resumed_writer_removes_a_cut_line_before_appending(tmp_path, caplog):
  """A kill mid-write leaves half a record; the next run removes it before appending, so every
  line of the file parses (it was once glued onto the next record, later left in the file)."""
  w = MetricsWriter(tmp_path, tensorboard=False)
  w.write(1, {"reward": 0.5})
  w.close()
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 2, "rew')
  w = MetricsWriter(tmp_path, tensorboard=False)  # the resumed run
  w.write(2, {"reward": 0.75})
  w.write(3, {"reward": 1.0})
  w.close()
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  assert [(r["step"], r["reward"]) for r in map(json.loads, lines)] == [(1, 0.5), (2, 0.75),
                                                                       (3, 1.0)]
  assert "removed a last line cut off by an interrupted write (16 bytes)" in caplog.text


def test_metrics_writer_jsonl_and_tensorboard_round_trip(tmp_path):
  w = MetricsWriter(tmp_path, tensorboard=True)
  w.write(1, {"reward": 0.5, "kl": np.float32(0.01)})
  w.write(2, {"reward": float("nan"), "kl": 0.02})
  w.write(2, {"accuracy": 0.25, "pass@4": 0.5}, prefix="heldout/")
  w.close()
  recs = read_metrics(tmp_path)
  assert recs[0] == {"step": 1, "reward": 0.5, "kl": pytest.approx(0.01)}
  assert math.isnan(recs[1]["reward"])
  json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[1])  # strict JSON: "nan" string
  tb = read_tensorboard_scalars(tmp_path / "tensorboard")
  assert tb["reward"][0] == (1, 0.5)
  assert [s for s, _ in tb["kl"]] == [1, 2]
  assert tb["heldout/pass_at_4"] == [(2, 0.5)]
  assert not any("@" in tag for tag in tb)


def test_progress_plain_lines_have_values_rate_and_eta():
  stream = io.StringIO()
  bar = Progress(6, "train", every=3, stream=stream)
  for i in range(6):
    bar.update({"reward": 0.1 * i, "kl": 0.001}, tokens=100)
  bar.close()
  lines = stream.getvalue().splitlines()
  assert [l.split()[1] for l in lines] == ["1/6", "3/6", "6/6"]  # first, every 3rd, last
  assert "reward=0.5" in lines[-1] and "kl=0.001" in lines[-1]
  assert "tok/s=" in lines[0] and "eta=" in lines[0]
  assert lines[-1].endswith("eta=0:00")


def test_progress_bar_on_a_terminal():
  class Tty(io.StringIO):
    def isatty(self):
      return True

  stream = Tty()
  bar = Progress(4, "sft", stream=stream, plain=False)
  for i in range(4):
    bar.update({"loss": 1.0 / (i + 1)}, tokens=50)
  bar.close()
  out = stream.getvalue()
  assert "sft" in out and "loss=0.25" in out and "tok/s=" in out and "4/4" in out


def test_progress_disabled_is_silent():
  stream = io.StringIO()
  bar = Progress(3, "x", enabled=False, stream=stream)
  bar.update({"a": 1})
  bar.write("hello")
  assert stream.getvalue() == "" and bar.n == 1


def test_ema():
  assert plot.ema([1.0, 1.0, 1.0]).tolist() == [1.0, 1.0, 1.0]
  np.testing.assert_allclose(plot.ema([0.0, 1.0, 1.0], alpha=0.2), [0.0, 0.2, 0.36])
  np.testing.assert_allclose(plot.ema([2.0, float("nan"), 2.0]), [2.0, 2.0, 2.0])


def test_series_keeps_the_last_value_of_a_relogged_step():
  recs = [{"step": 1, "reward": 0.1}, {"step": 2, "reward": 0.2}, {"step": 2, "reward": 0.3},
          {"step": 2, "heldout/accuracy": 0.5}]
  steps, values = plot.series(recs, "reward")
  assert steps.tolist() == [1, 2] and values.tolist() == [0.1, 0.3]


def test_plot_two_runs_writes_valid_pngs(tmp_path, capsys):
  a = write_metrics(tmp_path / "grpo", 30, 0)
  b = write_metrics(tmp_path / "epgrpo", 25, 1, skip=("grad_norm",))
  written = plot.plot_runs([a, b], tmp_path / "plots")
  assert set(written) == {p.key for p in plot.PANELS} | {"curves"}
  for path in written.values():
    check_png(path)
  # a metric that no run logged is skipped with a note
  c = write_metrics(tmp_path / "nokl", 5, 2, skip=("kl",))
  written = plot.plot_runs([c], tmp_path / "plots2", names=["only"])
  assert "kl" not in written and "curves" in written
  assert "no run logged 'kl'" in capsys.readouterr().err


def test_plot_cli(tmp_path, capsys):
  a = write_metrics(tmp_path / "a", 10, 0)
  b = write_metrics(tmp_path / "b", 10, 1)
  assert plot.main([str(a), str(b), "--out", str(tmp_path / "o"), "--names", "GRPO,EP-GRPO"]) == 0
  assert (tmp_path / "o" / "curves.png").is_file()
  with pytest.raises(SystemExit):
    plot.main([str(a), str(b), "--names", "one"])


def test_heatmap_page_is_well_formed_self_contained_one_span_per_token(tmp_path):
  group = synthetic_group()
  page = heatmap.render_html(group, title="t", source="run x")
  parsed = parse_page(page)
  total = sum(len(r["tokens"]) for r in group["responses"])
  assert parsed.token_spans == total == parsed.spans
  assert "http" not in page and not parsed.loaders
  assert "<script src" not in page and "<link" not in page
  # the token text survives escaping (newlines shown as a visible mark)
  shown = [heatmap._display(t) for r in group["responses"] for t in r["tokens"]]
  assert parsed.token_text == shown
  # one button per quantity; every token carries every quantity
  for key, (attr, *_rest) in heatmap.QUANTITIES.items():
    assert f'data-q="{key}"' in page
    assert page.count(f" data-{attr}=") == total
  out = heatmap.write_page(group, tmp_path / "h" / "page.html", title="t", source="run x")
  assert out.read_text(encoding="utf-8") == page


def test_heatmap_marks_bucket_boundaries():
  group = synthetic_group(lengths=(12,))
  page = heatmap.render_html(group)
  buckets = group["responses"][0]["bucket"]
  changes = sum(1 for x, y in zip(buckets, buckets[1:]) if x != y)
  assert page.count('class="tok bstart"') == changes > 0


def test_heatmap_select_group(tmp_path):
  g0 = {"step": 2, "group": 0, "responses": [{"reward": 0.0}, {"reward": 0.0}]}
  g1 = {"step": 2, "group": 1, "responses": [{"reward": 1.0}, {"reward": 0.0}]}
  g2 = {"step": 1, "group": 0, "responses": [{"reward": 0.0}]}
  assert heatmap.select_group([g2, g0, g1]) is g1  # latest step, first group with variance
  assert heatmap.select_group([g2, g0, g1], step=2, group=0) is g0
  with pytest.raises(ValueError, match="steps with samples: 1, 2"):
    heatmap.select_group([g2, g0, g1], step=5)


@pytest.fixture(scope="module")
def task(tmp_path_factory):
  from epgrpo_jax.tasks import arithmetic
  return arithmetic.build_assets(tmp_path_factory.mktemp("arith"), seed=0, train_per_level=60,
                                 heldout_per_level=4, verbose=False)


def test_token_strings_concatenate_to_the_text(task):
  from epgrpo_jax.models import load_tokenizer
  tok = load_tokenizer(task.model_dir)
  text = "Compute 7*5-3*2.\n7*5=35\n\\boxed{29}<|im_end|>"
  ids = tok(text, add_special_tokens=False)["input_ids"]
  pieces = token_strings(tok, ids)
  assert len(pieces) == len(ids) and "".join(pieces) == text
  assert pieces[-1] == "<|im_end|>"


def test_sample_records_hold_every_per_token_quantity():
  import jax.numpy as jnp

  from epgrpo_jax import rewards
  from epgrpo_jax.core import advantages
  from epgrpo_jax.data import pipeline as data
  from epgrpo_jax.training import batches
  from epgrpo_jax.training.rollouts import sample_records

  rng = np.random.default_rng(0)
  P, G, T = 3, 4, 6
  mask = np.arange(T)[None, None, :] < rng.integers(1, T + 1, (P, G, 1))
  r = np.array([[1, 0, 0, 1], [0, 0, 0, 0], [1, 1, 0, 1]], np.float32)
  ent = rng.uniform(0, 2, (P, G, T)).astype(np.float32)
  lp = -rng.uniform(0, 2, (P, G, T)).astype(np.float32)
  adv, comps = advantages.compute_advantages(jnp.asarray(r), jnp.asarray(ent), jnp.asarray(lp),
                                             jnp.asarray(lp - 0.1), jnp.asarray(mask))
  examples = [data.Example(id=f"p{i}", problem=f"Compute {i}+1.", answer=str(i + 1),
                           prompt_ids=(1, 2)) for i in range(P)]
  tokens = rng.integers(3, 50, (P * G, T))
  rollout = batches.CompletionBatch(prompt_ids=jnp.zeros((P * G, 2), jnp.int32),
                          prompt_mask=jnp.ones((P * G, 2), bool), completion=jnp.asarray(tokens),
                          completion_mask=jnp.asarray(mask.reshape(P * G, T)))
  flat = r.reshape(-1)
  result = rewards.RewardResult(reward=flat, accuracy=flat, format=flat,
                                answers=["1"] * (P * G), status=["ok"] * (P * G))
  record = {"examples": examples, "texts": [f"t{i}" for i in range(P * G)], "rewards": result,
            "rollout": rollout, "advantage": adv, "components": comps,
            "entropy": jnp.asarray(ent.reshape(P * G, T))}
  groups = sample_records(7, record, 2)
  assert [g["group"] for g in groups] == [0, 1] and groups[1]["zero_variance"]
  json.dumps(groups)  # serialisable
  for p, g in enumerate(groups):
    assert g["step"] == 7 and g["prompt"] == examples[p].problem and len(g["responses"]) == G
    for i, resp in enumerate(g["responses"]):
      n = int(mask[p, i].sum())
      assert resp["length"] == n and resp["token_ids"] == tokens[p * G + i, :n].tolist()
      for key in PER_TOKEN:
        assert len(resp[key]) == n, key
      np.testing.assert_allclose(resp["advantage"], np.asarray(adv)[p, i, :n], atol=1e-4)
      np.testing.assert_allclose(resp["entropy"], ent[p, i, :n], atol=1e-4)
      assert resp["reward"] == r[p, i]


# ----------------------------------------------------------------------------
# a real smoke run (slow)


@pytest.fixture(scope="module")
def smoke_run(task, tmp_path_factory):
  """Two RL steps of the tiny config, samples dumped every step, pass@4 in held-out eval."""
  from test_trainer import tiny_config

  from epgrpo_jax.training.loop import train
  run_dir = tmp_path_factory.mktemp("obs") / "run"
  train(tiny_config(task, run_dir, "logging.samples_every=1", "logging.samples_count=2",
                    "eval.samples=4"))
  return run_dir


@pytest.mark.slow
def test_smoke_run_metrics_have_every_key_finite_each_step(smoke_run):
  recs = read_metrics(smoke_run)
  step_recs = [r for r in recs if "reward" in r]
  assert [r["step"] for r in step_recs] == [1, 2]
  for r in step_recs:
    missing = [k for k in STEP_KEYS if k not in r]
    assert not missing, missing
    bad = {k: r[k] for k in STEP_KEYS if not math.isfinite(r[k])}
    assert not bad, bad
  heldout = [r for r in recs if "heldout/accuracy" in r]
  assert [r["step"] for r in heldout] == [0, 2]
  assert all(math.isfinite(r["heldout/pass@4"]) for r in heldout)


@pytest.mark.slow
def test_smoke_run_tensorboard_events_parse_back(smoke_run):
  tb = read_tensorboard_scalars(smoke_run / "tensorboard")
  for key in STEP_KEYS:
    assert [s for s, _ in tb[tb_tag(key)]] == [1, 2], key
  assert "heldout/pass_at_4" in tb and not any("@" in t for t in tb)
  recs = {r["step"]: r for r in read_metrics(smoke_run) if "reward" in r}
  for step, value in tb["reward"]:
    assert value == pytest.approx(recs[step]["reward"], rel=1e-6)


@pytest.mark.slow
def test_smoke_run_plot_with_a_second_run(smoke_run, tmp_path):
  other = tmp_path / "other"
  other.mkdir()
  lines = read_metrics(smoke_run)
  for l in lines:  # a second, shifted copy of the run
    if "reward" in l:
      l["reward"] += 0.1
  (other / "metrics.jsonl").write_text("".join(json.dumps(l) + "\n" for l in lines))
  assert plot.main([str(smoke_run), str(other), "--out", str(tmp_path / "plots")]) == 0
  pngs = sorted((tmp_path / "plots").glob("*.png"))
  assert {p.stem for p in pngs} >= {"reward", "entropy", "grad_norm", "kl", "heldout_accuracy",
                                     "frac_reward_zero_std", "curves"}
  for p in pngs:
    check_png(p)


@pytest.mark.slow
def test_smoke_run_samples_and_heatmap(smoke_run, tmp_path):
  groups = heatmap.read_samples(smoke_run)
  assert sorted({(g["step"], g["group"]) for g in groups}) == [(1, 0), (1, 1), (2, 0), (2, 1)]
  for g in groups:
    for r in g["responses"]:
      assert all(len(r[k]) == r["length"] == len(r["token_ids"]) for k in PER_TOKEN)
  out = tmp_path / "page.html"
  assert heatmap.main([str(smoke_run), "--step", "1", "--group", "1", "--out", str(out)]) == 0
  page = out.read_text(encoding="utf-8")
  parsed = parse_page(page)
  group = heatmap.select_group(groups, 1, 1)
  assert parsed.token_spans == sum(r["length"] for r in group["responses"]) == parsed.spans
  assert "http" not in page and not parsed.loaders


@pytest.mark.slow
def test_heatmap_fresh_sample_from_checkpoint(smoke_run, tmp_path):
  before = sorted(p.name for p in smoke_run.rglob("*"))
  out = tmp_path / "fresh.html"
  assert heatmap.main(["--checkpoint", str(smoke_run), "--samples", "3", "--out", str(out)]) == 0
  parsed = parse_page(out.read_text(encoding="utf-8"))
  assert parsed.token_spans > 0 and "checkpoint step 2" in out.read_text(encoding="utf-8")
  assert sorted(p.name for p in smoke_run.rglob("*")) == before  # the run is left alone


def test_resume_from_keeps_the_whole_records_up_to_the_restored_step(tmp_path, caplog):
  # A run killed after step 3 (checkpoint at step 2) mid-write of samples.jsonl, with a broken line
  # an older version left in metrics.jsonl; it resumes from step 2.
  metrics = ['{"step": 0, "data/train_problems": 9}', '{"step": 1, "reward": 0.5}', '{"step": 2, "rew',
             '{"step": 2, "reward": 0.6}', '{"step": 2, "heldout/accuracy": 0.3}', '{"note": "no step"}',
             '{"step": 3, "reward": 0.7}']
  (tmp_path / "metrics.jsonl").write_text("\n".join(metrics) + "\n")
  (tmp_path / "samples.jsonl").write_text('{"step": 2, "group": 0}\n{"step": 3, "group": 0}\n{"step": 3, "gr')
  (tmp_path / "other.jsonl").write_text('{"step": 9}\n')  # not an output of the writer
  w = MetricsWriter(tmp_path, tensorboard=False)
  w.resume_from(2, ("metrics.jsonl", "samples.jsonl"))
  w.write(3, {"reward": 0.75})
  w.append_jsonl("samples.jsonl", [{"step": 3, "group": 1}])
  w.close()
  lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert lines == [json.loads(metrics[i]) for i in (0, 1, 3, 4, 5)] + [{"step": 3, "reward": 0.75}]
  samples = [json.loads(l) for l in (tmp_path / "samples.jsonl").read_text().splitlines()]
  assert samples == [{"step": 2, "group": 0}, {"step": 3, "group": 1}]
  assert (tmp_path / "other.jsonl").read_text() == '{"step": 9}\n'
  assert "metrics.jsonl: dropped 2 line(s) of steps after 2" in caplog.text
  # A fresh start (no checkpoint): nothing of the earlier attempt stays, every record is redone.
  w = MetricsWriter(tmp_path, tensorboard=False)
  w.resume_from(-1, ("metrics.jsonl",))
  w.close()
  assert [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [{"note": "no step"}]


@settings(deadline=None)
@given(steps=st.lists(st.integers(0, 6), max_size=12), cut=st.integers(-1, 6),
       torn=st.integers(0, 40), newline=st.booleans())
def test_resume_from_keeps_exactly_the_parsable_records_through_the_cut(steps, cut, torn, newline):
  records = [{"step": s, "i": i, "text": "é\\n"} for i, s in enumerate(steps)]
  text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
  tail = json.dumps({"step": 0, "i": -1}, ensure_ascii=False)
  raw = text.encode() + tail.encode()[:torn] + (b"\n" if newline and torn else b"")
  with tempfile.TemporaryDirectory() as d:
    (Path(d) / "metrics.jsonl").write_bytes(raw)
    w = MetricsWriter(d, tensorboard=False)
    w.resume_from(cut, ("metrics.jsonl",))
    w.write(cut + 1, {"reward": 1.0})
    w.close()
    got = [json.loads(l) for l in (Path(d) / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
  whole = records + ([{"step": 0, "i": -1}] if torn >= len(tail) else [])
  assert got == [r for r in whole if r["step"] <= cut] + [{"step": cut + 1, "reward": 1.0}]
