"""The RL loop: smoke run, loss on a fixed batch, on-policy ratio, reference = adapters off."""

from __future__ import annotations

import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from epgrpo_jax.training import batches, programs
from epgrpo_jax.training.config import TrainConfig
from epgrpo_jax.training.loop import train
from epgrpo_jax.training.trainer import Trainer
from epgrpo_jax.tasks import arithmetic


@pytest.fixture(scope="session")
def task(tmp_path_factory):
  """A random-init tiny model with the arithmetic tokenizer, and the task's splits."""
  return arithmetic.build_assets(tmp_path_factory.mktemp("arith"), seed=0, train_per_level=60,
                                 heldout_per_level=4, verbose=False)


def tiny_config(task, out_dir, *overrides: str) -> TrainConfig:
  return TrainConfig().override(
      f"model.path={task.model_dir}", f"data.train_files=[{task.train_file}]",
      f"data.heldout_file={task.heldout_file}", "data.prompt_template='{problem}'",
      "data.heldout_limit=8", "train.steps=2", "train.prompts_per_step=4",
      "train.num_generations=4", "sampling.max_new_tokens=16", "sampling.length_buckets=[16]",
      "lora.rank=4", "optim.learning_rate=1e-3", "optim.warmup_ratio=0.0",
      f"train.output_dir={out_dir}", "eval.samples=2", "eval.prompts_per_batch=8",
      "logging.progress=false", *overrides)


def fixed_rollout(trainer: Trainer, state, key):
  """One sampled batch and its scoring pass, with synthetic 0/1 rewards."""
  t = trainer.cfg.train
  examples = trainer.train_examples[:t.prompts_per_step]
  out = trainer.sampler.sample(trainer.params(state.trainable), [e.prompt_ids for e in examples],
                               num_samples=t.num_generations, key=key)
  b = t.prompts_per_step * t.num_generations
  rollout = batches.CompletionBatch(prompt_ids=jnp.repeat(out.prompt_ids, t.num_generations, 0),
                          prompt_mask=jnp.repeat(out.prompt_mask, t.num_generations, 0),
                          completion=out.tokens.reshape(b, -1), completion_mask=out.mask.reshape(b, -1))
  return rollout


def scored_batch(trainer: Trainer, state, key, advantage_fn) -> batches.UpdateBatch:
  """`fixed_rollout` with its scoring and reference passes and `advantage_fn(b, n)`."""
  rollout = fixed_rollout(trainer, state, key)
  logp_old, _, logp_ref = trainer.fns.score(state.trainable, trainer.policy.frozen,
                                            trainer.policy.reference, rollout)
  return batches.UpdateBatch(rollout=rollout, logp_old=logp_old, logp_ref=logp_ref,
                           advantage=advantage_fn(*rollout.completion.shape))


@pytest.mark.parametrize("overrides", [(), ("train.reuse_sampler_logprobs=true",),
                                       ("train.grad_accumulation=2", "model.remat=true")],
                         ids=["scoring-pass", "sampler-logprobs", "accumulation-remat"])
def test_smoke_run_writes_metrics_checkpoint_and_policy(task, tmp_path, overrides):
  cfg = tiny_config(task, tmp_path / "run", *overrides)
  summary = train(cfg)
  assert summary["steps"] == 2
  assert 0.0 <= summary["heldout_before"]["accuracy"] <= 1.0
  before, after, gain = (summary[k] for k in ("heldout_before", "heldout_after", "heldout_gain"))
  assert gain["accuracy"] == pytest.approx(after["accuracy"] - before["accuracy"], abs=1e-6)
  assert 0.0 <= gain["accuracy_se"] <= 1.0 and 0.0 <= before["accuracy_se"] <= 1.0
  lines = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  step_lines = [l for l in lines if "reward" in l]
  assert [l["step"] for l in step_lines] == [1, 2]
  for key in ("reward", "reward_std", "frac_reward_zero_std", "kl", "entropy", "grad_norm",
              "learning_rate", "completions/mean_length", "clip_ratio/region_mean", "ep/gate_mean"):
    assert np.isfinite(step_lines[-1][key]), key
  assert (tmp_path / "run" / "checkpoints" / "2").is_dir()
  assert (tmp_path / "run" / "policy" / "model.safetensors").is_file()
  assert (tmp_path / "run" / "config.yaml").is_file()


