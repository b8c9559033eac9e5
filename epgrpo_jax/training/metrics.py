"""The metrics of an RL step (metrics.jsonl): rewards, lengths, entropy and the update's
metrics with TRL's names where TRL has the metric, the sampler/trainer mismatch, the
advantage's diagnostics, and the step's timings, throughput and FLOP utilisation."""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np

from epgrpo_jax.models import flops
from epgrpo_jax.parallel import distributed
from epgrpo_jax.training.config import TrainConfig
from epgrpo_jax.training.rollouts import Collected, truncated_rows


def step_report(cfg: TrainConfig, c: Collected, update_metrics: list[dict], new_state: Any, *,
                update_time: float, step_time: float, completion_tokens: int, prompt_tokens: int,
                schedule: Callable, model_cfg: Any, eos_ids, fused: bool) -> dict[str, float]:
  """Every metric of the step that collected `c` and made the updates of `update_metrics` (on
  the host), ending in `new_state` (`trainer.RunState`)."""
  t, G = cfg.train, cfg.train.num_generations
  metrics = step_metrics(
      rewards=c.rewards, rewards_PxG=c.rewards_PxG, mask_BxN=c.completion_mask_BxN,
      entropy=distributed.to_host(c.entropy), update_metrics=update_metrics,
      adv_metrics=distributed.to_host(c.adv_metrics), eos_ids=eos_ids,
      completion_BxN=c.completion_BxN, entropy_mask_BxN=c.loss_mask_BxN)
  metrics.update(c.dynamic_metrics)
  metrics.update(c.rollout_metrics)
  if cfg.loss.mask_truncated_completions:
    metrics["overlong/masked_frac"] = float(c.truncated_B.mean())
  if cfg.reward.overlong_buffer:
    metrics["overlong/penalty_mean"] = float(c.rewards.overlong_penalty.mean())
  optimizer_updates = new_state.step * t.num_iterations * t.mini_batches
  metrics.update({
      "learning_rate": float(schedule(max(optimizer_updates - 1, 0))),
      "step_time": step_time,
      "sample_time": c.sample_time,
      "update_time": update_time,
      "num_tokens": new_state.num_tokens,
      "tokens_per_second": completion_tokens / step_time,
      "sampling/tokens_per_second": completion_tokens / max(c.sample_time, 1e-9),
      "train/tokens_per_second": (t.num_iterations * (completion_tokens + prompt_tokens)
                                  / max(update_time, 1e-9)),
      "skipped_updates": new_state.skipped_updates,
      "num_samples": new_state.num_samples,
      "reward_timeouts": float(c.rewards.timeouts),
      "reward_errors": float(c.rewards.errors),
  })
  metrics.update(flops.update_performance(
      model_cfg, c.host.prompt_mask.sum(1), c.completion_mask_BxN.sum(1), G, update_time,
      full_finetune=cfg.model.full_finetune, fused=fused, iterations=t.num_iterations,
      peak=flops.peak_flops(jax.devices()[0].device_kind, cfg.logging.peak_tflops),
      chips=jax.device_count()))
  return metrics


def step_metrics(*, rewards, rewards_PxG, mask_BxN, entropy, update_metrics, adv_metrics, eos_ids,
                 completion_BxN, entropy_mask_BxN=None) -> dict[str, float]:
  """Per-step metrics with TRL's names where TRL has the metric.

  `entropy_mask_BxN` (default `mask_BxN`): the tokens the entropy mean is over."""
  lengths = mask_BxN.sum(axis=1)
  ended = ~truncated_rows(completion_BxN, mask_BxN, eos_ids)
  group_std = rewards_PxG.std(axis=1, ddof=1) if rewards_PxG.shape[1] > 1 else np.zeros(len(rewards_PxG))
  entropy_mask_BxN = mask_BxN if entropy_mask_BxN is None else entropy_mask_BxN
  mean_update = {k: float(np.mean([m[k] for m in update_metrics])) for k in update_metrics[0]}
  out = {
      "reward": float(rewards_PxG.mean()),
      "reward_std": float(group_std.mean()),
      "frac_reward_zero_std": float((group_std < 1e-6).mean()),
      "accuracy": float(np.mean(rewards.accuracy)),
      "format": float(np.mean(rewards.format)),
      "completions/mean_length": float(lengths.mean()),
      "completions/min_length": float(lengths.min()),
      "completions/max_length": float(lengths.max()),
      "completions/clipped_ratio": float(1.0 - ended.mean()),
      "entropy": float(np.where(entropy_mask_BxN, entropy, 0.0).sum()
                       / max(entropy_mask_BxN.sum(), 1)),
      "kl": mean_update["kl"],
      "clip_ratio/low_mean": mean_update["clip_ratio/low_mean"],
      "clip_ratio/high_mean": mean_update["clip_ratio/high_mean"],
      "clip_ratio/region_mean": mean_update["clip_ratio/region_mean"],
      "grad_norm": mean_update["grad_norm"],
      "loss": mean_update["loss"],
  }
  if "entropy_mask/kept_frac" in mean_update:
    out["entropy_mask/kept_frac"] = mean_update["entropy_mask/kept_frac"]
  out.update(mismatch_metrics(update_metrics))
  out.update({k: float(v) for k, v in adv_metrics.items()})
  return out


def mismatch_metrics(update_metrics: list[dict]) -> dict[str, float]:
  """The step's sampler/trainer mismatch and correction metrics (`core.mismatch`) from its
  updates' metrics: the largest `/max`, the smallest `/min`, the mean of the rest."""
  combine = lambda k: max if k.endswith("/max") else min if k.endswith("/min") else np.mean
  return {k: float(combine(k)([float(m[k]) for m in update_metrics])) for k in update_metrics[0]
          if k.startswith(("sampling/", "rollout_corr/"))}
