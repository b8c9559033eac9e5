"""EP-GRPO on a real checkpoint: the smoke config's steps, timed per phase, with memory.

Builds the trainer of `configs/qwen2.5-0.5b-real-smoke.yaml` (1 prompt x 8
samples, 256 new tokens, LoRA r32 on every linear layer, bf16 base) on
`--model`, runs its steps with `Trainer.step` and prints per step: sampling,
the rest before the update (scoring + reference passes, rewards, advantage),
the update, and the process's peak resident memory. Before the steps it
compiles the update program (with remat: its gradient program) for the
config's largest shapes and reads its `memory_analysis()` and optimised HLO:
every float32 buffer with a vocabulary-sized dimension is listed, and the check
is that none holds one logit row per scored token ([B, T, V]: the chunked
LM-head loss should keep them to chunks). Last, the merged policy is exported,
loaded by transformers, and its float32 logits are compared with ours.

  python benchmarks/real_rl_smoke.py [--model DIR] [--out DIR] [--compile-only] [key=value ...]

`--model` defaults to $EPGRPO_REAL_MODEL; extra arguments are config overrides.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "qwen2.5-0.5b-real-smoke.yaml"


def peak_rss_gib() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def vocab_buffers(hlo: str, vocab: int) -> list[tuple[str, int]]:
  """(shape text, elements) of every distinct float32 array in `hlo` with a `vocab` dimension."""
  found = {}
  for dims in re.findall(r"f32\[([\d,]+)\]", hlo):
    shape = [int(x) for x in dims.split(",")]
    if vocab in shape:
      n = 1
      for x in shape:
        n *= x
      found[f"f32[{dims}]"] = n
  return sorted(found.items(), key=lambda kv: -kv[1])


def main():
  from epgrpo_jax.io.paths import path_flag  # `~` in a path flag, as in the commands
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--model", type=path_flag, default=os.environ.get("EPGRPO_REAL_MODEL"))
  ap.add_argument("--out", type=path_flag, default="runs/real-rl-smoke")
  ap.add_argument("--compile-only", action="store_true",
                  help="only compile the update program and print its memory figures")
  ap.add_argument("overrides", nargs="*")
  args = ap.parse_args()
  if not args.model:
    ap.error("--model: required (or set EPGRPO_REAL_MODEL)")
  os.chdir(ROOT)  # the config's data path is relative to the repository root

  import jax
  import numpy as np

  from epgrpo_jax.training.config import load_config
  from epgrpo_jax.training.trainer import Trainer

  sys.path.insert(0, str(ROOT / "benchmarks"))
  import _common as C

  cfg = load_config(CONFIG, [f"model.path={args.model}", f"train.output_dir={args.out}",
                             *args.overrides])
  print(f"{C.machine_line()}; jax {jax.__version__}", flush=True)
  start = time.perf_counter()
  trainer = Trainer(cfg)
  state = trainer.initial_state()
  print(f"trainer built (model loaded, bf16 base + fp32 LoRA) in {time.perf_counter() - start:.1f}s; "
        f"peak RSS {peak_rss_gib():.2f} GiB", flush=True)
  steps = []
  try:
    mem, buffers, over = update_program_check(trainer)
    if args.compile_only:
      return 0
    for _ in range(cfg.train.steps):
      state, m, record = trainer.step(state)
      rest = m["step_time"] - m["sample_time"] - m["update_time"]
      steps.append({k: m[k] for k in ("reward", "kl", "loss", "grad_norm", "entropy",
                                      "completions/mean_length", "step_time", "sample_time",
                                      "update_time")} | {"rest_time": rest,
                                                         "peak_rss_gib": peak_rss_gib()})
      bad = [k for k, v in m.items() if isinstance(v, float) and not np.isfinite(v)]
      print(f"step {state.step}: sample {m['sample_time']:.1f}s, scoring+reference+reward+advantage "
            f"{rest:.1f}s, update {m['update_time']:.1f}s, step {m['step_time']:.1f}s; reward "
            f"{m['reward']:.2f} kl {m['kl']:.3e} loss {m['loss']:.3e} grad_norm {m['grad_norm']:.3f} "
            f"mean length {m['completions/mean_length']:.0f}; peak RSS {peak_rss_gib():.2f} GiB; "
            f"non-finite metrics: {bad or 'none'}; load {C.load1():.2f}", flush=True)

    # The merged export, in transformers vs ours (float32).
    export_start = time.perf_counter()
    policy = trainer.export(state.trainable, Path(args.out) / "policy")
    export_s = time.perf_counter() - export_start
    err = export_parity(policy, trainer)
    print(f"exported {policy} in {export_s:.1f}s; fp32 logits ours vs transformers on 2 prompts: "
          f"max abs diff {err:.2e}; peak RSS {peak_rss_gib():.2f} GiB", flush=True)
  finally:
    trainer.close()
  report = {"steps": steps, "update_temp_bytes": mem.temp_size_in_bytes,
            "vocab_buffers": buffers, "btv_buffers": over, "export_logit_diff": err,
            "peak_rss_gib": peak_rss_gib()}
  (Path(args.out) / "smoke.json").write_text(json.dumps(report, indent=2) + "\n")
  ok = (not over and err <= 1e-3 and all(s["kl"] > 0 for s in steps[1:])
        and all(np.isfinite([s["loss"], s["kl"], s["grad_norm"]]).all() for s in steps))
  print("PASS" if ok else "FAIL")
  return 0 if ok else 1


def update_program_check(trainer):
  """Compiles the update (with remat: its gradient program, which holds the loss) for a
  rollout of the config's largest shapes (the longest training prompt's bucket, every
  completion at max_new_tokens), before any step; prints XLA's memory figures and the
  float32 buffers with a vocabulary dimension. Returns (memory, buffers, [B, T, V] ones)."""
  import jax
  import jax.numpy as jnp

  from epgrpo_jax.rollout.sampling import bucket
  from epgrpo_jax.training.batches import CompletionBatch, UpdateBatch

  cfg, fns = trainer.cfg, trainer.fns
  b = cfg.train.prompts_per_step * cfg.train.num_generations
  tp = bucket(max(len(e.prompt_ids) for e in trainer.train_examples), cfg.sampling.prompt_buckets)
  n = bucket(cfg.sampling.max_new_tokens, cfg.sampling.length_buckets)
  i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
  f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
  flag = lambda *s: jax.ShapeDtypeStruct(s, jnp.bool_)
  batch = UpdateBatch(rollout=CompletionBatch(i32(b, tp), flag(b, tp), i32(b, n), flag(b, n)),
                      logp_old=f32(b, n), logp_ref=f32(b, n), advantage=f32(b, n))
  policy = trainer.policy
  opt_state = jax.eval_shape(trainer.tx.init, policy.trainable)
  rewards = f32(cfg.train.prompts_per_step, cfg.train.num_generations)
  start = time.perf_counter()
  if trainer.fused and fns.split_update:
    lowered = fns.fused_gradients_program.lower(policy.trainable, policy.frozen, policy.reference,
                                                batch.rollout, rewards)
  elif trainer.fused:
    lowered = fns.fused_program.lower(policy.trainable, opt_state, policy.frozen,
                                      policy.reference, batch.rollout, rewards)
  elif fns.split_update:
    lowered = fns.gradients_program(1).lower(policy.trainable, policy.frozen, batch)
  else:
    lowered = fns.update_program.lower(policy.trainable, opt_state, policy.frozen, batch)
  compiled = lowered.compile()
  seconds = time.perf_counter() - start
  mem = compiled.memory_analysis()
  v = trainer.model_cfg.vocab_size
  buffers = vocab_buffers(compiled.as_text(), v)
  over = [(s, e) for s, e in buffers if e >= b * n * v]
  which = ("fused " if trainer.fused else "") + (
      "gradient program (remat)" if fns.split_update else "update program")
  print(f"{which} for B={b}, prompt slots {tp}, completion N={n} (compiled in {seconds:.0f}s): "
        f"temporaries {mem.temp_size_in_bytes / 2**20:.0f} MiB, arguments "
        f"{mem.argument_size_in_bytes / 2**20:.0f} MiB, outputs {mem.output_size_in_bytes / 2**20:.0f} "
        f"MiB; one [B, N, V] float32 logits array would be {b * n * v * 4 / 2**20:.0f} MiB "
        f"([B, Tp + N - 1, V]: {b * (tp + n - 1) * v * 4 / 2**20:.0f} MiB); peak RSS "
        f"{peak_rss_gib():.2f} GiB")
  print("float32 buffers with a vocabulary dimension in the optimised HLO: "
        + (", ".join(f"{s} ({e * 4 / 2**20:.0f} MiB)" for s, e in buffers) or "none"))
  print(f"[B, T, V] float32 buffers: {'none' if not over else over}", flush=True)
  return mem, buffers, over


def export_parity(policy: Path, trainer) -> float:
  """Max abs difference of float32 logits, ours vs transformers, on the first 2 training prompts."""
  import numpy as np
  import torch
  from transformers import AutoModelForCausalLM

  from epgrpo_jax.models import from_pretrained
  from epgrpo_jax.rollout.sampling import left_pad

  prompts = [list(e.prompt_ids) for e in trainer.train_examples[:2]]
  ids, mask = left_pad(prompts, max(map(len, prompts)), trainer.pad_id)
  pos = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
  ours = from_pretrained(policy, dtype="float32", param_dtype="float32")
  hidden, _ = ours(ids, pos, mask)
  mine = np.asarray(ours.logits(hidden))
  del ours
  hf = AutoModelForCausalLM.from_pretrained(str(policy), dtype=torch.float32,
                                            attn_implementation="eager").eval()
  with torch.inference_mode():
    theirs = hf(input_ids=torch.as_tensor(ids, dtype=torch.long),
                attention_mask=torch.as_tensor(mask, dtype=torch.long),
                position_ids=torch.as_tensor(pos, dtype=torch.long)).logits.float().numpy()
  return float(np.abs(mine[mask] - theirs[mask]).max())


if __name__ == "__main__":
  sys.exit(main())
