"""The Fig 2(a) perturbation test: position selection, perturbation, continuation and scoring."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from epgrpo_jax.data import pipeline as data
from epgrpo_jax.evaluation.checkpoints import load_policy
from epgrpo_jax.experiments import perturb
from epgrpo_jax.models import load_tokenizer, stop_token_ids
from epgrpo_jax.rewards import RewardScorer, parse_gold
from epgrpo_jax.rollout.sampling import Sampler, SamplingConfig
from epgrpo_jax.tasks import arithmetic


def test_select_positions_high_low_random():
  rng = np.random.default_rng(0)
  entropy = np.zeros(30)
  entropy[[3, 17]] = 2.0  # the two highest
  entropy[[5, 9, 20]] = 1.0
  entropy += 0.5
  entropy[[0, 11]] = 0.0  # the two lowest (ties with nothing)
  # n = ceil(0.05 * 30) = 2
  assert perturb.select_positions(entropy, 0.05, "high", rng).tolist() == [3, 17]
  assert perturb.select_positions(entropy, 0.05, "low", rng).tolist() == [0, 11]
  random = perturb.select_positions(entropy, 0.05, "random", rng)
  assert len(random) == 2 and len(set(random.tolist())) == 2 and random.max() < 30
  # Ties go to the earlier position; at least one token even in a short response.
  assert perturb.select_positions(np.ones(10), 0.05, "high", rng).tolist() == [0]
  assert perturb.select_positions(np.ones(10), 0.05, "low", rng).tolist() == [0]
  with pytest.raises(ValueError):
    perturb.select_positions(entropy, 0.05, "middle", rng)


def test_perturbed_prefix_replaces_exactly_the_positions():
  rng = np.random.default_rng(1)
  tokens = np.arange(20) % 4
  candidates = np.array([0, 1, 2, 3])
  positions = np.array([2, 7])
  prefix = perturb.perturbed_prefix(tokens, positions, candidates, rng)
  assert len(prefix) == 8  # up to and including the last perturbed position
  changed = np.nonzero(prefix != tokens[:8])[0]
  assert changed.tolist() == [2, 7]
  assert set(prefix.tolist()) <= set(candidates.tolist())
  assert tokens[2] == 2  # the input is not modified


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  """The arithmetic task with its random-init tiny model (answers are almost never right)."""
  assets = arithmetic.build_assets(tmp_path_factory.mktemp("arith"), seed=0, train_per_level=40,
                                   heldout_per_level=2, verbose=False)
  tokenizer = load_tokenizer(assets.model_dir)
  model = load_policy(assets.model_dir)
  cfg = data.DataConfig(heldout_file=str(assets.heldout_file))
  examples, _ = data.load_examples([assets.heldout_file], data.PromptRenderer(tokenizer, cfg), cfg)
  examples = examples[:4]
  rows = {r["problem"]: r for r in assets.heldout_rows()}
  solutions = [np.array(tokenizer(rows[e.problem]["solution"], add_special_tokens=False)["input_ids"])
               for e in examples]
  sampler = Sampler(SamplingConfig(max_new_tokens=32, length_buckets=(32,)),
                    eos_ids=stop_token_ids(tokenizer, model.cfg), pad_id=tokenizer.pad_token_id)
  return dict(tokenizer=tokenizer, model=model, examples=examples, solutions=solutions,
              golds=[parse_gold(e.answer) for e in examples], sampler=sampler)


def test_perturbation_test_end_to_end(tiny):
  t = tiny
  rng = np.random.default_rng(0)
  with RewardScorer() as scorer:
    # A gold solution continued by nothing is scored correct: prefix + continuation is what counts.
    items = list(enumerate(t["solutions"]))
    full = perturb.continue_and_score(
        t["sampler"], t["model"], t["examples"], t["golds"], t["tokenizer"], scorer,
        items, continuations=2, key=jax.random.key(0), prompts_per_batch=4,
        max_total=0)
    assert full.shape == (4, 2) and full.min() == 1.0

    responses = [perturb.Response(problem=i, tokens=s, entropy=rng.random(len(s)))
                 for i, s in items]
    candidates = perturb.candidate_tokens(t["tokenizer"], t["model"].cfg.vocab_size)
    assert not set(candidates.tolist()) & set(t["tokenizer"].all_special_ids)
    result = perturb.perturbation_test(
        t["sampler"], t["model"], t["examples"], t["golds"], t["tokenizer"], scorer, responses,
        candidates=candidates, frac=0.05, continuations=2, key=jax.random.key(1), rng=rng,
        max_total=64, prompts_per_batch=4)
    assert set(result["conditions"]) == set(perturb.CONDITIONS)
    for c in result["conditions"].values():
      assert 0.0 <= c["drop"] <= 1.0 and c["stderr"] is not None
    high = result["conditions"]["high"]
    low = result["conditions"]["low"]
    assert high["mean_entropy"] > low["mean_entropy"]
    assert len(result["responses"]) == 4
    for r, resp in zip(result["responses"], responses):
      n = max(1, int(np.ceil(0.05 * len(resp.tokens))))
      assert len(r["high"]["positions"]) == n
      assert resp.entropy[r["high"]["positions"]].min() >= resp.entropy[r["low"]["positions"]].max()
    table = perturb.markdown(result, {"responses": 4, "frac": 0.05, "continuations": 2,
                                      "temperature": 1.0})
    assert "| high entropy |" in table and "paper: about 3.5x" in table

    kept, counts = perturb.sample_correct(
        t["sampler"], t["model"], t["examples"], t["golds"], t["tokenizer"], scorer, samples=2,
        key=jax.random.key(2), prompts_per_batch=4, max_responses=8)
    assert counts["sampled"] == 8 and len(kept) <= counts["correct"]
