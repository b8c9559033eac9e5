#!/usr/bin/env bash
# The accelerator figures on one H100/H200-class GPU (random weights, bf16), in about 26 minutes
# (the time limits add up to 1,470 s plus start-up). A session's device call is limited to 10
# minutes, so run it in parts (the limits of each: 0 270 s, 1-3 320-440 s, 4 320 s, 5 260 s,
# 6 300 s):
#
#   bash benchmarks/gpu.sh [--peak-tflops 989] [--out FILE]   # 989: H100/H200 dense bf16
#   bash benchmarks/gpu.sh --parts 0 [...]                     # the update only (about 5 minutes)
#   bash benchmarks/gpu.sh --parts 4,5 [...]                   # the rollouts only (about 10 minutes)
#   bash benchmarks/gpu.sh --update-only [...]                 # the same as --parts 0
#   bash benchmarks/gpu.sh --dry-run [--parts LIST] [--out FILE]   # the same programs, tiny, on CPU
#
# Run on an NVIDIA H200 on 2026-12-04 without part 0 (figures in docs/benchmarks.md section 6;
# part 0 has not run on a GPU yet). Each part
# reuses a benchmark script with size flags:
#   0. the update alone (update_gpu.py) at Qwen2.5-3B and 1.5B shapes: LoRA rank 32, bf16,
#      remat, 8 packed rows of 4,096 tokens (sequences of 256 + 768 tokens, 4 a row), the
#      fused on-policy update; MFU by the one FLOP model (models/flops.py), peak memory, and
#      the update's device time split into attention, LM head and the rest (jax.profiler);
#   1. sampler tokens/s, ours vs transformers `generate` (sampler_vs_hf.py) at the Qwen2.5-0.5B
#      shape: 8 prompts x 8 completions, 64-token prompts, 256 new tokens;
#   2. the RL step split into phases (sampling / scoring+reward+reference+advantage / update),
#      the update's and the step's MFU and the device's peak memory (step_vs_trl.py --skip-trl)
#      at the 0.5B shape, with model.attention=auto (cuDNN in bf16; should that part fail
#      other than by its time limit, once more with blockwise attention);
#   3. one layer's training attention, forward + backward: plain vs blockwise vs cuDNN, time and
#      compiled temporaries (attention.py) at the 1.5B heads, 4 rows x 4,096 tokens;
#   4. rollouts, static vs continuous batching at MATH lengths (rollout.py) at the Qwen2.5-0.5B
#      shape (16 x 8, 64 slots; part 5: the same at the 3B shape, the paper's 16 x 8, 2,048 new
#      tokens), the decode steps' attention the Pallas kernel that reads each row's own slots
#      (kernels/gpu.py, model.attention auto); the 0.5B run once more with --attention plain
#      (XLA's attention over every slot) for the kernel's share. The 0.5B and 3B runs with
#      --profile: one more call of each side, completions cut to 32 tokens, traced with
#      jax.profiler; the device op time per decode step split into decode attention,
#      projections/MLP, LM head, sampling, cache writes and the rest, and its ratio to the
#      weight-read floor (the weights at the device kind's HBM bandwidth, benchmarks/_profile.py);
#   6. whole RL steps with the next batch sampled one step ahead (rollout.max_staleness=1, the
#      token-level correction) against synchronous steps, both on the one GPU (async.py, its
#      one-device sides) at the Qwen2.5-0.5B shape: 8 x 8, MATH lengths up to 512 new tokens.
# Each part has a time limit, so that a hung part cannot eat the others' time; a part that
# fails or times out prints FAILED and the script goes on. Everything goes to stdout and to
# FILE (default benchmarks/results-gpu-<date>.txt, or results-dry-run-<date>.txt); record the
# figures in docs/benchmarks.md with the date and the hardware.
#
# Installs the package with the `bench` extra unless it is importable already (a CUDA jax
# must be installed for JAX to see the GPU). Every part runs under $PYTHON (default: the first
# `python` on PATH); set it to the interpreter of a virtual environment that is not activated.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
PY="${PYTHON:-python}"
PEAK=989
DRY=0
PARTS=""
OUT=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --update-only) PARTS=0 ;;
    --parts) PARTS="$2"; shift ;;
    --peak-tflops) PEAK="$2"; shift ;;
    --out) OUT="$2"; shift ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done
case ",$PARTS," in
  ,,) ;;
  *[!0-6,]*|*,,*) echo "--parts: a comma-separated list of parts 0-6, got '$PARTS'" >&2; exit 2 ;;
esac
part() {  # part N: whether --parts selects part N (all of them without --parts)
  [ -z "$PARTS" ] || case ",$PARTS," in *",$1,"*) return 0 ;; *) return 1 ;; esac
}
if [ -z "$OUT" ]; then
  if [ "$DRY" = 1 ]; then OUT="benchmarks/results-dry-run-$(date +%Y%m%d-%H%M).txt"
  else OUT="benchmarks/results-gpu-$(date +%Y%m%d-%H%M).txt"; fi
