"""A step's records on the host: the sampled round and the collected step (`Trainer.collect`),
the dynamic-sampling helpers that pick and merge groups, and the sample records of
samples.jsonl (read by the heat map). The step's metrics are in `metrics`."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import numpy as np

from epgrpo_jax.data import pipeline
from epgrpo_jax.io.metrics import token_strings
from epgrpo_jax.parallel import distributed
from epgrpo_jax.training.batches import CompletionBatch


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
  rollout: CompletionBatch
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
  sampled_prompts: int  # prompts sampled (dynamic sampling samples more than P)
  dynamic_metrics: dict[str, float]
  version_B: np.ndarray | None = None  # the policy version (optimizer steps) that sampled each
  rollout_metrics: dict[str, float] = dataclasses.field(default_factory=dict)  # `staleness`

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
            "entropy": self.entropy, "policy_version": self.version_B}


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


def decided_rewards(result, P: int, G: int):
  """`result` with process 0's rewards (float32) in every process: all select the same groups."""
  result.reward = distributed.broadcast_from_main(
      np.asarray(result.reward, np.float32).reshape(P, G)).reshape(-1)
  return result


def kept_batch(rounds: list[SampledRound], texts: list[list[str]], results: list, has_signal: np.ndarray,
               P: int, G: int, pad_id: int):
  """The P groups `select_groups` keeps of the groups drawn (`rounds`, their texts and reward
  results, in draw order): `(round, texts, rewards, selection metrics)`."""
  keep = select_groups(has_signal, P)
  batch = merge_rounds(rounds, keep, pad_id)
  all_texts = [x for sub in texts for x in sub]
  kept_texts = [all_texts[g * G + i] for g in keep for i in range(G)]
  kept_signal = int(has_signal[keep].sum())
  metrics = {
      "dynamic/dropped_groups": float((~has_signal).sum() - (P - kept_signal)),
      "dynamic/filled_zero_variance_groups": float(P - kept_signal),
      "dynamic/surplus_signal_groups": float(has_signal.sum() - kept_signal),
  }
  return batch, kept_texts, merge_rewards(results, keep, G), metrics


def dynamic_round_batch(cfg, sample_key: jax.Array, sample_round: Callable, score_rewards: Callable,
                        pad_id: int):
  """DAPO dynamic sampling: `(round, texts, rewards, metrics)` for P groups (`cfg`: the run's
  TrainConfig).

  `sample_round(key)` samples the data iterator's next P prompts (`Trainer.sample_round`) and
  `score_rewards(examples, completion_BxN, mask_BxN)` rewards them (`Trainer.score_rewards`).
  Round 0 samples with `sample_key` (what a step without dynamic sampling
  samples); extra round r with `fold_in(sample_key, r)` on the next batch of
  P prompts of the data iterator, until P groups with a reward signal are in
  hand or `dynamic_sampling.max_extra_rounds` are spent. `select_groups`
  then keeps P groups (see there); every round has the step's shapes, so
  nothing recompiles. The data iterator's position (checkpointed) counts
  every round.
  """
  P, G = cfg.train.prompts_per_step, cfg.train.num_generations
  rounds, texts, results, signal = [], [], [], []
  for r in range(1 + cfg.dynamic_sampling.max_extra_rounds):
    key = sample_key if r == 0 else jax.random.fold_in(sample_key, r)
    rnd = sample_round(key)
    text, result = score_rewards(rnd.examples, rnd.tokens.reshape(P * G, -1),
                                 rnd.mask.reshape(P * G, -1))
    result = decided_rewards(result, P, G)
    rounds.append(rnd)
    texts.append(text)
    results.append(result)
    signal.append(group_has_signal(result.reward.reshape(P, G), cfg.advantage.zero_std_tol))
    if np.concatenate(signal).sum() >= P:
      break
  batch, kept_texts, rewards, selection = kept_batch(rounds, texts, results, np.concatenate(signal),
                                                     P, G, pad_id)
  metrics = {"dynamic/rounds": float(len(rounds)), "dynamic/extra_prompts": float((len(rounds) - 1) * P),
             "dynamic/refilled_prompts": 0.0, "dynamic/unused_prompts": 0.0, **selection}
  return batch, kept_texts, rewards, metrics


def dynamic_refill_batch(cfg, sample_key: jax.Array, draw: Callable, sample_queue: Callable,
                         score_rewards: Callable, pad_id: int):
  """DAPO dynamic sampling refilled from the continuous engine's queue (`sampling.continuous`):
  `(round, texts, rewards, metrics)` for P groups, as `dynamic_round_batch`.

  `draw()` takes the data iterator's next P examples; `sample_queue(next_prompts, on_group,
  batches)` runs the engine (`rollout.continuous.sample_queue`). The engine starts with the
  first P prompts, sampled with `sample_key`. When the G completions of a prompt are done
  they are rewarded (`score_rewards`); a group without a reward signal queues the next
  prompt, from further batches of P taken from the iterator as they are needed (batch b
  sampled with `fold_in(sample_key, b)`: each prompt's keys are the rounds path's for the
  same draw), up to `dynamic_sampling.max_extra_rounds` batches. So the groups with a
  signal and those in flight stay P, and the prompts sampled are the shortest prefix of the
  draw order that holds P groups with a signal (or all the budget allows): `select_groups`
  keeps the groups `dynamic_round_batch` keeps from the same draws, in the step's shapes.
  The rest of the last batch taken is never sampled (`dynamic/unused_prompts`); the
  iterator (checkpointed) counts every batch taken.
  """
  P, G = cfg.train.prompts_per_step, cfg.train.num_generations
  batches = 1 + cfg.dynamic_sampling.max_extra_rounds
  examples, texts, results, signal = [], {}, {}, {}

  def next_prompts(b: int):
    examples.extend(draw())
    return [e.prompt_ids for e in examples[-P:]], sample_key if b == 0 else jax.random.fold_in(sample_key, b)

  def on_group(q: int, tokens_GxN: np.ndarray, mask_GxN: np.ndarray) -> bool:
    texts[q], result = score_rewards([examples[q]], tokens_GxN, mask_GxN)
    results[q] = decided_rewards(result, 1, G)
    signal[q] = group_has_signal(results[q].reward.reshape(1, G), cfg.advantage.zero_std_tol)[0]
    return not signal[q]

  out = sample_queue(next_prompts, on_group, batches)
  n = out.tokens.shape[0]
  drawn = SampledRound(examples[:n], out.prompt_ids, out.prompt_mask, out.tokens, out.mask, out.logp,
                       out.entropy)
  has_signal = np.asarray([signal[q] for q in range(n)], bool)
  batch, kept_texts, rewards, selection = kept_batch(
      [drawn], [[t for q in range(n) for t in texts[q]]], [results[q] for q in range(n)], has_signal,
      P, G, pad_id)
  metrics = {"dynamic/rounds": float(len(examples) // P), "dynamic/extra_prompts": float(n - P),
             "dynamic/refilled_prompts": float(n - P), "dynamic/unused_prompts": float(len(examples) - n),
             **selection}
  return batch, kept_texts, rewards, metrics


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
