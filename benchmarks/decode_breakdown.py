"""Where the sampler's decode step goes, and how fast it could be on this machine.

Runs, in one process and alternating, the sampler of `sampler_vs_hf.py` (same
bench-tiny model, 8 prompts x 8 samples, 32-token prompts, 128 new tokens,
T 1.0, top-p 0.95) in variants that each drop one part of the step:

  full           the sampler as shipped (C++ decode attention and top-p draw, a
                 float32 or AMX bf16 model's products on packed weights, rotary
                 cos/sin looked up in a table made once per call)
  xla attention  decode attention in XLA, the draw still in C++
  xla draw       the token choice in XLA (`sample_step`) with the C++ top-p threshold
  xla threshold  the token choice in XLA with XLA's threshold, the attention in C++
  no C++         all in XLA (sampling.cpu_kernels=false)
  rope per step  rotary cos/sin computed in every layer at every step (no table)
  no attention   the attention kernel replaced by a stand-in of the same shape that
                 reads only the queries (a row sum broadcast), so the cache is
                 written but never read
  greedy         argmax instead of temperature + top-p + the draw

then transformers `generate` on the full task. Each variant's tokens/s is
printed with its ratio to transformers. A last line bounds the attention from
below: the bytes of cache the decode must read per step (keys and values of
every slot written so far, all layers, a prompt's slots once for its G rows),
divided by the read bandwidth of a jitted sum over 512 MiB. The stand-ins are
for measurement only; their tokens are not a model's.

  python benchmarks/decode_breakdown.py [--runs 5] [--decode-segments 2] [--skip-hf]
      [--model DIR --dtype float32 --prompts 8 --samples 8 --new-tokens 128
       --variants full,no-attention,greedy]

`--model DIR` runs a real Qwen2/Qwen2.5 checkpoint instead of bench-tiny (in
`--dtype`, which also sets the cache dtype; in bf16 on a CPU with AMX tiles the
sampler's projections and head run in the AMX kernel), and adds a "head matmul"
line: the LM head alone, [B, D] x [D, V] with float32 accumulation in XLA,
jitted and timed per call, so the head's share of a step is read directly. `--variants` picks
the variants by name (spaces as dashes); compiling each one for a 24-layer
model takes a while.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
from unittest import mock

import numpy as np

ROWS, PROMPTS, PROMPT_LEN, NEW = 64, 8, 32, 128
VARIANTS = ("full", "xla attention", "xla draw", "xla threshold", "no C++", "rope per step",
            "no attention", "greedy")


def attention_stand_in(q_BxKxGxHd, *args, **kwargs):
  """In place of `cpu_kernels.decode_attention`: same shape, reads only the queries."""
  import jax.numpy as jnp
  return jnp.broadcast_to(jnp.sum(q_BxKxGxHd, -1, keepdims=True), q_BxKxGxHd.shape)


def xla_draw(threshold):
  """In place of `cpu_kernels.nucleus_draw`: `sample_step` in XLA with `threshold`."""
  from epgrpo_jax.rollout.sampling import SamplingConfig
  from epgrpo_jax.rollout.strategies import sample_step
  return lambda key, logits_BxV, temperature, top_p: sample_step(
      key, logits_BxV, SamplingConfig(temperature=temperature, top_p=top_p), threshold)


def read_bandwidth() -> float:
  """Bytes per second of a jitted float32 sum over 512 MiB (best of 5)."""
  import jax
  import jax.numpy as jnp
  from _common import time_call
  x = jnp.ones((128, 1 << 20), jnp.float32)
  total = jax.jit(jnp.sum)
  total(x).block_until_ready()
  best = min(time_call(lambda: total(x).block_until_ready()) for _ in range(5))
  return x.nbytes / best


def head_matmul(model, rows: int):
  """A timed call of the LM head alone on [rows, D] hidden states (float32 accumulation)."""
  import jax
  import jax.numpy as jnp
  head_DxV = model.head_DxV()
  hidden_BxD = jnp.ones((rows, head_DxV.shape[0]), head_DxV.dtype)
  head = jax.jit(lambda h, w: jnp.dot(h, w, preferred_element_type=jnp.float32))

  def run():
    head(hidden_BxD, head_DxV).block_until_ready()
  run()
  return run


def parts_only(args) -> None:
  """The head matmul, temperature + top-p + draw, and greedy, each jitted and timed alone on
  one decode step's [B, V] at the model's shapes (random values; medians of --runs)."""
  import jax
  import jax.numpy as jnp

  from epgrpo_jax.kernels import cpu as cpu_kernels

  from epgrpo_jax.models import load_hf_config
  from epgrpo_jax.rollout.sampling import SamplingConfig
  from epgrpo_jax.rollout.strategies import largest_threshold, sample_step

  import _common as C

  cfg = load_hf_config(args.model)
  rows, v, d = args.prompts * args.samples, cfg.vocab_size, cfg.hidden_size
  dtype = jnp.dtype(args.dtype)
  key = jax.random.key(0)
  head_DxV = (0.02 * jax.random.normal(key, (d, v))).astype(dtype)
  hidden_BxD = jax.random.normal(jax.random.fold_in(key, 1), (rows, d)).astype(dtype)
  logits_BxV = jnp.dot(hidden_BxD, head_DxV, preferred_element_type=jnp.float32) * 10
  kernels = cpu_kernels.available() and jax.default_backend() == "cpu"
  threshold = cpu_kernels.largest_threshold if kernels else largest_threshold
  top_p = SamplingConfig(temperature=1.0, top_p=0.95)
  head = jax.jit(lambda h, w: jnp.dot(h, w, preferred_element_type=jnp.float32))
  choose = jax.jit(lambda k, x: sample_step(k, x, top_p, threshold))
  choose_xla = jax.jit(lambda k, x: sample_step(k, x, top_p, largest_threshold))
  fused = jax.jit(lambda k, x: cpu_kernels.nucleus_draw(k, x, 1.0, 0.95)) if kernels else None
  greedy = jax.jit(lambda k, x: sample_step(k, x, SamplingConfig(greedy=True)))
  calls = {"head matmul": lambda: head(hidden_BxD, head_DxV).block_until_ready(),
           "T + top-p + draw": lambda: jax.block_until_ready(choose(key, logits_BxV)),
           "  (XLA threshold)": lambda: jax.block_until_ready(choose_xla(key, logits_BxV)),
           **({"  (C++ draw)": lambda: jax.block_until_ready(fused(key, logits_BxV))}
              if kernels else {}),
           "greedy": lambda: jax.block_until_ready(greedy(key, logits_BxV))}
  ms = {k: t * 1e3 for k, t in C.alternating_medians(calls, args.runs).items()}
  print(C.machine_line())
  print(f"{args.model} shapes ({args.dtype} head), one decode step of {rows} rows, vocabulary {v}, "
        f"hidden {d}; C++ threshold kernel: {'yes' if kernels else 'no'}; median of {args.runs}")
  for name, t in ms.items():
    print(f"  {name:18s} {t:8.2f} ms")
  print(f"load average at end {C.load1():.2f}")


def main():
  from epgrpo_jax.io.paths import path_flag  # `~` in a path flag, as in the commands
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--runs", type=int, default=5)
  ap.add_argument("--decode-segments", type=int, default=2)
  ap.add_argument("--torch-threads", type=int, default=2)
  ap.add_argument("--skip-hf", action="store_true")
  ap.add_argument("--model", type=path_flag, help="a real Qwen2/Qwen2.5 HF directory instead of bench-tiny")
  ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  ap.add_argument("--prompts", type=int, default=PROMPTS)
  ap.add_argument("--samples", type=int, default=ROWS // PROMPTS)
  ap.add_argument("--new-tokens", type=int, default=NEW)
  ap.add_argument("--variants", default=",".join(v.replace(" ", "-") for v in VARIANTS))
  ap.add_argument("--parts-only", action="store_true",
                  help="with --model: time only the head matmul and the per-step token choice "
                  "on random weights of the model's shapes (no weights loaded, no sampler)")
  args = ap.parse_args()
  if args.parts_only:
    if not args.model:
      ap.error("--parts-only: needs --model")
    return parts_only(args)
  prompts, rows, new = args.prompts, args.prompts * args.samples, args.new_tokens
  wanted = [v.strip().replace("-", " ") for v in args.variants.split(",") if v.strip()]
  if unknown := [v for v in wanted if v not in VARIANTS]:
    ap.error(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
  import jax
  import torch
  from flax import nnx
  from transformers import Qwen2ForCausalLM

  from epgrpo_jax.rollout import sampling as sampling_module, strategies
  from epgrpo_jax.kernels import cpu as cpu_kernels
  from epgrpo_jax.kernels import seam
  from epgrpo_jax.models import from_pretrained, load_hf_config
  from epgrpo_jax.rollout.sampling import Sampler, SamplingConfig

  import _common as C

  torch.set_num_threads(args.torch_threads)
  with tempfile.TemporaryDirectory() as d:
    src = args.model or str(C.build_model_dir(d, "bench-tiny", dtype="float32"))
    cfg = load_hf_config(src)
    model = from_pretrained(src, dtype=args.dtype, param_dtype=args.dtype)
    hf = Qwen2ForCausalLM.from_pretrained(src, dtype=getattr(torch, args.dtype)).eval()
  graphdef, state = nnx.split(model)
  rng = np.random.default_rng(0)
  base = SamplingConfig(temperature=1.0, top_p=0.95, max_new_tokens=new, ignore_eos=True,
                        decode_segments=args.decode_segments)

  def variant(sampling, *patches):
    """A timed call of the sampler whose program is compiled with `patches` applied."""
    ids = rng.integers(2, cfg.vocab_size, (prompts, PROMPT_LEN)).tolist()
    sampler = Sampler(sampling)
    keys = iter(jax.random.split(jax.random.key(0), args.runs + 2))

    def run():
      out = sampler.sample((graphdef, state), ids, rows // prompts, next(keys))
      out.tokens.block_until_ready()
    with contextlib.ExitStack() as stack:  # the patches are traced into the one program
      for patch in patches:
        stack.enter_context(patch)
      run()
    return run

  makers = {
      "full": lambda: variant(base),
      "xla attention": lambda: variant(base, mock.patch.object(  # no decode kernel chosen
          seam, "choose", lambda cfg, mesh=None, choose=seam.choose, **kw: choose(
              cfg, mesh, **(kw | {"decode_rows": None})))),
      "xla draw": lambda: variant(base, mock.patch.object(
          cpu_kernels, "nucleus_draw", xla_draw(cpu_kernels.largest_threshold))),
      "xla threshold": lambda: variant(base, mock.patch.object(
          cpu_kernels, "nucleus_draw", xla_draw(strategies.largest_threshold))),
      "no C++": lambda: variant(base.replace(cpu_kernels=False)),
      "rope per step": lambda: variant(base, mock.patch.object(sampling_module, "rope_table",
                                                       lambda cfg, length: None)),
      "no attention": lambda: variant(base, mock.patch.object(cpu_kernels, "decode_attention",
                                                      attention_stand_in)),
      "greedy": lambda: variant(base.replace(greedy=True)),
  }
  variants = {name: makers[name]() for name in wanted}
  if args.model:
    variants["head matmul"] = head_matmul(model, rows)
  tokens = rows * new
  rates = {name: tokens / t for name, t in C.alternating_medians(variants, args.runs).items()}
  if "head matmul" in rates:  # one call is one step's head, not `new` of them
    rates["head matmul"] = tokens / (tokens / rates["head matmul"] * new)

  ref = None
  if not args.skip_hf:
    hf_ids = torch.from_numpy(rng.integers(2, cfg.vocab_size, (prompts, PROMPT_LEN)))
    torch.manual_seed(0)

    def theirs():
      with torch.inference_mode():
        hf.generate(hf_ids, attention_mask=torch.ones_like(hf_ids), do_sample=True,
                    temperature=1.0, top_p=0.95, top_k=0, max_new_tokens=new, min_new_tokens=new,
                    num_return_sequences=rows // prompts, pad_token_id=0)
    ref = tokens / C.alternating_medians({"transformers": theirs}, 3)["transformers"]

  print(C.machine_line())
  print(f"{args.model or 'bench-tiny'} ({args.dtype}, vocabulary {cfg.vocab_size}), {rows} "
        f"sequences, {PROMPT_LEN}-token prompts, {new} new tokens, T 1.0, top-p 0.95, "
        f"decode_segments={args.decode_segments}; median of {args.runs} alternating runs")
  for name, rate in rates.items():
    ratio = f"   {rate / ref:.2f}x transformers" if ref and name != "head matmul" else ""
    print(f"  {name:14s} {rate:8.0f} tokens/s  {tokens / rate / new * 1e3:6.2f} ms/step{ratio}")
  if ref:
    print(f"  {'transformers':14s} {ref:8.0f} tokens/s  {tokens / ref / new * 1e3:6.2f} ms/step")
  ms = {name: tokens / rate / new * 1e3 for name, rate in rates.items()}
  parts = []
  if "head matmul" in ms:
    parts.append(f"head matmul {ms['head matmul']:.2f}")
  if "full" in ms and "greedy" in ms:
    parts.append(f"temperature + top-p + draw (full - greedy) {ms['full'] - ms['greedy']:.2f}")
  if "full" in ms and "no attention" in ms:
    parts.append(f"attention (full - no attention) {ms['full'] - ms['no attention']:.2f}")
  if parts and "full" in ms:
    print(f"  a full step {ms['full']:.2f} ms: " + ", ".join(parts) + " ms")
  if "no attention" not in rates:
    return

  # The kernel reads the slots up to the current one: at decode step i, each row's own
  # i + 1 and its prompt's Tp, the latter once per prompt (its G rows hold copies).
  itemsize = 4 if args.dtype == "float32" else 2
  per_slot = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize  # k and v
  mean_bytes = per_slot * statistics.fmean(rows * (i + 1) + prompts * PROMPT_LEN for i in range(1, new))
  bandwidth = read_bandwidth()
  floor = tokens / (tokens / rates["no attention"] + new * mean_bytes / bandwidth)
  print(f"cache read per step {mean_bytes / 2**20:.1f} MiB (written slots, mean over steps); read "
        f"bandwidth {bandwidth / 1e9:.1f} GB/s -> attention >= {mean_bytes / bandwidth * 1e3:.2f} "
        f"ms/step; 'no attention' plus that: {floor:.0f} tokens/s"
        + (f" = {floor / ref:.2f}x transformers" if ref else ""))


if __name__ == "__main__":
  main()
