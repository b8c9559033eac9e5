"""Supervised fine-tuning: data encoding, bucketing, a short run, saving, the CLI."""

import collections
import json
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from epgrpo_jax import sft as sft_command
from epgrpo_jax.supervised import sft as S
from epgrpo_jax.io.records import read_rows
from epgrpo_jax.tasks import arithmetic as A


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
  return A.build_assets(tmp_path_factory.mktemp("data"), seed=0, train_per_level=20,
                        heldout_per_level=4, verbose=False)


@pytest.fixture(scope="module")
def tokenizer(assets):
  from transformers import AutoTokenizer

  return AutoTokenizer.from_pretrained(assets.model_dir)


def _cfg(assets, **kw):
  base = dict(model=str(assets.model_dir), data=str(assets.train_file), verbose=False)
  return S.SFTConfig(**{**base, **kw})


def test_encode_rows_masks_completion_only(assets, tokenizer):
  rows = assets.train_rows()[:3] + [{"problem": "Compute 1+1."}, {"problem": "", "solution": "x"}]
  skipped = {}
  cfg = _cfg(assets)
  examples = S.encode_rows(tokenizer, rows, cfg, skipped)
  assert len(examples) == 3 and skipped == {"missing_field": 2}
  ids, n_prompt = examples[0]
  prompt = tokenizer.apply_chat_template([{"role": "user", "content": rows[0]["problem"]}],
                                         add_generation_prompt=True, tokenize=False)
  assert tokenizer.decode(ids[:n_prompt]) == prompt
  assert tokenizer.decode(ids[n_prompt:]) == rows[0]["solution"] + "<|im_end|>"
  batch = S._pad_batch(examples, 64, tokenizer.pad_token_id)
  loss_mask = batch["loss_mask_BxT"][0]
  assert loss_mask[:n_prompt].sum() == 0 and loss_mask[n_prompt:len(ids)].all()
  assert loss_mask[len(ids):].sum() == 0 and batch["mask_BxT"][0].sum() == len(ids)
  too_long = S.encode_rows(tokenizer, rows[:1], _cfg(assets, max_length=8), skipped)
  assert too_long == [] and skipped["too_long"] == 1


def test_batches_bucketed_and_cover_every_example():
  rng = np.random.default_rng(0)
  examples = [(np.arange(n, dtype=np.int32), 2) for n in rng.integers(5, 70, 37)]
  stream = S.batches(examples, 4, (32, 48, 64, 96), pad_id=0, seed=1)
  seen = []
  for _ in range(10):  # one epoch: 37 examples -> 10 batches (the last one topped up)
    b = next(stream)
    length = b["tokens_BxT"].shape[1]
    assert length in (32, 48, 64, 96) and b["tokens_BxT"].shape[0] == 4
    assert b["mask_BxT"].sum(1).max() <= length
    seen += [tuple(row[m.astype(bool)]) for row, m in zip(b["tokens_BxT"], b["mask_BxT"])]
  assert {tuple(e[0]) for e in examples} <= set(seen)
  assert S.SFTConfig(model="", data="", max_length=200).bucket_lengths() == (32, 48, 64, 96, 128,
                                                                              192, 200)


def test_schedule_warmup_then_decay():
  cfg = S.SFTConfig(model="", data="", steps=100, lr=1e-3, warmup_ratio=0.1)
  sched = S.make_schedule(cfg)
  assert float(sched(0)) == 0.0 and float(sched(10)) == pytest.approx(1e-3)
  assert float(sched(99)) < 1e-5
  const = S.make_schedule(S.SFTConfig(model="", data="", steps=100, lr=1e-3,
                                      schedule="constant"))
  assert float(const(50)) == float(const(99)) == pytest.approx(1e-3)


def test_short_run_lowers_loss_and_saves(assets, tokenizer, tmp_path):
  from transformers import AutoTokenizer

  from epgrpo_jax.models import from_pretrained

  out = tmp_path / "sft"
  cfg = _cfg(assets, out=str(out), steps=40, batch_size=8, lr=3e-3, buckets=(64,), log_every=10)
  result = S.sft(cfg)
  losses = result.losses
  assert len(losses) == 40 and all(np.isfinite(losses))
  assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:3])
  assert result.path == out
  loaded = from_pretrained(out)
  assert AutoTokenizer.from_pretrained(out).get_vocab() == tokenizer.get_vocab()
  tokens = jnp.asarray([tokenizer("Compute 1+2.")["input_ids"]])
  pos = jnp.arange(tokens.shape[1])[None]
  want = result.model.logits(result.model(tokens, pos, jnp.ones_like(tokens))[0])
  got = loaded.logits(loaded(tokens, pos, jnp.ones_like(tokens))[0])
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


