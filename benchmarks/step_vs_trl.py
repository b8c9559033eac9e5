"""One full RL step: our Trainer.step (JAX) vs TRL's GRPOTrainer (PyTorch), same model and shapes.

Both systems load the same HF directory: a random Qwen2 (`--preset`, default
bench-tiny: vocab 1024, hidden 256, intermediate 704, 4 layers, 4/2 heads,
tied) written with our `save_pretrained`, and a byte-level BPE tokenizer of the
vocabulary's size. A step samples P=8 prompts x G=8 completions of exactly 128
new tokens (temperature 1, top-p 0.95; no stop: our `sampling.ignore_eos`,
TRL's `min_new_tokens`), scores the rewards (the completion's character-count
parity, in-process, for both), runs the scoring and reference passes
(reference = adapters off), computes advantages, and makes one optimizer
update of LoRA r 32, alpha 64 on every linear layer (q k v o gate up down),
beta 0.001. Ours is EP-GRPO (`--advantage grpo` for plain GRPO).

TRL: `GRPOTrainer` on torch CPU with peft LoRA, no vLLM, float32 (bf16 off),
no gradient checkpointing, generation_batch_size 64 = per_device_train_batch_size
(one optimizer step per generation batch), num_iterations 1, loss "dapo"
(token mean, as ours), `--threads` torch threads.

The steps interleave in one process: after each TRL step (a callback) ours
runs one step, so both see the same machine load; the first `--warmup` of each
are dropped (ours is also warmed up, i.e. compiled, before). Medians are printed
with the load average; set OMP_WAIT_POLICY=PASSIVE (the default here) so that
torch's idle OpenMP threads do not spin while ours runs.

  python benchmarks/step_vs_trl.py [--steps 7] [--warmup 2] [--skip-trl]
      [--preset bench-tiny] [--dtype float32] [--peak-tflops 989]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch / OpenMP start
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import json
import tempfile
import time
from pathlib import Path

import _common as C


def parse_args(argv=None):
  from epgrpo_jax.io.paths import path_flag  # `~` in a path flag, as in the commands
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--steps", type=int, default=7, help="timed steps of each system")
  ap.add_argument("--warmup", type=int, default=2, help="untimed steps of each system first")
  ap.add_argument("--prompts", type=int, default=8)
  ap.add_argument("--samples", type=int, default=8, help="G completions per prompt")
  ap.add_argument("--prompt-len", type=int, default=32)
  ap.add_argument("--new-tokens", type=int, default=128)
  ap.add_argument("--lora-rank", type=int, default=32)
  ap.add_argument("--preset", default="bench-tiny", help="model shape (epgrpo_jax.models.PRESETS)")
  ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                  help="weights and compute (ours: model.dtype and param_dtype; LoRA stays float32)")
  ap.add_argument("--advantage", default="epgrpo", choices=("epgrpo", "grpo"))
  ap.add_argument("--threads", type=int, default=2, help="torch threads")
  ap.add_argument("--skip-trl", action="store_true", help="time only ours")
  ap.add_argument("--peak-tflops", type=float, default=0.0,
                  help="the device's peak dense TFLOP/s in --dtype (H200 bf16: 989); prints MFU")
  ap.add_argument("--remat", action="store_true", help="ours: model.remat=true")
  ap.add_argument("--attention", default=None, choices=("auto", "plain", "blockwise", "cudnn"),
                  help="ours: model.attention (default: the config default, auto)")
  ap.add_argument("--reuse-sampler-logprobs", action="store_true",
                  help="ours: train.reuse_sampler_logprobs=true (no scoring pass; TRL has none on-policy)")
  ap.add_argument("--separate-programs", action="store_true",
                  help="ours: train.fused_update=false (scoring, advantage, update as 3 programs)")
  ap.add_argument("--json", type=lambda s: Path(path_flag(s)), default=None,
                  help="also write the figures here")
  return ap.parse_args(argv)


def advantage_overrides(name: str) -> list[str]:
  """The `advantage.*` switches of a variant (epgrpo_jax.core.advantages.VARIANTS)."""
  from epgrpo_jax.core.advantages import VARIANTS
  return [f"advantage.{k}={str(v).lower()}" for k, v in VARIANTS[name].items()]


# -- ours --------------------------------------------------------------------------------------


class Ours:
  """Our Trainer, stepped on demand; keeps per-step wall time and phase times."""

  def __init__(self, model_dir: Path, train_file: Path, out_dir: Path, shape: C.Shape, args):
    import jax

    extra = advantage_overrides(args.advantage)
    extra += C.dtype_overrides(args.dtype)
    if args.remat:
      extra.append("model.remat=true")
    if args.attention:
      extra.append(f"model.attention={args.attention}")
    if args.reuse_sampler_logprobs:
      extra.append("train.reuse_sampler_logprobs=true")
    if args.separate_programs:
      extra.append("train.fused_update=false")
    self.trainer = C.make_trainer(model_dir, train_file, out_dir, shape, *extra)
    self.state = self.trainer.initial_state()
    self.records: list[dict] = []
    self.jax = jax

  def step(self) -> dict:
    start = time.perf_counter()
    self.state, metrics, _ = self.trainer.step(self.state)
    self.jax.block_until_ready(self.state.trainable)
    wall = time.perf_counter() - start
    rec = {"step": wall, "sample": metrics["sample_time"], "update": metrics["update_time"],
           "load": C.load1(), "reward": metrics["reward"],
           "mean_length": metrics["completions/mean_length"]}
    rec["score_reward_advantage"] = wall - rec["sample"] - rec["update"]
    self.records.append(rec)
    return rec

  def close(self):
    self.trainer.close()


# -- TRL ---------------------------------------------------------------------------------------


def make_trl(model_dir: Path, prompts: list[str], out_dir: Path, shape: C.Shape, args, on_step):
  """A GRPOTrainer that calls `on_step()` after each optimizer step; times its phases."""
  import torch
  from datasets import Dataset
  from peft import LoraConfig
  from transformers import AutoTokenizer, TrainerCallback
  from trl import GRPOConfig, GRPOTrainer

  torch.set_num_threads(args.threads)
  rows = shape.prompts * shape.samples
  config = GRPOConfig(
      output_dir=str(out_dir), report_to="none", use_cpu=not torch.cuda.is_available(), seed=42,
      bf16=args.dtype == "bfloat16", fp16=False, gradient_checkpointing=False,
      model_init_kwargs={"dtype": getattr(torch, args.dtype)},
      per_device_train_batch_size=rows, generation_batch_size=rows,
      gradient_accumulation_steps=1, num_generations=shape.samples, num_iterations=1,
      max_completion_length=shape.new_tokens, temperature=1.0, top_p=0.95, top_k=0,
      generation_kwargs={"min_new_tokens": shape.new_tokens},  # never stop early
      beta=0.001, loss_type="dapo", learning_rate=1e-5, lr_scheduler_type="constant",
      use_vllm=False, max_steps=args.warmup + args.steps, logging_steps=10_000,
      save_strategy="no", dataloader_num_workers=0, disable_tqdm=True, log_completions=False)
  lora = LoraConfig(r=shape.lora_rank, lora_alpha=shape.lora_alpha, lora_dropout=0.0, bias="none",
                    target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                    "down_proj"], task_type="CAUSAL_LM")
  times: dict[str, list[float]] = {"step": [], "generate": [], "generate_score_reference": [],
                                   "load": []}

  class Timed(GRPOTrainer):
    def _generate_single_turn(self, *a, **k):
      t = time.perf_counter()
      out = super()._generate_single_turn(*a, **k)
      times["generate"].append(time.perf_counter() - t)
      return out

    def _generate_and_score_completions(self, *a, **k):
      t = time.perf_counter()
      out = super()._generate_and_score_completions(*a, **k)
      times["generate_score_reference"].append(time.perf_counter() - t)
      return out

  class Interleave(TrainerCallback):
    def on_step_begin(self, args_, state, control, **kw):
      self.start = time.perf_counter()

    def on_step_end(self, args_, state, control, **kw):
      times["step"].append(time.perf_counter() - self.start)
      times["load"].append(C.load1())
      ours = on_step()
      print(f"step {len(times['step'])}: TRL {times['step'][-1]:.2f} s, ours {ours['step']:.2f} s, "
            f"load {times['load'][-1]:.2f}", flush=True)

  tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
  dataset = Dataset.from_dict({"prompt": prompts})
  trainer = Timed(model=str(model_dir), reward_funcs=[C.trl_length_parity], args=config,
                  train_dataset=dataset, processing_class=tokenizer, peft_config=lora,
                  callbacks=[Interleave()])
  return trainer, times


# -- report ------------------------------------------------------------------------------------


def summary(values: list[dict] | dict[str, list[float]], keys, drop: int = 0) -> dict[str, float]:
  if isinstance(values, dict):
    return {k: C.median(values[k][drop:]) for k in keys if values.get(k)}
  return {k: C.median([r[k] for r in values[drop:]]) for k in keys}


def main(argv=None):
  args = parse_args(argv)
  import jax

  shape = C.Shape(prompts=args.prompts, samples=args.samples, prompt_len=args.prompt_len,
                  new_tokens=args.new_tokens, lora_rank=args.lora_rank,
                  lora_alpha=2.0 * args.lora_rank)
  tmp = Path(tempfile.mkdtemp(prefix="step_vs_trl-"))
  t0 = time.perf_counter()
  model_dir = C.build_model_dir(tmp / "model", args.preset, dtype=args.dtype)
  from epgrpo_jax.models import load_hf_config
  cfg = load_hf_config(model_dir)
  texts = C.prompt_texts(max(64, 4 * args.prompts), args.prompt_len)
  train_file = C.write_prompts(tmp / "prompts.jsonl", texts)
  print(f"model {args.preset} ({args.dtype}) written in {time.perf_counter() - t0:.1f} s to {model_dir}",
        flush=True)
  print(f"machine: {C.machine_line()}; jax {jax.__version__} on {jax.devices()[0].device_kind}",
        flush=True)

  ours = Ours(model_dir, train_file, tmp / "ours", shape, args)
  with C.CompileCounter() as warm_compiles:
    start = time.perf_counter()
    for _ in range(args.warmup):
      ours.step()
    warm_seconds = time.perf_counter() - start
  ours.records.clear()
  print(f"ours warm-up: {args.warmup} steps in {warm_seconds:.1f} s ({warm_compiles.count} XLA "
        f"compilations, {warm_compiles.seconds:.1f} s)", flush=True)

  trl_times = None
  with C.CompileCounter() as steady_compiles:
    if args.skip_trl:
      for _ in range(args.steps):
        ours.step()
    else:
      import torch
      import transformers
      import trl
      trl_trainer, trl_times = make_trl(model_dir, texts, tmp / "trl", shape, args, ours.step)
      print(f"TRL {trl.__version__}, transformers {transformers.__version__}, torch "
            f"{torch.__version__} with {torch.get_num_threads()} threads", flush=True)
      trl_trainer.train()
  ours.close()

  drop = 0 if args.skip_trl else args.warmup  # ours already warm; keep the pairs aligned
  o = summary(ours.records, ("step", "sample", "score_reward_advantage", "update", "load"), drop)
  tokens = shape.prompts * shape.samples * shape.new_tokens
  lengths = {r["mean_length"] for r in ours.records}
  print(f"\nshape: {shape.prompts} prompts x {shape.samples} samples, {shape.prompt_len}-token "
        f"prompts, {shape.new_tokens} new tokens (ours: mean length {sorted(lengths)}), LoRA r "
        f"{shape.lora_rank} alpha {shape.lora_alpha:g}, {args.advantage}")
  print(f"steady-state XLA compilations during the timed steps: {steady_compiles.count}")
  print(f"{'median seconds':<34}{'ours':>10}{'TRL':>10}{'TRL/ours':>10}")
  result = {"args": {k: str(v) for k, v in vars(args).items()}, "ours": o, "machine": C.machine_line(),
            "compilations_steady": steady_compiles.count, "ours_steps": ours.records}
  t = {}
  if trl_times is not None:
    t = summary(trl_times, ("step", "generate", "generate_score_reference", "load"), args.warmup)
    t["loss_backward_optimizer"] = t["step"] - t["generate_score_reference"]
    result["trl"] = t
    result["trl_steps"] = {k: v for k, v in trl_times.items()}
  rows = [("step", "step", "step"), ("sampling / generate", "sample", "generate"),
          ("score+reward+ref+adv / gen+score+ref", "score_reward_advantage", None),
          ("update / loss+backward+optimizer", "update", "loss_backward_optimizer")]
  for label, ok, tk in rows:
    line = f"{label:<34}{o[ok]:>10.3f}"
    if tk and tk in t:
      line += f"{t[tk]:>10.3f}{t[tk] / o[ok]:>9.2f}x"
    print(line)
  if t:
    extra = t["generate_score_reference"] - t["generate"]
    print(f"{'TRL rewards + reference pass':<34}{'':>10}{extra:>10.3f}")
  print(f"ours: {tokens / o['step']:.0f} completion tokens/s per step, sampling "
        f"{tokens / o['sample']:.0f} tokens/s")
  if t:
    print(f"TRL:  {tokens / t['step']:.0f} completion tokens/s per step, generate "
          f"{tokens / t['generate']:.0f} tokens/s")
    ratio = t["step"] / o["step"]
    met = "met" if ratio >= 2.5 else "NOT met"
    print(f"ratio TRL step / ours step: {ratio:.2f}x (issue 23's target >= 2.5x: {met}); "
          f"load average during the timed steps: ours {o['load']:.2f}, TRL {t['load']:.2f}")
    result["ratio"] = ratio
  flops = C.step_flops(cfg, shape, fused=ours.trainer.fused)
  print(f"model FLOPs per step (models/flops.py, each pass where it runs): {flops['total'] / 1e9:.1f} "
        f"GFLOP (sampling {flops['sampling'] / 1e9:.1f}, scoring+reference {flops['scoring'] / 1e9:.1f}, "
        f"update {flops['update'] / 1e9:.1f}{' with the reference forward' if ours.trainer.fused else ''}:"
        f" attention {flops['update_attention'] / 1e9:.1f}, head {flops['update_head'] / 1e9:.1f}); "
        f"ours achieves {flops['total'] / o['step'] / 1e9:.1f} GFLOP/s")
  if args.peak_tflops:
    peak = args.peak_tflops * 1e12
    print(f"MFU (peak {args.peak_tflops:g} TFLOP/s): step {flops['total'] / o['step'] / peak:.2%}, "
          f"sampling {flops['sampling'] / o['sample'] / peak:.2%}, update "
          f"{flops['update'] / o['update'] / peak:.2%}")
  peak_memory = C.device_peak_bytes()
  if peak_memory is not None:
    print(f"device memory: peak {peak_memory / 2**30:.2f} GiB in use (jax memory_stats, whole run)")
    result["peak_bytes"] = peak_memory
  print(f"machine at end: {C.machine_line()}")
  if args.json:
    args.json.write_text(json.dumps(result, indent=1, default=float))


if __name__ == "__main__":
  main()
