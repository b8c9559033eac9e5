"""Where the KL to the reference of a stale batch comes from (`rollout.max_staleness`, docs/async.md).

Trains the embedded default (or `--config` with overrides) and, before each step's update, takes
the step's batch apart token by token: the k3 KL term of the loss, exp(g) - g - 1 with
g = log ref - log pi (pi: the trainer's policy at the update, the tokens: the sampler's, up to k
updates old), its mean and the share of its sum on the batch's largest token; the same mean
weighted by the truncated importance weight min(pi / mu, cap) (`loss.rollout_correction_kl`);
and the token that dominates (log pi, log ref, log mu). On a step whose plain mean exceeds
`--fresh-above`, the same prompts are sampled again by the current policy (on-policy) and the
plain k3 mean of that batch is printed too: the estimate the synchronous run would see.

  python benchmarks/stale_kl.py --steps 40 train.seed=1 rollout.max_staleness=1 \
      embedded.data_dir=... [--cap 2] [--fresh-above 0.5]

One JSON line per step, then a summary line. The update runs as separate programs
(train.fused_update=false), so the scoring pass's log-probs are at hand; the figures are those
of that run, not bit-identical to a fused one.
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def parse_args(argv=None):
  from epgrpo_jax.io.paths import path_flag  # `~` in a path flag, as in the commands
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--config", type=path_flag, default=None, help="config file (default: the embedded default)")
  ap.add_argument("--steps", type=int, default=40)
  ap.add_argument("--cap", type=float, default=2.0, help="the truncation of the importance weight")
  ap.add_argument("--fresh-above", type=float, default=0.5,
                  help="sample an on-policy batch of the same prompts when the plain KL exceeds this")
  ap.add_argument("--output-dir", type=path_flag, default="runs/stale-kl")
  ap.add_argument("overrides", nargs="*", help="dotted config overrides")
  return ap.parse_args(argv)


def token_kl(c, cap: float) -> dict:
  """The KL term of the batch `c` (a scored `Collected`) token by token."""
  mask = np.asarray(c.rollout.completion_mask, bool)
  logp, ref, mu = (np.asarray(x, np.float64)
                   for x in (c.logp_old, c.logp_ref, c.rollout.behaviour_logp))
  gap = np.where(mask, ref - logp, 0.0)
  kl = np.exp(gap) - gap - 1.0
  weight = np.minimum(np.exp(np.where(mask, logp - mu, 0.0)), cap)
  top = np.unravel_index(np.argmax(np.where(mask, kl, -1.0)), kl.shape)
  total = max(float(kl[mask].sum()), 1e-30)
  return {"kl": float(kl[mask].mean()), "kl_weighted": float((weight * kl)[mask].mean()),
          "top_token_share": float(kl[top]) / total, "top_token_kl": float(kl[top]),
          "top_token": {"position": int(top[1]), "length": int(mask[top[0]].sum()),
                        "logp": float(logp[top]), "logp_ref": float(ref[top]), "logp_sampler": float(mu[top])}}


def main(argv=None) -> None:
  args = parse_args(argv)
  from epgrpo_jax.training.config import load_config
  from epgrpo_jax.training.embedded import resolve_embedded
  from epgrpo_jax.training.trainer import Trainer

  cfg = load_config(args.config, [*args.overrides, f"train.steps={args.steps}", "checkpoint.every=0",
                                  "train.fused_update=false", "eval.before=false", "eval.after=false",
                                  f"train.output_dir={args.output_dir}"])
  trainer = Trainer(resolve_embedded(cfg, progress=False))
  rows = []
  try:
    state = trainer.restore_or_init()
    for _ in range(args.steps):
      c = trainer.collect(state, score=True)
      row = token_kl(c, args.cap)
      if row["kl"] > args.fresh_above:
        if trainer.rollouts is not None:
          trainer.rollouts.wait()  # the worker's rewards share the scorer
        row["kl_fresh_on_policy"] = token_kl(trainer.collect(state, c.host.examples, score=True),
                                             args.cap)["kl"]
      state, metrics, _ = trainer.update(state, c)
      row.update(step=state.step, staleness=metrics.get("rollout/staleness", 0.0))
      rows.append(row)
      print(json.dumps(row), flush=True)
  finally:
    trainer.close()
  spikes = [r for r in rows if "kl_fresh_on_policy" in r]
  print(json.dumps({"steps": len(rows), "kl_max": max(r["kl"] for r in rows),
                    "kl_weighted_max": max(r["kl_weighted"] for r in rows),
                    "spikes": [{k: r[k] for k in ("step", "kl", "kl_weighted", "kl_fresh_on_policy",
                                                  "top_token_share")} for r in spikes]}))


if __name__ == "__main__":
  main()