fi
case "$OUT" in /*) ;; *) OUT="$ROOT/$OUT" ;; esac
exec > >(tee "$OUT") 2>&1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

if [ "$DRY" = 1 ]; then
  export JAX_PLATFORMS=cpu CUDA_VISIBLE_DEVICES=""
  echo "DRY RUN: tiny shapes on CPU; the figures mean nothing, only that every program runs"
else
  if ! "$PY" -c "import epgrpo_jax, transformers" 2>/dev/null; then
    "$PY" -m pip install -e ".[bench]" || { echo "install failed"; exit 1; }
  fi
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
fi
date -u; hostname
"$PY" - <<'PY'
import jax
print("jax", jax.__version__, jax.devices())
try:
  import torch
  print("torch", torch.__version__, "cuda" if torch.cuda.is_available() else "no CUDA")
except ImportError:
  print("torch: not installed")
if jax.devices()[0].platform == "cpu":
  print("NOTE: JAX sees no accelerator (a GPU run needs a CUDA jax, e.g. jax[cuda13]); these are CPU figures")
PY

START=$SECONDS
run() {  # run SECONDS CMD...: one part, with its time limit
  local limit="$1"; shift
  echo; echo "=== $* (limit ${limit} s, at ${SECONDS} s) ==="
  timeout "$limit" "$@" || { local rc=$?; echo "FAILED ($rc): $*"; return "$rc"; }
}
cd benchmarks
if [ "$DRY" = 1 ]; then  # generous limits: a loaded CI machine, not the GPU's time budget
  part 0 && run 400 "$PY" update_gpu.py --preset test-tiny --dtype float32 --rows 2 --row-length 128 \
      --prompt-len 8 --completion-len 24 --lora-rank 2 --steps 1 --attention blockwise \
      --peak-tflops "$PEAK"
  SAMPLER="--prompts 2 --samples 2 --prompt-len 8 --new-tokens 8 --runs 1 --dtype float32"
  part 1 && run 300 "$PY" sampler_vs_hf.py --preset bench-tiny $SAMPLER
  part 2 && run 300 "$PY" step_vs_trl.py --preset bench-tiny --skip-trl --steps 1 --warmup 1 --prompts 2 \
      --samples 2 --prompt-len 8 --new-tokens 8 --lora-rank 2 --peak-tflops "$PEAK"
  part 3 && run 300 "$PY" attention.py --preset test-tiny --rows 2 --tokens 64 --block 16 --dtype float32 \
      --runs 1
  ROLL="--preset bench-tiny --prompts 2 --samples 2 --new-tokens 32 --slots 2 --rounds 1"
  part 4 && run 300 "$PY" rollout.py $ROLL --profile --profile-tokens 16
  part 4 && run 300 "$PY" rollout.py $ROLL --attention plain
  part 6 && run 300 "$PY" async.py --only "1 device" --prompts 2 --samples 2 --new-tokens 16 \
      --max-prompt-tokens 128 --steps 1 --warmup 1 --rounds 1
else
  UPDATE="--rows 8 --row-length 4096 --prompt-len 256 --completion-len 768 --steps 3 --peak-tflops $PEAK"
  part 0 && run 150 "$PY" update_gpu.py --preset qwen2.5-3b $UPDATE
  part 0 && run 120 "$PY" update_gpu.py --preset qwen2.5-1.5b $UPDATE
  SAMPLER="--prompts 8 --samples 8 --prompt-len 64 --new-tokens 256 --runs 2 --dtype bfloat16"
  part 1 && run 100 "$PY" sampler_vs_hf.py --preset qwen2.5-0.5b $SAMPLER --peak-tflops "$PEAK"
  STEP="--preset qwen2.5-0.5b --dtype bfloat16 --skip-trl --steps 3 --warmup 1 --prompts 8 \
      --samples 8 --prompt-len 64 --new-tokens 256 --peak-tflops $PEAK"
  if part 2; then
    run 160 "$PY" step_vs_trl.py $STEP
    rc=$?  # an error (not a time-out) with cuDNN attention: once more with the blockwise path
    if [ "$rc" != 0 ] && [ "$rc" != 124 ]; then run 120 "$PY" step_vs_trl.py $STEP --attention blockwise; fi
  fi
  part 3 && run 60 "$PY" attention.py --preset qwen2.5-1.5b --rows 4 --tokens 4096 --dtype bfloat16 \
      --runs 5
  ROLL="--preset qwen2.5-0.5b --dtype bfloat16 --prompts 16 --samples 8 --new-tokens 2048 --slots 64"
  ROLL="$ROLL --rounds 1"
  part 4 && run 170 "$PY" rollout.py $ROLL --profile
  part 4 && run 150 "$PY" rollout.py $ROLL --attention plain
  part 5 && run 260 "$PY" rollout.py --preset qwen2.5-3b --dtype bfloat16 --prompts 16 --samples 8 \
      --new-tokens 2048 --slots 64 --rounds 1 --profile
  part 6 && run 300 "$PY" async.py --only "1 device" --preset qwen2.5-0.5b --dtype bfloat16 --prompts 8 \
      --samples 8 --new-tokens 512 --max-prompt-tokens 128 --steps 2 --warmup 2 --rounds 2 \
      --set train.grad_accumulation=2 model.remat=true
fi
echo; echo "total $((SECONDS - START)) s; results written to $OUT"
