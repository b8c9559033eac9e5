"""A step's records on the host: the sampled round and the collected step (`Trainer.collect`),
the dynamic-sampling helpers that pick and merge groups, the step's metrics, and the sample
records of samples.jsonl (read by the heat map)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from epgrpo_jax.data import pipeline
from epgrpo_jax.io.metrics import token_strings
from epgrpo_jax.training.programs import Rollout


@dataclasses.dataclass
class SampledRound:
  """One sampled batch on the host: P prompts and G completions of each."""

  examples: list  # [P] pipeline.Example
  prompt_ids: np.ndarray  # [P, Tp] left-padded
  prompt_mask: np.ndarray  # [P, Tp]
  tokens: np.ndarray  # [P, G, N]
  mask: np.ndarray  # [P, G, N]
  logp: np.ndarray  # [P, G, N]
  entropy: np.ndarray  # [P, G, N]


@dataclasses.dataclass
class Collected:
  """One step's rollout, rewards and token-level advantages (`Trainer.collect`)."""

  key: jax.Array  # the run's PRNG key after this step
  start: float  # perf_counter at the start of the step
  sample_time: float
  host: SampledRound
  texts: list[str]  # [B] decoded completions
  rewards: Any  # rewards.RewardResult
  rewards_PxG: np.ndarray
  rollout: Rollout
  completion_BxN: np.ndarray
  completion_mask_BxN: np.ndarray
  loss_mask_BxN: np.ndarray  # without truncated completions when they are masked
  truncated_B: np.ndarray
  # The scoring pass and advantage; None until the fused update computes them (`scored`).
  logp_old: jax.Array | None
  logp_ref: jax.Array | None
  entropy: jax.Array | None
  advantage: jax.Array | None  # [P, G, N]
  components: Any  # advantages.Components
  adv_metrics: dict[str, Any] | None
  rounds: int  # sampling rounds (dynamic sampling)
  dynamic_metrics: dict[str, float]

  @property
  def examples(self) -> list[pipeline.Example]:
    return self.host.examples

  @property
  def scored(self) -> bool:
    """Whether the scoring pass and advantage are in (else the fused update computes them)."""
    return self.advantage is not None

  def record(self) -> dict[str, Any]:
    """What `sample_records` and the heat map read."""
    return {"examples": self.examples, "texts": self.texts, "rewards": self.rewards,
            "rollout": self.rollout, "advantage": self.advantage, "components": self.components,
            "entropy": self.entropy}


def truncated_rows(completion_BxN: np.ndarray, mask_BxN: np.ndarray, eos_ids) -> np.ndarray:
  """bool [B]: completions that did not end with a stop token (cut at max_new_tokens)."""
  lengths = mask_BxN.sum(axis=1)
  last = np.take_along_axis(completion_BxN, np.maximum(lengths - 1, 0)[:, None], axis=1)[:, 0]
  return ~((lengths > 0) & np.isin(last, list(eos_ids)))


def group_has_signal(rewards_PxG: np.ndarray, zero_std_tol: float) -> np.ndarray:
  """bool [P]: groups whose rewards are not all equal (ddof=1 std >= the advantage's tolerance)."""
  r = np.asarray(rewards_PxG, np.float64)
  if r.shape[1] < 2:
    return np.zeros(r.shape[0], bool)
  return r.std(axis=1, ddof=1) >= zero_std_tol


def select_groups(has_signal_R: np.ndarray, size: int) -> np.ndarray:
  """The `size` groups a dynamic-sampling step trains on, as sorted indices into the R drawn.

  The first `size` groups with a signal in draw order; when fewer were drawn,
  the batch is filled with the earliest zero-variance groups (their outcome
  advantage is 0; EP-GRPO's anchor can still use them), so its shape is static.
  """
  signal = np.flatnonzero(has_signal_R)[:size]
  fill = np.flatnonzero(~np.asarray(has_signal_R, bool))[:size - len(signal)]
  return np.sort(np.concatenate([signal, fill])).astype(np.int64)


