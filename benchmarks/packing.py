"""Packed vs padded scoring + update (`train.packing`) on the bench workload, MATH lengths.

Two trainers on the same random `--preset` model (bench-tiny: vocab 1024, hidden 256, 4
layers, LoRA r 32 on every linear layer), one with `train.packing=true`, one without. Each
times its on-policy update of the same batches of P x G sequences: the fused program
(scoring, reference pass, advantage, loss, backward, AdamW), or with `--separate-programs`
the scoring program, the advantage program and the update program; the packed side's time
includes packing the batch on the host. The two alternate, round by round
(`_common.alternating_medians`), after one untimed call each (compilation).

Lengths come from the data: each prompt is a question of the shipped training set
(simplelr_math_l3to5) rendered as training renders it (the Qwen2.5 chat template, the MATH
prompt template, data.max_prompt_tokens), each completion is as long as a MATH solution
(the shipped set holds answers only; MATH500, shipped with the solutions, is MATH's test
split, written the same way) in Qwen2.5 tokens plus its EOS, cut at `--new-tokens`. The
tokens themselves are random (only lengths matter to the cost). Padded rows are
[prompt (left-padded to the prompt bucket) + completion (right-padded to the length
bucket)], as the trainer scores them; packed rows hold `train.packing_length` tokens.

Printed: seconds per call (all `--batches` batches), real tokens (prompt + completion) per
second of each, the ratio, and the slots each side computes.

  python benchmarks/packing.py [--prompts 4] [--samples 4] [--new-tokens 1024] [--batches 2]
      [--rounds 3] [--preset bench-tiny] [--dtype float32] [--separate-programs]
"""

from __future__ import annotations

import argparse
import gzip
import json
import lzma
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

import _common as C

REPO = Path(__file__).resolve().parents[1]
QWEN_TOKENIZER = REPO / "tests" / "assets" / "qwen2.5-tokenizer"


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  C.batch_shape_args(ap, prompts=4, samples=4, new_tokens=1024, max_prompt_tokens=512, prompts_help="P prompts per batch")
  ap.add_argument("--batches", type=int, default=2, help="distinct batches per timed call")
  ap.add_argument("--rounds", type=int, default=3, help="timed calls of each side")
  ap.add_argument("--preset", default="bench-tiny")
  ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                  help="weights and compute (model.dtype and param_dtype; LoRA stays float32)")
  ap.add_argument("--attention", default=None, choices=("auto", "plain", "blockwise", "cudnn"))
  ap.add_argument("--separate-programs", action="store_true",
                  help="train.fused_update=false: scoring, advantage and update programs")
  ap.add_argument("--seed", type=int, default=0)
  return ap.parse_args(argv)