def test_lora_trains_adapters_only(assets, tokenizer):
  from flax import nnx

  from epgrpo_jax.models import BASE, LoraConfig, from_pretrained

  model = from_pretrained(assets.model_dir, lora=LoraConfig(rank=4, alpha=8.0))
  base_before = jax.tree.map(np.asarray, nnx.state(model, BASE))
  cfg = _cfg(assets, steps=3, batch_size=4, lora_rank=4, lora_alpha=8.0, buckets=(64,))
  S.train(model, tokenizer, assets.train_rows(), cfg)
  base_after = jax.tree.map(np.asarray, nnx.state(model, BASE))
  assert jax.tree.all(jax.tree.map(np.array_equal, base_before, base_after))
  lora_b = [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.LoRAParam))
            if x.shape[0] == 4]
  assert any(np.abs(b).max() > 0 for b in lora_b)  # B starts at zero and has moved


@pytest.mark.parametrize("argv,needle", [
    ([], "required"),
    (["--model", "M", "--data", "D", "--out", "O", "--steps", "x"], "invalid int"),
    (["--model", "M", "--data", "D", "--out", "O", "--steps", "0"], "steps: must be > 0"),
    (["--model", "M", "--data", "D", "--out", "O", "--schedule", "cubic"], "invalid choice"),
    (["--model", "/nonexistent", "--data", "D", "--out", "O"], "--model: /nonexistent does not exist"),
    (["--model", "/", "--data", "D", "--out", "O"], "--model: / has no config.json"),
])
def test_cli_usage_errors_exit_2_one_line(argv, needle, capsys):
  try:  # argparse's own errors exit; the others are returned as the exit code
    code = sft_command.main(argv)
  except SystemExit as exc:
    code = exc.code
  assert code == 2
  err = capsys.readouterr().err
  assert len(err.strip().splitlines()) == 1 and needle in err


def test_cli_process_no_traceback(assets, tmp_path):
  bad = tmp_path / "not-a-model"
  bad.mkdir()
  proc = subprocess.run([sys.executable, "-m", "epgrpo_jax.sft", "--model", str(bad), "--data",
                         str(assets.train_file), "--out", str(tmp_path / "o")],
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2
  lines = [l for l in proc.stderr.strip().splitlines() if "Traceback" in l or "error" in l]
  assert len(lines) == 1 and "no config.json" in lines[0]


@pytest.mark.slow
def test_cli_end_to_end(assets, tmp_path):
  out = tmp_path / "o"
  proc = subprocess.run([sys.executable, "-m", "epgrpo_jax.sft", "--model", str(assets.model_dir),
                         "--data", str(assets.train_file), "--out", str(out), "--steps", "3",
                         "--batch-size", "4", "--log-every", "1"],
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "[sft] step 3/3 loss" in proc.stdout
  assert json.loads((out / "config.json").read_text())["model_type"] == "qwen2"


def test_out_never_overwrites_the_inputs(assets, tmp_path, capsys):
  model = tmp_path / "model"
  shutil.copytree(assets.model_dir, model)
  before = {p.name: p.read_bytes() for p in model.iterdir() if p.is_file()}
  data = tmp_path / "data.jsonl"
  shutil.copyfile(assets.train_file, data)
  for out, needle in ((model, "is the input model"), (tmp_path, "holds the training data"),
                      (data, "exists and is not a directory")):
    code = sft_command.main(["--model", str(model), "--data", str(data), "--out", str(out), "--steps", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and needle in err[0], err
  assert {p.name: p.read_bytes() for p in model.iterdir() if p.is_file()} == before


def test_a_bad_data_line_is_a_counted_skip(assets, tmp_path):
  data = tmp_path / "data.jsonl"
  data.write_bytes(b"\xef\xbb\xbf" + assets.train_file.read_bytes() + b'{"broken": \n')
  counts = collections.Counter()
  rows = read_rows(data, counts)
  assert counts == {"bad_json": 1} and len(rows) == len(assets.train_rows())
