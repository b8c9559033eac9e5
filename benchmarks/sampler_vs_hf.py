"""Sampling throughput: our JAX sampler vs transformers `generate`, same model and weights.

The bench-tiny random Qwen2 (vocab 1024, hidden 256, 4 layers, tied) is saved
with `save_pretrained` and loaded by `Qwen2ForCausalLM.from_pretrained`. Both
sample 8 prompts x 8 completions of 32-token prompts, exactly 128 new tokens
(no stop ids), temperature 1.0, top-p 0.95 on CPU; torch uses 2 threads.
Warm-up (and compilation) excluded; the median of `--runs` timed runs, the
two systems' runs alternating so that both see the same machine load.

  python benchmarks/sampler_vs_hf.py [--scaling] [--runs 3] [--skip-hf]
      [--preset bench-tiny] [--dtype float32] [--decode-segments N] [--peak-tflops 0]

Other `--preset`s (e.g. qwen2.5-0.5b) get random weights; on an accelerator
transformers runs on CUDA when torch sees it, and `--peak-tflops` (the device's
dense peak in `--dtype`) adds the sampler's model FLOPs utilisation.

Run it on an idle machine. Under load from other processes, torch's OpenMP
threads spin-wait and its throughput collapses (tenfold here with 2 threads);
`OMP_WAIT_POLICY=PASSIVE` (set before the run) gives a fairer figure then.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np


def parse_args():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--prompts", type=int, default=8)
  ap.add_argument("--samples", type=int, default=8, help="G completions per prompt")
  ap.add_argument("--prompt-len", type=int, default=32)
  ap.add_argument("--new-tokens", type=int, default=128)
  ap.add_argument("--top-p", type=float, default=0.95)
  ap.add_argument("--temperature", type=float, default=1.0)
  ap.add_argument("--runs", type=int, default=3)
  ap.add_argument("--torch-threads", type=int, default=2)
  ap.add_argument("--scaling", action="store_true", help="also 16..256 sequences (8 samples per prompt)")
  ap.add_argument("--skip-hf", action="store_true", help="time only ours")
  ap.add_argument("--preset", default="bench-tiny", help="model shape (epgrpo_jax.models.PRESETS)")
  ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  ap.add_argument("--decode-segments", type=int, default=None,
                  help="sampling.decode_segments (default: the config default)")
  ap.add_argument("--peak-tflops", type=float, default=0.0, help="prints MFU when set")
  return ap.parse_args()


def main():
  args = parse_args()
  import jax
  import torch
  from flax import nnx
  from transformers import Qwen2ForCausalLM

  from epgrpo_jax.models import from_pretrained, load_config
  from epgrpo_jax.sampling import Sampler, SamplingConfig

  import _common as C

  torch.set_num_threads(args.torch_threads)
  device = "cuda" if torch.cuda.is_available() else "cpu"
  with tempfile.TemporaryDirectory() as d:
    C.build_model_dir(d, args.preset, dtype=args.dtype)  # random weights, our save_pretrained
    cfg = load_config(d)
    model = from_pretrained(d, dtype=args.dtype, param_dtype=args.dtype)
    hf = Qwen2ForCausalLM.from_pretrained(d, dtype=getattr(torch, args.dtype)).to(device).eval()
  graphdef, state = nnx.split(model)

  sampling = SamplingConfig(temperature=args.temperature, top_p=args.top_p,
                            max_new_tokens=args.new_tokens)
  if args.decode_segments:
    sampling = sampling.replace(decode_segments=args.decode_segments)
  sampler = Sampler(sampling, eos_ids=())
  rng = np.random.default_rng(0)

  def ours(num_prompts: int, g: int):
    prompts = rng.integers(2, cfg.vocab_size, (num_prompts, args.prompt_len)).tolist()
    keys = iter(jax.random.split(jax.random.key(0), args.runs + 1))

    def run():
      out = sampler.sample((graphdef, state), prompts, g, next(keys))
      out.tokens.block_until_ready()
      assert out.tokens.shape == (num_prompts, g, args.new_tokens) and bool(out.mask.all())
    return run

  def theirs(num_prompts: int, g: int):
    ids = torch.from_numpy(rng.integers(2, cfg.vocab_size, (num_prompts, args.prompt_len))).to(device)
    torch.manual_seed(0)

    def run():
      with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                          temperature=args.temperature, top_p=args.top_p, top_k=0,
                          max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                          num_return_sequences=g, pad_token_id=0)
      assert out.shape == (num_prompts * g, args.prompt_len + args.new_tokens)
      if device == "cuda":
        torch.cuda.synchronize()
    return run

  def rates(num_prompts: int, g: int) -> list[float]:
    """Tokens/s of ours (and of transformers unless --skip-hf), timed alternating."""
    calls = {"ours": ours(num_prompts, g)}
    if not args.skip_hf:
      calls["transformers"] = theirs(num_prompts, g)
    return [num_prompts * g * args.new_tokens / t
            for t in C.alternating_medians(calls, args.runs).values()]

  load = os.getloadavg()
  print(f"{args.preset} Qwen2 ({args.dtype}), {args.prompt_len}-token prompts, {args.new_tokens} new tokens, "
        f"T={args.temperature}, top-p={args.top_p}; {os.cpu_count()} CPUs, load average "
        f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; jax {jax.__version__} on "
        f"{jax.devices()[0].device_kind}, torch {torch.__version__} on {device} with "
        f"{args.torch_threads} threads"
        f" (OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}); "
        f"decode_segments={sampling.decode_segments}")
  n = args.prompts * args.samples
  mine, *ref = rates(args.prompts, args.samples)
  print(f"ours          {n:4d} sequences: {mine:9.0f} tokens/s")
  if args.peak_tflops:
    per_token = C.forward_flops(cfg, 1, args.prompt_len + args.new_tokens / 2)
    print(f"ours: sampling MFU {mine * per_token / (args.peak_tflops * 1e12):.2%} "
          f"(peak {args.peak_tflops:g} TFLOP/s, {per_token / 1e9:.2f} GFLOP per token)")
  if ref:
    print(f"transformers  {n:4d} sequences: {ref[0]:9.0f} tokens/s")
    print(f"ratio ours / transformers: {mine / ref[0]:.2f}x")
  if args.scaling:
    print("scaling (8 samples per prompt):")
    for total in (16, 32, 64, 128, 256):
      mine, *ref = rates(total // args.samples, args.samples)
      line = f"  {total:4d} sequences: ours {mine:9.0f} tokens/s"
      if ref:
        line += f", transformers {ref[0]:9.0f} tokens/s ({mine / ref[0]:.2f}x)"
      print(line, flush=True)
  print(f"sampler compilations: {sampler.num_compilations}; load average at end "
        f"{os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
  main()