def test_loss_decreases_on_fixed_batch_and_first_ratio_is_one(task, tmp_path):
  trainer = Trainer(tiny_config(task, tmp_path / "run", "train.num_iterations=4"))
  try:
    state = trainer.initial_state()
    batch = scored_batch(trainer, state, jax.random.key(0), lambda b, n: jnp.where(
        jnp.arange(b)[:, None] % 2 == 0, 1.0, -1.0) * jnp.ones((b, n)))
    trainable, opt_state = state.trainable, state.opt_state
    losses, ratios = [], []
    for _ in range(6):
      trainable, opt_state, m = trainer.fns.update(trainable, opt_state, trainer.policy.frozen, batch)
      losses.append(float(m["loss"]))
      ratios.append(float(m["ratio/mean"]))
    assert ratios[0] == pytest.approx(1.0, abs=1e-6)  # first update: pi_theta == pi_old
    assert losses[-1] < losses[0]
  finally:
    trainer.close()


def test_on_policy_ratio_is_exactly_one(task, tmp_path):
  trainer = Trainer(tiny_config(task, tmp_path / "run"))  # num_iterations=1: on-policy update
  try:
    state = trainer.initial_state()
    rollout = fixed_rollout(trainer, state, jax.random.key(1))
    b, n = rollout.completion.shape
    batch = batches.UpdateBatch(rollout=rollout, logp_old=jnp.zeros((b, n)),  # ignored on-policy
                              logp_ref=jnp.zeros((b, n)), advantage=jnp.ones((b, n)))
    _, _, m = trainer.fns.update(state.trainable, state.opt_state, trainer.policy.frozen, batch)
    assert float(m["ratio/mean"]) == 1.0
    assert float(m["clip_ratio/region_mean"]) == 0.0
  finally:
    trainer.close()


def test_reference_pass_uses_adapters_off(task, tmp_path):
  trainer = Trainer(tiny_config(task, tmp_path / "run"))
  try:
    state = trainer.initial_state()
    rollout = fixed_rollout(trainer, state, jax.random.key(2))
    mask = np.asarray(rollout.completion_mask)
    logp_old, _, logp_ref = trainer.fns.score(state.trainable, trainer.policy.frozen,
                                              trainer.policy.reference, rollout)
    # LoRA B = 0 at the start: the same policy (up to float rounding of fused matmuls).
    np.testing.assert_allclose(np.asarray(logp_old)[mask], np.asarray(logp_ref)[mask], atol=1e-6)
    b, n = rollout.completion.shape
    batch = batches.UpdateBatch(rollout=rollout, logp_old=logp_old, logp_ref=logp_ref,
                              advantage=jnp.ones((b, n)))
    trainable, opt_state = state.trainable, state.opt_state
    for _ in range(2):
      trainable, opt_state, _ = trainer.fns.update(trainable, opt_state, trainer.policy.frozen, batch)
    new_old, _, new_ref = trainer.fns.score(trainable, trainer.policy.frozen,
                                            trainer.policy.reference, rollout)
    assert np.abs(np.asarray(new_old - new_ref)[mask]).max() > 1e-4  # adapters moved the policy
    assert np.array_equal(np.asarray(new_ref)[mask], np.asarray(logp_ref)[mask])  # ref is frozen
    # The reference-only program (used when the sampler's log-probs stand in for scoring).
    alone = trainer.fns.reference(trainable, trainer.policy.frozen, trainer.policy.reference, rollout)
    np.testing.assert_allclose(np.asarray(alone)[mask], np.asarray(new_ref)[mask], atol=1e-6)
  finally:
    trainer.close()


TIMINGS = ("step_time", "sample_time", "update_time", "tokens_per_second",
           "sampling/tokens_per_second", "train/tokens_per_second", "perf/update_tflops", "perf/mfu")


@pytest.mark.parametrize("overrides", [(), ("model.remat=true",), ("model.full_finetune=true",),
                                       ("advantage.entropy_gate=false",
                                        "advantage.progress_signal=false",
                                        "advantage.zero_variance_anchor=false")],
                         ids=["epgrpo", "remat", "full-finetune", "grpo"])
