#!/usr/bin/env bash
# All benchmarks on one accelerator machine (random weights, bf16), in one go.
#
#   bash benchmarks/gpu.sh [PEAK_TFLOPS]      # e.g. 989 for an H100/H200 (dense bf16)
#
# Installs the package with the `bench` extra unless it is importable already (a
# CUDA jax must be installed for JAX to see the GPU), prints the machine, then:
# the sampler and the full RL step at Qwen2.5-0.5B and 1.5B shapes (tokens/s,
# model FLOPs utilisation, ours vs transformers / TRL on the same GPU), the
# EP-GRPO overhead, the scaling table and the log-prob memory table. Everything
# goes to stdout and to benchmarks/results-gpu-<date>.txt; record it in
# docs/benchmarks.md with the date and the hardware.
set -uo pipefail
cd "$(dirname "$0")/.."
PEAK="${1:-989}"
LOG="benchmarks/results-gpu-$(date +%Y%m%d-%H%M).txt"
exec > >(tee "$LOG") 2>&1

if ! python -c "import epgrpo_jax, trl, peft" 2>/dev/null; then
  pip install -e ".[bench]" || { echo "install failed"; exit 1; }
fi
date -u; hostname; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
python - <<'PY'
import jax, torch
print("jax", jax.__version__, jax.devices())
print("torch", torch.__version__, "cuda" if torch.cuda.is_available() else "NO CUDA")
if jax.devices()[0].platform == "cpu":
  print("WARNING: JAX sees no accelerator (install jax[cuda12]); the figures below are CPU figures")
PY

run() { echo; echo "=== $* ==="; timeout 1800 "$@" || echo "FAILED ($?): $*"; }
cd benchmarks
for preset in qwen2.5-0.5b qwen2.5-1.5b; do
  run python sampler_vs_hf.py --preset "$preset" --dtype bfloat16 --peak-tflops "$PEAK" --runs 3
  run python step_vs_trl.py --preset "$preset" --dtype bfloat16 --peak-tflops "$PEAK" \
      --steps 5 --warmup 2
done
run python step_vs_trl.py --steps 5 --warmup 2            # the CPU-recorded tiny shape, on the GPU
run python overhead.py --preset qwen2.5-0.5b --dtype bfloat16 --rounds 3
run python scaling.py --preset qwen2.5-0.5b --dtype bfloat16 --base 8,8,256 --doublings 2
run python logprob_memory.py --dtype bfloat16
echo; echo "results written to $LOG"
