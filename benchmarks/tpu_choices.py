"""The XLA:CPU-derived choices that also run on accelerators, compiled both ways for one TPU
chip with the real TPU compiler (libtpu; no TPU needed): what the compiler says each costs.

`python benchmarks/tpu_choices.py [--topology v5e:2x2] [--tokens 8192]`

Per choice, the two variants' compiled temporaries, bytes accessed, FLOPs and the compiler's
`optimal_seconds` (tools/tpu_costs.measure), on one chip of the slice (a single-device
program):
- low_rank: the adapter product (x @ a) @ b with its custom VJP (rank-sized transposes only,
  `models.low_rank`) against plain autodiff, value and all three gradients, bf16.
- blockwise loop: the blockwise attention's key-block loop fenced and unrolled (the model's)
  against `lax.scan`, value and gradients, bf16.
- KV layout: a one-token decode step's attention over a heads-major cache (keys [B, K, Hd, S],
  values [B, K, S, Hd], the model's) against a sequence-major one ([B, S, K, Hd], what cuDNN
  and `jax.nn.dot_product_attention` take), with the slot written, bf16.
- remat split: the update of a remat'd model as one program against the gradient program and
  the optimizer step (`StepFunctions.split_update`), tiny-model shapes over one chip.
docs/benchmarks.md ("Per-backend choices on TPU") records the figures and docs/architecture.md
("The kernel seam") the decisions.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from epgrpo_jax.models import _attention  # noqa: E402
from epgrpo_jax.models import low_rank  # noqa: E402
from epgrpo_jax.tools import tpu_costs  # noqa: E402

BF16 = jnp.bfloat16


def compiled(fn, args, device):
  """`fn` compiled for one TPU device, its arguments abstract."""
  one = jax.sharding.SingleDeviceSharding(device)
  shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one) for a in args]
  return jax.jit(fn).lower(*shapes).compile()


def zeros(*shape, dtype=BF16):
  return jax.ShapeDtypeStruct(shape, dtype)


def loss_of(fn, argnums):
  return jax.value_and_grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32)), argnums=argnums)


def low_rank_pair(tokens: int, d: int, rank: int):
  args = (zeros(tokens, d), zeros(d, rank), zeros(rank, d))
  return {"custom VJP (the model's)": (loss_of(low_rank, (0, 1, 2)), args),
          "autodiff": (loss_of(lambda x, a, b: (x @ a) @ b, (0, 1, 2)), args)}


def blockwise_pair(t: int, heads: int, kv_heads: int, hd: int, block: int):
  g = heads // kv_heads
  args = (zeros(1, kv_heads, g, t, hd), zeros(1, kv_heads, hd, t), zeros(1, kv_heads, t, hd))
  valid = jnp.ones((1, t), bool)

  def run(loop):
    return loss_of(lambda q, k, v: _attention.blockwise(q, k, v, valid, 0, block=block, loop=loop),
                   (0, 1, 2))
  return {"unrolled (the model's)": (run("unrolled"), args), "scan": (run("scan"), args)}


def kv_layout_pair(rows: int, slots: int, heads: int, kv_heads: int, hd: int):
  g = heads // kv_heads
  valid = jnp.ones((rows, slots), bool)

  def heads_major(q_BxKxGxHd, k_new, v_new, keys_BxKxHdxS, values_BxKxSxHd):
    keys = jax.lax.dynamic_update_slice(keys_BxKxHdxS, k_new[..., None], (0, 0, 0, slots - 1))
    values = jax.lax.dynamic_update_slice(values_BxKxSxHd, v_new[:, :, None], (0, 0, slots - 1, 0))
    out = _attention.attend(q_BxKxGxHd[:, :, :, None], keys, values,
                            _attention.visible(valid, slots - 1, 1))
    return out, keys, values

  def sequence_major(q_BxKxGxHd, k_new, v_new, keys_BxSxKxHd, values_BxSxKxHd):
    keys = jax.lax.dynamic_update_slice(keys_BxSxKxHd, k_new[:, None], (0, slots - 1, 0, 0))
    values = jax.lax.dynamic_update_slice(values_BxSxKxHd, v_new[:, None], (0, slots - 1, 0, 0))
    q = q_BxKxGxHd.reshape(rows, 1, kv_heads * g, hd)
    out = jax.nn.dot_product_attention(q, keys, values, mask=valid[:, None, None, :])
    return out, keys, values

  small = (zeros(rows, kv_heads, g, hd), zeros(rows, kv_heads, hd), zeros(rows, kv_heads, hd))
  return {"heads-major (the model's)": (heads_major, small + (
              zeros(rows, kv_heads, hd, slots), zeros(rows, kv_heads, slots, hd))),
          "sequence-major": (sequence_major, small + (
              zeros(rows, slots, kv_heads, hd), zeros(rows, slots, kv_heads, hd)))}


def remat_split(device, layers: int):
  """The remat'd update's programs, one program or split, over one chip (`StepParts`)."""
  from epgrpo_jax.models import preset
  from epgrpo_jax.parallel.sharding import MeshConfig, make_mesh
  from epgrpo_jax.tools.step_abstract import StepParts
  from epgrpo_jax.training.config import load_config

  cfg = load_config(None, ["model.path=embedded", "model.remat=true", "model.dtype=bfloat16",
                           "model.param_dtype=bfloat16", "train.prompts_per_step=8",
                           "train.num_generations=8", "sampling.max_new_tokens=512"])
  model_cfg = preset("qwen2.5-0.5b", remat=True, num_layers=layers, dtype="bfloat16",
                     param_dtype="bfloat16")
  mesh = make_mesh(MeshConfig(1, 1, 1), [device])
  out = {}
  for split in (False, True):
    parts = StepParts.create(cfg, model_cfg, mesh, prompt_tokens=256, completion_tokens=512)
    parts.fns.split_update = split
    out[split] = [(name, make()) for name, make in parts.update_programs()]
  return out


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--topology", default="v5e:2x2")
  p.add_argument("--tokens", type=int, default=8192, help="rows of the adapter product")
  p.add_argument("--only", default="", help="comma-separated choices to compile (default: all): "
                 "low_rank, blockwise, kv, remat")
  args = p.parse_args()
  devices = tpu_costs.topology_devices(args.topology)
  chip, device = tpu_costs.chip_of(devices), devices[0]
  print(f"one chip of {args.topology} ({chip.name}), jax {jax.__version__}")
  print(f"{'choice':16s} {'variant':28s} {'temp MiB':>9s} {'GB moved':>9s} {'GFLOP':>8s} "
        f"{'est. ms':>8s}")
  only = set(filter(None, args.only.split(","))) or {"low_rank", "blockwise", "kv", "remat"}
  pairs = {
      "low_rank": lambda: low_rank_pair(args.tokens, 2048, 16),
      "blockwise loop": lambda: blockwise_pair(4096, 16, 2, 128, 512),
      "KV layout": lambda: kv_layout_pair(64, 1024, 16, 2, 128),
  }
  keys = {"low_rank": "low_rank", "blockwise loop": "blockwise", "KV layout": "kv"}
  for choice, make in pairs.items():
    if keys[choice] not in only:
      continue
    variants = make()
    for name, (fn, shapes) in variants.items():
      m = tpu_costs.measure(name, compiled(fn, shapes, device), chip)
      print(f"{choice:16s} {name:28s} {m.temp / 2**20:9.1f} {m.bytes_accessed / 1e9:9.3f} "
            f"{m.flops / 1e9:8.2f} {m.seconds * 1e3:8.3f}" + (f"  ({m.note})" if m.note else ""))
  if "remat" in only:
    for split, programs in remat_split(device, layers=8).items():
      for name, program in programs:
        m = tpu_costs.measure(name, program, chip)
        label = ("split: " if split else "one: ") + name
        print(f"{'remat split':16s} {label:28s} {m.temp / 2**20:9.1f} {m.bytes_accessed / 1e9:9.3f} "
              f"{m.flops / 1e9:8.2f} {m.seconds * 1e3:8.3f}" + (f"  ({m.note})" if m.note else ""))
  return 0


if __name__ == "__main__":
  np.set_printoptions(precision=3)
  sys.exit(main())