def test_fused_update_equals_the_separate_programs(task, tmp_path, overrides):
  """The one-program on-policy update (scoring, reference, advantage, loss, backward, optimizer),
  at the first step (policy = reference) and after the adapters moved: its log-probs and
  entropies equal the separate scoring program's, and from those the separate advantage and
  update programs give its advantage, metrics and new parameters (1e-5). At the first step its
  progress signal is exactly zero.

  The random model's entropies are nearly uniform, so the entropy gate (a z-score) magnifies
  the 1e-7 rounding between two forward passes a thousandfold: the passes are compared
  directly, and the later programs on the same inputs. `optim.eps=1e-4`: with Adam's 1e-8, the
  first step divides each gradient by its own size, and where a gradient is near zero rounding
  would decide the sign of a learning-rate-sized step."""
  trainer = Trainer(tiny_config(task, tmp_path / "run", "optim.eps=1e-4", *overrides))
  try:
    assert trainer.fused
    fns, frozen, reference = trainer.fns, trainer.policy.frozen, trainer.policy.reference
    t = trainer.cfg.train
    P, G = t.prompts_per_step, t.num_generations
    state = trainer.initial_state()
    rollout = fixed_rollout(trainer, state, jax.random.key(3))
    mask = np.asarray(rollout.completion_mask)
    rewards_PxG = jnp.asarray(np.random.default_rng(0).integers(0, 2, (P, G)),
                              jnp.float32).at[0].set(1.0)  # a zero-variance group too
    copy = lambda tree: jax.tree.map(jnp.copy, tree)
    real = lambda x: np.asarray(x)[mask]
    trainable, opt_state = state.trainable, state.opt_state
    for step in range(3):
      new_trainable, new_opt_state, metrics, scored = fns.fused_update(
          copy(trainable), copy(opt_state), frozen, reference, rollout, rewards_PxG)
      logp_old, entropy, logp_ref = fns.score(trainable, frozen, reference, rollout)
      for got, want in ((scored.logp_old, logp_old), (scored.entropy, entropy),
                        (scored.logp_ref, logp_ref)):
        np.testing.assert_allclose(real(got), real(want), atol=2e-6, rtol=1e-6)
      shape = (P, G, -1)
      adv, comps, adv_metrics = trainer.advantage_fn(
          rewards_PxG, scored.entropy.reshape(shape), scored.logp_old.reshape(shape),
          scored.logp_ref.reshape(shape), rollout.completion_mask.reshape(shape),
          cfg=trainer.cfg.advantage)
      chex.assert_trees_all_close((adv, comps, adv_metrics),
                                  (scored.advantage, scored.components, scored.adv_metrics),
                                  atol=1e-5, rtol=1e-5)
      batch = batches.UpdateBatch(rollout=rollout, logp_old=scored.logp_old,
                                logp_ref=scored.logp_ref, advantage=adv.reshape(P * G, -1))
      separate = fns.update(copy(trainable), copy(opt_state), frozen, batch)
      chex.assert_trees_all_close(separate, (new_trainable, new_opt_state, metrics), atol=1e-5,
                                  rtol=1e-5, custom_message=f"step {step + 1}")
      signal = np.asarray(scored.components.signal)
      if step == 0:
        # Exactly, by construction (the separate passes round apart at some shapes).
        assert np.all(signal == 0.0) and np.all(np.asarray(scored.components.progress) == 0.0)
      else:
        assert np.abs(signal).max() > 1e-4  # the policy moved
      trainable, opt_state = new_trainable, new_opt_state
  finally:
    trainer.close()


def digit_reward(completions: list[str], answers: list[str]) -> list[float]:
  """A dense reward (the share of digits): the random model earns rewards that vary in a group."""
  return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