def math_lengths(max_prompt_tokens: int, sample: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
  """(prompt lengths of `sample` training questions as rendered, MATH500 solution lengths + 1),
  in Qwen2.5 tokens; prompts over `max_prompt_tokens` are left out, as training skips them."""
  from epgrpo_jax.data.pipeline import DataConfig, PromptRenderer
  from epgrpo_jax.io import catalog
  from epgrpo_jax.models import load_tokenizer

  with tempfile.TemporaryDirectory() as tmp:
    with lzma.open(QWEN_TOKENIZER / "tokenizer.json.xz") as src, \
        open(Path(tmp) / "tokenizer.json", "wb") as out:
      shutil.copyfileobj(src, out)
    shutil.copyfile(QWEN_TOKENIZER / "tokenizer_config.json", Path(tmp) / "tokenizer_config.json")
    tokenizer = load_tokenizer(tmp)
  with gzip.open(catalog.DATA_DIR / catalog.TRAIN_SETS["simplelr_math_l3to5"].file, "rt") as f:
    questions = [json.loads(line)["question"] for line in f]
  with gzip.open(catalog.DATA_DIR / "benchmarks" / "math500.jsonl.gz", "rt") as f:
    solutions = [json.loads(line)["solution"] for line in f]
  rng = np.random.default_rng(seed)
  renderer = PromptRenderer(tokenizer, DataConfig(max_prompt_tokens=max_prompt_tokens))
  picked = rng.choice(len(questions), min(sample, len(questions)), replace=False)
  prompts = np.asarray([len(renderer.ids(questions[i])) for i in picked])
  completions = np.asarray([len(ids) + 1 for ids in tokenizer(solutions)["input_ids"]])
  if not (prompts <= max_prompt_tokens).any():
    print(f"packing.py: --max-prompt-tokens {max_prompt_tokens}: no training prompt fits (the "
          f"shortest of {prompts.size} drawn has {prompts.min()} tokens)", file=sys.stderr)
    sys.exit(2)
  return prompts[prompts <= max_prompt_tokens], completions


def batches(trainer, prompt_lengths, completion_lengths, count: int, seed: int):
  """`count` host rollouts of P x G rows with lengths drawn from the data, bucketed as the
  trainer buckets them, and their rewards [P, G]."""
  from epgrpo_jax.rollout.sampling import bucket
  from epgrpo_jax.training.batches import CompletionBatch

  cfg, t = trainer.cfg, trainer.cfg.train
  P, G, vocab = t.prompts_per_step, t.num_generations, trainer.model_cfg.vocab_size
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(count):
    lp_P = rng.choice(prompt_lengths, P)
    lc_B = np.minimum(rng.choice(completion_lengths, P * G), cfg.sampling.max_new_tokens)
    tp = bucket(int(lp_P.max()), cfg.sampling.prompt_buckets)
    n = min(bucket(int(lc_B.max()), cfg.sampling.length_buckets), cfg.sampling.max_new_tokens)
    prompt_mask_PxTp = np.arange(tp)[None] >= (tp - lp_P)[:, None]
    rollout = CompletionBatch(
        prompt_ids=np.repeat(rng.integers(3, vocab, (P, tp)) * prompt_mask_PxTp, G, 0),
        prompt_mask=np.repeat(prompt_mask_PxTp, G, 0),
        completion=rng.integers(3, vocab, (P * G, n)),
        completion_mask=np.arange(n)[None] < lc_B[:, None])
    out.append((rollout, rng.random((P, G)).astype(np.float32)))
  return out


class Side:
  """One trainer's on-policy updates of the batches, its state threaded through the calls."""

  def __init__(self, trainer):
    self.trainer = trainer
    state = trainer.initial_state()
    self.trainable, self.opt_state = state.trainable, state.opt_state

  def __call__(self, work) -> None:
    import jax

    from epgrpo_jax.parallel import distributed
    from epgrpo_jax.training.batches import UpdateBatch

    tr = self.trainer
    fns, frozen, reference = tr.fns, tr.policy.frozen, tr.policy.reference
    for host, rewards_PxG in work:
      rollout = distributed.place(tr.packed(host), tr.shardings.rollout())
      if tr.fused:
        self.trainable, self.opt_state, m, _ = fns.fused_update(
            self.trainable, self.opt_state, frozen, reference, rollout, rewards_PxG)
      else:
        logp_old, entropy, logp_ref = fns.score(self.trainable, frozen, reference, rollout)
        shape = rewards_PxG.shape + (-1,)
        adv, _, _ = tr.advantage_fn(rewards_PxG, entropy.reshape(shape), logp_old.reshape(shape),
                                    logp_ref.reshape(shape), rollout.completion_mask.reshape(shape),
                                    cfg=tr.cfg.advantage)
        batch = UpdateBatch(rollout, logp_old, logp_ref, adv.reshape(rollout.completion.shape))
        self.trainable, self.opt_state, m = fns.update(self.trainable, self.opt_state, frozen,
                                                       batch)
      jax.block_until_ready((self.trainable, m))


def main(argv=None) -> None:
  args = parse_args(argv)
  from epgrpo_jax.training.packing import fill, pack

  print(C.machine_line())
  prompt_lengths, completion_lengths = math_lengths(args.max_prompt_tokens, 2000, args.seed)
  print(f"prompts (rendered training questions, {len(prompt_lengths)} drawn): mean "
        f"{prompt_lengths.mean():.0f}, max {prompt_lengths.max()} tokens; completions (MATH500 "
        f"solutions + EOS, {len(completion_lengths)}): mean {completion_lengths.mean():.0f}, "
        f"median {np.median(completion_lengths):.0f}, max {completion_lengths.max()} tokens, "
        f"cut at {args.new_tokens}")
  shape = C.Shape(prompts=args.prompts, samples=args.samples, prompt_len=args.max_prompt_tokens,
                  new_tokens=args.new_tokens)
  extra = [f"train.fused_update={str(not args.separate_programs).lower()}",
           *C.dtype_overrides(args.dtype)]
  if args.attention:
    extra.append(f"model.attention={args.attention}")
  with tempfile.TemporaryDirectory() as tmp:
    tmp = Path(tmp)
    model_dir = C.build_model_dir(tmp / "model", args.preset, dtype=args.dtype)
    train_file = C.write_prompts(tmp / "train.jsonl", C.prompt_texts(8, args.max_prompt_tokens))
    sides = {name: C.make_trainer(model_dir, train_file, tmp / name, shape, *extra,
                                  f"train.packing={name == 'packed'}")
             for name in ("padded", "packed")}
    try:
      work = batches(sides["packed"], prompt_lengths, completion_lengths, args.batches, args.seed)
      runners = {name: Side(trainer) for name, trainer in sides.items()}
      for run in runners.values():
        run(work)  # compiles every shape of the batches
      with C.CompileCounter() as compiles:
        seconds = C.alternating_medians({k: (lambda r=r: r(work)) for k, r in runners.items()},
                                        args.rounds, reverse_odd_rounds=True)
      tr = sides["packed"]
      real = sum(int(r.prompt_mask.sum() + r.completion_mask.sum()) for r, _ in work)
      padded_slots = sum(r.prompt_ids.shape[1] + r.completion.shape[1] - 1
                         for r, _ in work) * args.prompts * args.samples
      packings = [pack(r.prompt_ids, r.prompt_mask, r.completion, r.completion_mask,
                       row_length=tr.packing_length) for r, _ in work]
      packed_slots = sum(p.tokens.size for p in packings)
      program = "score + advantage + update" if args.separate_programs else "fused update"
      print(f"{args.preset} ({args.dtype}), P x G = {args.prompts} x {args.samples}, "
            f"{args.batches} batches a call ({real} real tokens), {program}, model.attention "
            f"{tr.model_cfg.attention}, median of {args.rounds} rounds, {compiles.count} "
            f"compilations while timed")
      print(f"  padded: {padded_slots} slots ({real / padded_slots:.0%} real), "
            f"{seconds['padded']:.3f} s, {real / seconds['padded']:.0f} tokens/s")
      print(f"  packed: {packed_slots} slots in rows of {tr.packing_length} "
            f"({np.mean([fill(p) for p in packings]):.0%} filled), {seconds['packed']:.3f} s, "
            f"{real / seconds['packed']:.0f} tokens/s")
      print(f"  packed / padded tokens/s: {seconds['padded'] / seconds['packed']:.2f}x")
    finally:
      for trainer in sides.values():
        trainer.close()


if __name__ == "__main__":
  main()
