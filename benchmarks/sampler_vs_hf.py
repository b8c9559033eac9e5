"""Sampling throughput: our JAX sampler vs transformers `generate`, same model and weights.

The bench-tiny random Qwen2 (vocab 1024, hidden 256, 4 layers, tied) is saved
with `save_pretrained` and loaded by `Qwen2ForCausalLM.from_pretrained`. Both
sample 8 prompts x 8 completions of 32-token prompts, exactly 128 new tokens
(no stop ids), temperature 1.0, top-p 0.95 on CPU; torch uses 2 threads.
Warm-up (and compilation) excluded; the median of `--runs` timed runs, the
two systems' runs alternating so that both see the same machine load.

  python benchmarks/sampler_vs_hf.py [--scaling] [--runs 3] [--skip-hf]
      [--preset bench-tiny] [--dtype float32[,bfloat16]] [--decode-segments N] [--peak-tflops 0]
      [--model DIR] [--shapes 2x8,8x8]

Other `--preset`s (e.g. qwen2.5-0.5b) get random weights; on an accelerator
transformers runs on CUDA when torch sees it, and `--peak-tflops` (the device's
dense peak in `--dtype`) adds the sampler's model FLOPs utilisation.

`--model DIR` times a real Qwen2/Qwen2.5 checkpoint instead (loaded in each
`--dtype` by both systems; `--preset` is ignored); `--shapes PxG,...` lists the
prompt x sample shapes. Each line then adds our compile time (the first
call's XLA backend compilations), and for both systems the peak resident
memory above the process's before the call (sampled every 10 ms while it runs).
With `--model`, transformers' warm-up call generates 8 tokens (it compiles
nothing), not the full length.

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
  from epgrpo_jax.io.paths import path_flag  # `~` in a path flag, as in the commands
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
  ap.add_argument("--dtype", default="float32", help="float32, bfloat16, or both comma-separated")
  ap.add_argument("--model", type=path_flag, help="a real Qwen2/Qwen2.5 HF directory (instead of --preset)")
  ap.add_argument("--shapes", help="comma-separated PxG (prompts x samples); default: "
                  "--prompts x --samples")
  ap.add_argument("--decode-segments", type=int, default=None,
                  help="sampling.decode_segments (default: the config default)")
  ap.add_argument("--no-packed-weights", action="store_true",
                  help="sampling.packed_weights=false: XLA's dots instead of the packed C++ products")
  ap.add_argument("--peak-tflops", type=float, default=0.0, help="prints MFU when set")
  args = ap.parse_args()
  args.dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
  if not args.dtypes or any(d not in ("float32", "bfloat16") for d in args.dtypes):
    ap.error(f"--dtype: float32 and/or bfloat16, got {args.dtype!r}")
  try:
    args.shape_list = [tuple(int(x) for x in s.split("x")) for s in
                       (args.shapes or f"{args.prompts}x{args.samples}").split(",")]
  except ValueError:
    ap.error(f"--shapes: expected PxG,..., got {args.shapes!r}")
  return args


class PeakRss:
  """The largest resident set size of this process while inside the block (sampled)."""

  def __init__(self, every_s: float = 0.01):
    self.every_s = every_s
    self.before = self.peak = 0

  @staticmethod
  def now() -> int:
    with open("/proc/self/statm") as f:
      return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

  def _watch(self):
    while not self._stop.wait(self.every_s):
      self.peak = max(self.peak, self.now())

  def __enter__(self) -> "PeakRss":
    import threading
    self.before = self.peak = self.now()
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._watch, daemon=True)
    self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    self._stop.set()
    self._thread.join()
    self.peak = max(self.peak, self.now())

  @property
  def extra_mib(self) -> float:
    return (self.peak - self.before) / 2**20


def load_models(args, directory: str, dtype: str, device: str):
  """(our model, transformers' model, ModelConfig) in `dtype`: --model, else a random --preset
  written to `directory`."""
  import torch
  from transformers import Qwen2ForCausalLM

  from epgrpo_jax.models import from_pretrained, load_hf_config

  import _common as C

  src = args.model or str(C.build_model_dir(directory, args.preset, dtype=dtype))
  model = from_pretrained(src, dtype=dtype, param_dtype=dtype)
  hf = Qwen2ForCausalLM.from_pretrained(src, dtype=getattr(torch, dtype)).to(device).eval()
  return model, hf, load_hf_config(src)


def main():
  args = parse_args()
  import gc
  import resource
  import time

  import jax
  import torch
  from flax import nnx

  from epgrpo_jax.rollout.sampling import Sampler, SamplingConfig

  import _common as C

  torch.set_num_threads(args.torch_threads)
  device = "cuda" if torch.cuda.is_available() else "cpu"
  sampling = SamplingConfig(temperature=args.temperature, top_p=args.top_p,
                            max_new_tokens=args.new_tokens)
  if args.decode_segments:
    sampling = sampling.replace(decode_segments=args.decode_segments)
  if args.no_packed_weights:
    sampling = sampling.replace(packed_weights=False)
  rng = np.random.default_rng(0)
  print(f"{args.model or args.preset + ' Qwen2'}: {args.prompt_len}-token prompts, {args.new_tokens} "
        f"new tokens, T={args.temperature}, top-p={args.top_p}; {C.machine_line()}; jax "
        f"{jax.__version__} on {jax.devices()[0].device_kind}, torch {torch.__version__} on "
        f"{device} with {args.torch_threads} threads; decode_segments={sampling.decode_segments}, "
        f"packed_weights={sampling.packed_weights}; "
        f"median of {args.runs} alternating runs", flush=True)

  def measured(fn):
    """`fn` wrapped to record its first call's wall and compile seconds and each call's RSS."""
    stats = {"calls": 0, "first_s": 0.0, "compile_s": 0.0, "rss_first": 0.0, "rss": 0.0}

    def call():
      with C.CompileCounter() as compiles, PeakRss() as rss:
        start = time.perf_counter()
        fn()
        seconds = time.perf_counter() - start
      if not stats["calls"]:
        stats.update(first_s=seconds, compile_s=compiles.seconds, rss_first=rss.extra_mib)
      else:
        stats["rss"] = max(stats["rss"], rss.extra_mib)
      stats["calls"] += 1
    return call, stats

  for dtype in args.dtypes:
    with tempfile.TemporaryDirectory() as d:
      model, hf, cfg = load_models(args, d, dtype, device)
    graphdef, state = nnx.split(model)
    sampler = Sampler(sampling, eos_ids=())

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
      calls = [0]

      def run():
        n = min(8, args.new_tokens) if args.model and not calls[0] else args.new_tokens
        calls[0] += 1
        with torch.inference_mode():
          out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                            temperature=args.temperature, top_p=args.top_p, top_k=0,
                            max_new_tokens=n, min_new_tokens=n, num_return_sequences=g,
                            pad_token_id=0)
        assert out.shape == (num_prompts * g, args.prompt_len + n)
        if device == "cuda":
          torch.cuda.synchronize()
      return run

    def rates(num_prompts: int, g: int):
      """Tokens/s of ours (and of transformers unless --skip-hf), timed alternating, with the
      stats of `measured`."""
      calls = {"ours": measured(ours(num_prompts, g))}
      if not args.skip_hf:
        calls["transformers"] = measured(theirs(num_prompts, g))
      medians = C.alternating_medians({k: v[0] for k, v in calls.items()}, args.runs)
      return {k: (num_prompts * g * args.new_tokens / medians[k], calls[k][1]) for k in calls}

    def report(num_prompts: int, g: int) -> None:
      r = rates(num_prompts, g)
      mine, st = r["ours"]
      print(f"[{dtype}] {num_prompts}x{g} = {num_prompts * g} sequences: ours {mine:9.1f} tokens/s, "
            f"compile {st['compile_s']:.1f}s (first call {st['first_s']:.1f}s), peak RSS "
            f"+{st['rss']:.0f} MiB (first call +{st['rss_first']:.0f} MiB)", flush=True)
      if args.peak_tflops:
        per_token = C.sampling_flops_per_token(cfg, num_prompts, g, args.prompt_len, args.new_tokens)
        print(f"  ours: sampling MFU {mine * per_token / (args.peak_tflops * 1e12):.2%} "
              f"(peak {args.peak_tflops:g} TFLOP/s, {per_token / 1e9:.2f} GFLOP per token)")
      if "transformers" in r:
        ref, st = r["transformers"]
        print(f"  transformers {ref:9.1f} tokens/s, peak RSS +{st['rss']:.0f} MiB; ratio ours / "
              f"transformers: {mine / ref:.2f}x; load average {C.load1():.2f}", flush=True)

    for num_prompts, g in args.shape_list:
      report(num_prompts, g)
    if args.scaling:
      print("scaling (8 samples per prompt):")
      for total in (16, 32, 64, 128, 256):
        report(total // args.samples, args.samples)
    print(f"[{dtype}] sampler compilations: {sampler.num_compilations}")
    model = hf = graphdef = state = sampler = None  # free this dtype's weights before the next
    gc.collect()
  print(f"process peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB; "
        f"load average at end {C.load1():.2f}")


if __name__ == "__main__":
  main()