def test_fused_training_steps_match_the_separate_programs(task, tmp_path):
  """Two training steps with and without the fused update: equal at step 1 (1e-5; the gradient
  norm 1e-4); at step 2 within 1e-3, since Adam's first step divides each gradient by its own
  size and so blows the paths' 1e-7 rounding apart on weights whose gradient is near zero.

  The gradient norm: the two programs' entropies round 1e-7 apart, the entropy gate magnifies
  that to ~1e-5 in the advantages, and since a group's advantages sum to about zero the
  gradient is a sum of cancelling terms: 4.3e-5 of the norm on an AMD EPYC (Zen 4)."""
  runs = []
  for fused in ("true", "false"):
    trainer = Trainer(tiny_config(task, tmp_path / fused, f"train.fused_update={fused}",
                                  f"reward.function={__name__}:digit_reward", "advantage.eps=1e-3"))
    try:
      assert trainer.fused == (fused == "true")
      state, metrics = trainer.initial_state(), []
      for _ in range(2):
        state, m, _ = trainer.step(state)
        metrics.append({k: v for k, v in m.items() if k not in TIMINGS})
      runs.append(metrics)
    finally:
      trainer.close()
  for step, tol in ((0, 1e-5), (1, 1e-3)):
    a, b = runs[0][step], runs[1][step]
    assert a.keys() == b.keys()
    for k in a:
      rtol = max(tol, 1e-4) if k == "grad_norm" else tol
      np.testing.assert_allclose(a[k], b[k], atol=tol, rtol=rtol, err_msg=f"step {step + 1}: {k}")
  assert runs[0][0]["ep/signal_abs_mean"] == 0.0  # the fused step 1: exactly


def test_fused_update_only_on_policy(task, tmp_path):
  """Several updates a step, micro-batches or the sampler's log-probs keep separate programs."""
  for overrides in (("train.num_iterations=2",), ("train.mini_batches=2",),
                    ("train.grad_accumulation=2",), ("train.reuse_sampler_logprobs=true",),
                    ("train.fused_update=false",)):
    trainer = Trainer(tiny_config(task, tmp_path / "run", *overrides))
    assert not trainer.fused and trainer.fns.fused_program is None, overrides
    trainer.close()


def test_gradient_accumulation_equals_one_pass(task, tmp_path):
  """Gradients of 2 micro-batches combined = the full batch's, for each loss aggregation."""
  from epgrpo_jax.core.losses import AGGREGATIONS, LossConfig
  trainer = Trainer(tiny_config(task, tmp_path / "run"))
  try:
    state = trainer.initial_state()
    batch = scored_batch(trainer, state, jax.random.key(4), lambda b, n: jnp.asarray(
        np.random.default_rng(0).standard_normal((b, n)), jnp.float32))
    # One update first, so that LoRA B != 0 and every adapter has a gradient.
    trainable, _, _ = trainer.fns.update(jax.tree.map(jnp.copy, state.trainable),
                                         jax.tree.map(jnp.copy, state.opt_state),
                                         trainer.policy.frozen, batch)
    assert len(AGGREGATIONS) == 3
    for aggregation in AGGREGATIONS:
      fns = programs.StepFunctions(trainer.policy.graphdef, trainer.tx,
                                loss_cfg=LossConfig(aggregation=aggregation), temperature=1.0,
                                on_policy=True, shardings=trainer.shardings,
                                model_cfg=trainer.model_cfg)
      full = fns.gradients(trainable, trainer.policy.frozen, batch)
      loss, aux, grads = fns.gradients(trainable, trainer.policy.frozen, batch, micro_batches=2)
      assert all(np.abs(np.asarray(g)).max() > 0 for g in jax.tree.leaves(full[2])), aggregation
      # atol 1e-6 (gradients here reach 0.15): the full batch and its halves may take other
      # float32 products on CPU (adapters folded or not, `Kernels.folds_adapters`), so
      # entries that cancel to near zero differ in rounding (1.7e-7 seen on one of 256).
      chex.assert_trees_all_close((loss, grads), (full[0], full[2]), rtol=1e-5, atol=1e-6)
      chex.assert_trees_all_close(aux, full[1], rtol=1e-5, atol=1e-6)
  finally:
    trainer.close()


def test_grad_accumulation_must_divide_the_update():
  with pytest.raises(ValueError, match="train.grad_accumulation"):
    TrainConfig().override("train.prompts_per_step=4", "train.num_generations=4",
                           "train.mini_batches=2", "train.grad_accumulation=3")
