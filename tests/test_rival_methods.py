"""The rival methods of issue 25: 80/20 token selection, GSPO, DAPO overlong handling and
dynamic sampling. Literal oracles on small cases (jit and no-jit), the options off equal
today's results, and dynamic sampling's static shapes and exact data order on resume."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from epgrpo_jax.data import pipeline as data
from epgrpo_jax.training.config import TrainConfig
from epgrpo_jax.core.losses import (LossConfig, high_entropy_mask, masked_quantile, policy_loss,
                               sequence_log_ratio)
from epgrpo_jax.rewards import RewardResult, overlong_penalty
from epgrpo_jax.training.rollouts import (SampledRound, group_has_signal, merge_rewards, merge_rounds,
                                          select_groups, truncated_rows)
from epgrpo_jax.training.trainer import Trainer

from helpers import Events, arithmetic_task, rl_step_config

LN2 = float(np.log(2.0))


class HighEntropyMaskTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_quantile_and_mask_literal(self):
    # Real tokens 0.1 0.9 0.5 0.3 | 0.7 0.2; padding holds larger values that must not count.
    entropy = jnp.array([[0.1, 0.9, 0.5, 0.3], [0.7, 0.2, 5.0, 9.0]])
    mask = jnp.array([[True, True, True, True], [True, True, False, False]])
    quantile = self.variant(masked_quantile, static_argnums=2)
    # Sorted 0.1 0.2 0.3 0.5 0.7 0.9: q = 0.5 -> p = 2.5 -> (0.3 + 0.5) / 2.
    np.testing.assert_allclose(quantile(entropy, mask, 0.5), 0.4, rtol=1e-6)
    np.testing.assert_allclose(quantile(entropy, mask, 0.8), 0.7, rtol=1e-6)  # p = 4
    np.testing.assert_allclose(quantile(entropy, mask, 1.0), 0.9, rtol=1e-6)
    select = self.variant(high_entropy_mask, static_argnames="quantile")
    # Top 20%: threshold = the 0.8-quantile 0.7 -> keeps 0.9 and 0.7 (ties kept).
    np.testing.assert_array_equal(select(entropy, mask, quantile=0.2),
                                  [[False, True, False, False], [True, False, False, False]])
    # Top 50%: threshold 0.4 -> 0.9, 0.5, 0.7.
    np.testing.assert_array_equal(select(entropy, mask, quantile=0.5),
                                  [[False, True, True, False], [True, False, False, False]])
    assert not select(entropy, jnp.zeros_like(mask), quantile=0.2).any()

  def test_quantile_matches_numpy(self):
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 3, (5, 7)).astype(np.float32)
    mask = rng.uniform(size=(5, 7)) < 0.6
    quantile = jax.jit(masked_quantile, static_argnums=2)
    for q in (0.0, 0.2, 0.37, 0.8, 1.0):
      np.testing.assert_allclose(quantile(jnp.asarray(x), jnp.asarray(mask), q),
                                 np.quantile(x[mask], q), rtol=1e-6)


class RivalLossTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_top_entropy_surrogate_and_kl_literal(self):
    # On-policy (ratio 1), A = (1, 2, 3), entropies (0.1, 0.5, 0.3). Top third: the
    # threshold is the 2/3-quantile 0.3 + (1/3) 0.2; only token 1 keeps its surrogate.
    # KL on every token: only token 0 has a reference gap, ln 2 -> KL 2 - ln 2 - 1.
    logp = jnp.zeros((1, 3))
    ref = jnp.array([[LN2, 0.0, 0.0]])
    adv = jnp.array([[1.0, 2.0, 3.0]])
    entropy = jnp.array([[0.1, 0.5, 0.3]])
    mask = jnp.ones((1, 3), bool)
    cfg = LossConfig(beta=0.1, top_entropy_quantile=1 / 3)
    fn = self.variant(lambda lp: policy_loss(lp, logp, ref, adv, mask, cfg, entropy))
    (loss, aux), grad = jax.value_and_grad(fn, has_aux=True)(logp)
    kl0 = 2.0 - LN2 - 1.0
    np.testing.assert_allclose(loss, (-2.0 + 0.1 * kl0) / 3, rtol=1e-6)
    # d/dlogp: surrogate -A/3 on token 1; KL beta (1 - e^gap) / 3 on token 0.
    np.testing.assert_allclose(grad, [[0.1 * (1 - 2.0) / 3, -2.0 / 3, 0.0]], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(aux["entropy_mask/kept_frac"], 1 / 3, rtol=1e-6)
    np.testing.assert_allclose(aux["kl"], kl0 / 3, rtol=1e-6)
    with pytest.raises(ValueError, match="entropy"):
      policy_loss(logp, logp, ref, adv, mask, cfg)

  @chex.variants(with_jit=True, without_jit=True)
  def test_gspo_sequence_ratio_and_clip_literal(self):
    # Sequence 0: log-ratios (0.2, -0.1) -> s0 = e^0.05; sequence 1: (0.3) -> s1 = e^0.3 > 1.2,
    # clipped (A > 0). Token level would clip token (0, 0) instead: e^0.2 > 1.2.
    logp_old = jnp.zeros((2, 2))
    logp = jnp.array([[0.2, -0.1], [0.3, 7.0]])
    adv = jnp.array([[1.0, 1.0], [1.0, 0.0]])
    mask = jnp.array([[True, True], [True, False]])
    s0 = np.exp(0.05)
    log_s = self.variant(sequence_log_ratio)(logp, logp_old, mask)
    np.testing.assert_allclose(log_s, [[0.05, 0.05], [0.3, 0.0]], rtol=1e-6)
    for aggregation, want in (("token_mean", -(2 * s0 + 1.2) / 3),
                              ("seq_mean_token_mean", -(s0 + 1.2) / 2)):
      cfg = LossConfig(beta=0.0, importance_sampling_level="sequence", aggregation=aggregation)
      fn = self.variant(lambda lp, cfg=cfg: policy_loss(lp, logp_old, logp_old, adv, mask, cfg))
      (loss, aux), grad = jax.value_and_grad(fn, has_aux=True)(logp)
      np.testing.assert_allclose(loss, want, rtol=1e-6)
      # GSPO-token gradient: s_i A d logp_t per token, then the aggregation's weights.
      w = [[1 / 3, 1 / 3], [0, 0]] if aggregation == "token_mean" else [[1 / 4, 1 / 4], [0, 0]]
      np.testing.assert_allclose(grad, -s0 * np.asarray(w), rtol=1e-5)
      np.testing.assert_allclose(aux["clip_ratio/high_mean"], 1 / 3, rtol=1e-6)
    token = policy_loss(logp, logp_old, logp_old, adv, mask, LossConfig(beta=0.0))[0]
    np.testing.assert_allclose(token, -(1.2 + np.exp(-0.1) + 1.2) / 3, rtol=1e-6)

  def test_gspo_on_policy_equals_token_level_with_token_mean(self):
    # Ratio 1: GSPO-token's gradient A d logp_t equals GRPO's (peers' notes).
    rng = np.random.default_rng(1)
    logp = jnp.asarray(rng.normal(-1, 0.5, (3, 5)), jnp.float32)
    ref = logp + 0.1
    adv = jnp.asarray(rng.normal(size=(3, 5)), jnp.float32)
    mask = jnp.asarray(rng.uniform(size=(3, 5)) < 0.7)
    grads = []
    for level in ("token", "sequence"):
      cfg = LossConfig(importance_sampling_level=level)
      fn = lambda lp, cfg=cfg: policy_loss(lp, jax.lax.stop_gradient(lp), ref, adv, mask, cfg)[0]
      grads.append(jax.jit(jax.grad(fn))(logp))
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-6, atol=1e-8)

  @chex.variants(with_jit=True, without_jit=True)
  def test_options_off_equal_todays_loss(self):
    """Golden numbers of `policy_loss` before issue 25 (commit c3c7fed), each aggregation."""
    rng = np.random.default_rng(7)
    b, t = 3, 4
    logp = jnp.asarray(rng.normal(-1, 0.5, (b, t)), jnp.float32)
    old = jnp.asarray(np.asarray(logp) + rng.normal(0, 0.3, (b, t)), jnp.float32)
    ref = jnp.asarray(np.asarray(logp) + rng.normal(0, 0.3, (b, t)), jnp.float32)
    adv = jnp.asarray(rng.normal(0, 1, (b, t)), jnp.float32)
    ent = jnp.asarray(rng.uniform(0, 2, (b, t)), jnp.float32)
    mask = jnp.array([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], bool)
    golden = {
        "token_mean": (-0.31233930587768555, [[0.004494453780353069, 7.790833478793502e-06,
                                               0.08418206125497818, 0.0129743916913867],
                                              [2.0635779947042465e-06, -0.010457450523972511, 0, 0],
                                              [3.634176391642541e-05, 0, 0, 0]]),
        "seq_mean_token_mean": (-0.6069788336753845,
                                [[0.002621764549985528, 4.544650437310338e-06,
                                  0.049106206744909286, 0.007568394765257835],
                                 [2.4074979592114687e-06, -0.012200359255075455, 0, 0],
                                 [8.479744428768754e-05, 0, 0, 0]]),
        "seq_sum_max_len": (-0.1821979284286499, [[0.002621764549985528, 4.544650437310338e-06,
                                                   0.049106206744909286, 0.007568394765257835],
                                                  [1.2037489796057343e-06, -0.006100179627537727,
                                                   0, 0],
                                                  [2.1199361071921885e-05, 0, 0, 0]]),
    }
    assert LossConfig() == LossConfig(top_entropy_quantile=1.0, importance_sampling_level="token",
                                      mask_truncated_completions=False)
    for aggregation, (want_loss, want_grad) in golden.items():
      cfg = LossConfig(aggregation=aggregation)
      fn = self.variant(lambda lp, cfg=cfg: policy_loss(lp, old, ref, adv, mask, cfg, ent))
      (loss, aux), grad = jax.value_and_grad(fn, has_aux=True)(logp)
      np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
      np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-9)
      assert "entropy_mask/kept_frac" not in aux

  def test_truncated_rows_masked_equal_rows_removed(self):
    # Overlong filtering through the mask: the loss equals the loss without those rows.
    rng = np.random.default_rng(2)
    logp = jnp.asarray(rng.normal(-1, 0.5, (4, 3)), jnp.float32)
    old = logp + 0.05
    adv = jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)
    mask = jnp.ones((4, 3), bool)
    truncated = np.array([False, True, False, True])
    loss = jax.jit(lambda *a: policy_loss(*a)[0], static_argnums=5)
    for aggregation in ("token_mean", "seq_mean_token_mean"):
      cfg = LossConfig(aggregation=aggregation)
      masked = loss(logp, old, old, adv, mask & ~truncated[:, None], cfg)
      keep = ~truncated
      removed = loss(logp[keep], old[keep], old[keep], adv[keep], mask[keep], cfg)
      np.testing.assert_allclose(masked, removed, rtol=1e-6)


def test_loss_config_validation():
  with pytest.raises(ValueError, match="top_entropy_quantile"):
    LossConfig(top_entropy_quantile=0.0)
  with pytest.raises(ValueError, match="importance_sampling_level"):
    LossConfig(importance_sampling_level="sentence")
  with pytest.raises(ValueError, match="overlong_buffer"):
    TrainConfig().override("reward.overlong_buffer=65")
  with pytest.raises(ValueError, match="max_extra_rounds"):
    TrainConfig().override("dynamic_sampling.max_extra_rounds=-1")


def test_overlong_penalty_literal():
  # DAPO eq. 13 with L_max = 10, L_cache = 4: 0 up to 6 tokens, then -(|y| - 6) / 4, -1 beyond.
  lengths = np.array([3, 6, 7, 8, 10, 12])
  np.testing.assert_allclose(overlong_penalty(lengths, max_len=10, buffer=4),
                             [0, 0, -0.25, -0.5, -1, -1])
  np.testing.assert_allclose(overlong_penalty(lengths, max_len=10, buffer=4, factor=0.5),
                             [0, 0, -0.125, -0.25, -0.5, -0.5])
  np.testing.assert_array_equal(overlong_penalty(lengths, max_len=10, buffer=0), np.zeros(6))


def test_truncated_rows_literal():
  eos = (2, 9)
  tokens = np.array([[5, 2, 0, 0], [5, 6, 7, 8], [9, 0, 0, 0], [5, 6, 7, 2], [0, 0, 0, 0]])
  mask = np.array([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], bool)
  np.testing.assert_array_equal(truncated_rows(tokens, mask, eos),
                                [False, True, False, False, True])


def test_group_signal_and_selection_literal():
  rewards = np.array([[1, 1], [0, 1], [0, 0], [1, 0], [0.5, 0.5]])
  has = group_has_signal(rewards, 1e-6)
  np.testing.assert_array_equal(has, [False, True, False, True, False])
  # Enough signal: the first `size` signal groups, in draw order.
  np.testing.assert_array_equal(select_groups(np.array([0, 1, 1, 0, 1, 1], bool), 3), [1, 2, 4])
  # Too few: filled with the earliest zero-variance groups, sorted back into draw order.
  np.testing.assert_array_equal(select_groups(has, 4), [0, 1, 2, 3])
  np.testing.assert_array_equal(select_groups(np.zeros(4, bool), 2), [0, 1])


def test_merge_rounds_and_rewards_literal():
  def rnd(tag, width):
    ids = np.full((2, width), tag, np.int32)
    return SampledRound(examples=[f"{tag}a", f"{tag}b"], prompt_ids=ids,
                        prompt_mask=np.ones((2, width), bool),
                        tokens=np.full((2, 1, 3), tag), mask=np.ones((2, 1, 3), bool),
                        logp=np.zeros((2, 1, 3)), entropy=np.zeros((2, 1, 3)))
  merged = merge_rounds([rnd(1, 2), rnd(2, 3)], np.array([1, 2]), pad_id=0)
  assert merged.examples == ["1b", "2a"]
  np.testing.assert_array_equal(merged.prompt_ids, [[0, 1, 1], [2, 2, 2]])
  np.testing.assert_array_equal(merged.prompt_mask, [[False, True, True], [True, True, True]])
  np.testing.assert_array_equal(merged.tokens[:, 0, 0], [1, 2])
  results = [RewardResult(reward=np.array([0., 1., 2., 3.]), accuracy=np.zeros(4),
                          format=np.ones(4), answers=list("abcd"), status=["fast"] * 4,
                          timeouts=1),
             RewardResult(reward=np.array([4., 5., 6., 7.]), accuracy=np.ones(4),
                          format=np.zeros(4), answers=list("efgh"), status=["custom"] * 4,
                          timeouts=2)]
  got = merge_rewards(results, np.array([1, 2]), 2)  # groups of G = 2 rows
  np.testing.assert_array_equal(got.reward, [2, 3, 4, 5])
  np.testing.assert_array_equal(got.accuracy, [0, 0, 1, 1])
  assert got.answers == list("cdef") and got.timeouts == 3


# ----------------------------------------------------------------------------
# Dynamic sampling in the trainer: static shapes, iterator position, resume.

def half_signal(completions: list[str], answers: list[str]) -> list[float]:
  """A reward with a signal only in groups whose gold answer has an even number of characters."""
  return [float(len(c) % 2 == 0) if len(a) % 2 == 0 else 0.0
          for c, a in zip(completions, answers)]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
  return arithmetic_task(tmp_path_factory.mktemp("arith"))


def test_dynamic_sampling_static_shapes_and_exact_resume(task, tmp_path):
  # Composed with EP-GRPO's advantage (the default), 80/20, GSPO and overlong filtering.
  cfg = rl_step_config(
      task, tmp_path / "run", "train.steps=3", f"reward.function={__name__}:half_signal",
      "dynamic_sampling.enabled=true", "dynamic_sampling.max_extra_rounds=1",
      "loss.top_entropy_quantile=0.5", "loss.importance_sampling_level=sequence",
      "loss.mask_truncated_completions=true")
  P, G = 4, 4
  # Start from empty JAX caches, so the count below is this test's own programs only and not
  # what earlier tests in the same worker left behind: once, in a full-suite xdist worker, step 2
  # counted one trace and no compile; it did not happen with the test run alone. A retrace that
  # step 2 causes itself is still counted.
  jax.clear_caches()
  trainer = Trainer(cfg)
  try:
    state = trainer.restore_or_init()
    state, m1, r1 = trainer.step(state)
    trainer.save(state)
    trainer.checkpointer.wait()
    with Events() as later:
      state, m2, r2 = trainer.step(state)
      jax.block_until_ready(state.trainable)
    assert (later.traces, later.compiles) == (0, 0), later.names  # other round counts, same programs
    rounds = [int(m["dynamic/rounds"]) for m in (m1, m2)]
    assert sum(rounds) > 2, rounds  # half the groups have no signal: extra rounds happen
    for m, rec, r in zip((m1, m2), (r1, r2), rounds):
      assert m["dynamic/extra_prompts"] == (r - 1) * P
      zero = np.asarray(rec["components"].zero_variance)
      assert m["dynamic/filled_zero_variance_groups"] == zero.sum()
      assert m["dynamic/dropped_groups"] >= 0 and 0 <= m["entropy_mask/kept_frac"] <= 1
      # (The random-init model rarely stops: most completions are truncated and masked.)
      assert (m["entropy_mask/kept_frac"] > 0) == (m["overlong/masked_frac"] < 1)
      assert m["num_samples"] == (sum(rounds[:1]) if m is m1 else sum(rounds)) * P * G
    # Overlong filtering: truncated completions have no token in the trained mask.
    rollout = r2["rollout"]
    trained = np.asarray(rollout.completion_mask)
    assert m2["overlong/masked_frac"] == pytest.approx((trained.sum(1) == 0).mean())
    # The data iterator stands exactly one batch per sampling round further on.
    reference = data.batch_iterator(len(trainer.train_examples), P, seed=cfg.train.seed)
    for _ in range(sum(rounds)):
      next(reference)
    assert trainer.data_iter.get_state() == reference.get_state()
    # Resume from the step-1 checkpoint (state, PRNG key and the iterator, restored in
    # place): step 2 draws the same prompts in the same rounds and samples the same.
    state = trainer.restore_or_init()
    assert state.step == 1 and state.num_samples == rounds[0] * P * G
    state, m2b, r2b = trainer.step(state)
    assert [e.id for e in r2b["examples"]] == [e.id for e in r2["examples"]]
    assert r2b["texts"] == r2["texts"]
    assert m2b["dynamic/rounds"] == m2["dynamic/rounds"]
    np.testing.assert_array_equal(r2b["rewards"].reward, r2["rewards"].reward)
    assert trainer.data_iter.get_state() == reference.get_state()
    check_soft_overlong_punishment(trainer)
  finally:
    trainer.close()


def check_soft_overlong_punishment(trainer: Trainer):
  """`Trainer.score_rewards` adds DAPO's penalty of each completion's length to the reward."""
  trainer.cfg = trainer.cfg.override("reward.overlong_buffer=4",
                                     "reward.overlong_penalty_factor=0.5")
  examples = trainer.train_examples[:4]  # P = 4 prompts, G = 4
  lengths = np.array([3, 12, 13, 16, 1, 4, 15, 14] * 2)  # max_new_tokens 16: penalty from 12 on
  mask = np.arange(16)[None, :] < lengths[:, None]
  texts, rewards = trainer.score_rewards(examples, np.full((16, 16), 5, np.int32), mask)
  base = np.asarray(half_signal(texts, [e.answer for e in examples for _ in range(4)]))
  penalty = 0.5 * np.array([0, 0, -0.25, -1.0, 0, 0, -0.75, -0.5] * 2)  # -(|y| - 12) / 4
  np.testing.assert_allclose(rewards.overlong_penalty, penalty)
  np.testing.assert_allclose(rewards.reward, base + penalty)