def merge_rounds(rounds: list[SampledRound], keep: np.ndarray, pad_id: int) -> SampledRound:
  """The groups `keep` (indices into the rounds' groups, concatenated) as one round; prompts
  are left-padded to the widest round's prompt width."""
  width = max(r.prompt_ids.shape[1] for r in rounds)
  pad = lambda a, value: np.pad(a, ((0, 0), (width - a.shape[1], 0)), constant_values=value)
  cat = lambda get: np.concatenate([get(r) for r in rounds])[keep]
  examples = [e for r in rounds for e in r.examples]
  return SampledRound(examples=[examples[i] for i in keep],
                      prompt_ids=cat(lambda r: pad(r.prompt_ids, pad_id)),
                      prompt_mask=cat(lambda r: pad(r.prompt_mask, False)),
                      tokens=cat(lambda r: r.tokens), mask=cat(lambda r: r.mask),
                      logp=cat(lambda r: r.logp), entropy=cat(lambda r: r.entropy))


def merge_rewards(results: list, keep: np.ndarray, G: int):
  """The RewardResult of the groups `keep` of the rounds' results (counts summed over all)."""
  rows = (keep[:, None] * G + np.arange(G)[None, :]).reshape(-1)
  cat = lambda name: np.concatenate([np.asarray(getattr(r, name)) for r in results])[rows]
  pick = lambda name: [x for r in results for x in getattr(r, name)]
  answers, status = pick("answers"), pick("status")
  merged = dataclasses.replace(
      results[0], reward=cat("reward"), accuracy=cat("accuracy"), format=cat("format"),
      answers=[answers[i] for i in rows], status=[status[i] for i in rows],
      **{k: sum(getattr(r, k) for r in results)
         for k in ("timeouts", "errors", "fast", "checked", "seconds")})
  if results[0].overlong_penalty is not None:
    merged.overlong_penalty = cat("overlong_penalty")
  return merged


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


def sample_records(step: int, record: dict, count: int, tokenizer=None) -> list[dict]:
  """One JSON record per group for the first `count` groups of a step (samples.jsonl).

  Each response has its text, reward and, per token (lists of rounded floats):
  entropy, gate W, outcome advantage W * A_i, anchored signal s~, progress
  advantage, final advantage, tau and bucket; `tokens` (display strings) when
  a tokenizer is given, else only `token_ids`. Read by `epgrpo_jax.tools.heatmap`.
  """
  examples, texts, rewards = record["examples"], record["texts"], record["rewards"]
  P = len(examples)
  G = len(texts) // P
  c = record["components"]
  per_token = {
      "entropy": np.asarray(record["entropy"]).reshape(P, G, -1),
      "gate": np.asarray(c.gate), "outcome": np.asarray(c.outcome_token),
      "signal": np.asarray(c.signal), "progress": np.asarray(c.progress),
      "advantage": np.asarray(record["advantage"]), "tau": np.asarray(c.tau)}
  bucket = np.asarray(c.bucket)
  token_ids = np.asarray(record["rollout"].completion).reshape(P, G, -1)
  mask = np.asarray(record["rollout"].completion_mask).reshape(P, G, -1)
  reward = np.asarray(rewards.reward, np.float64).reshape(P, G)
  outcome, anchor = np.asarray(c.outcome), np.asarray(c.anchor)
  zero_variance = np.asarray(c.zero_variance)
  answers = list(getattr(rewards, "answers", None) or [None] * (P * G))
  rnd = lambda x: (np.round(np.asarray(x, np.float64), 4) + 0.0).tolist()  # + 0.0: no -0.0
  out = []
  for p, e in enumerate(examples[:count]):
    responses = []
    for g in range(G):
      keep = mask[p, g].astype(bool)
      ids = token_ids[p, g][keep].tolist()
      r = {"sample": g, "completion": texts[p * G + g], "reward": float(reward[p, g]),
           "extracted": answers[p * G + g], "outcome_adv": round(float(outcome[p, g]), 5),
           "anchor": float(anchor[p, g]), "length": len(ids), "token_ids": ids}
      if tokenizer is not None:
        r["tokens"] = token_strings(tokenizer, ids)
      r.update({k: rnd(v[p, g][keep]) for k, v in per_token.items()})
      r["bucket"] = bucket[p, g][keep].astype(int).tolist()
      responses.append(r)
    out.append({"step": step, "group": p, "problem_id": e.id, "prompt": e.problem,
                "answer": e.answer, "zero_variance": bool(zero_variance[p]),
                "reward_mean": float(reward[p].mean()), "responses": responses})
  return out
