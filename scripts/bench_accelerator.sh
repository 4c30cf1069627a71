#!/usr/bin/env bash
# The bench on a real accelerator (GPU or TPU host): the same `python -m benchmarks.bench`,
# a real model shape and real devices instead of virtual CPU ones.
#
#   scripts/bench_accelerator.sh [MODEL] [OUT]        # defaults: qwen3-0.6b, bench_out/accelerator
#   GA=1,8 STEPS=20 SEQ_LEN=1024 BATCH=32 ARMS=baseline,zero1 scripts/bench_accelerator.sh llama-3.2-1b
#
# MODEL is a name from benchmarks.model.CONFIGS (qwen3-0.6b, llama-3.2-1b, gemma-3-1b, ...).
# dp runs over the powers of two up to the host's device count (dp=1 on a one-device host). Parameters and moments are
# float32 and every arm of one (dp, ga) is resident at once, so a 0.6B model needs about
# (4 arms x 10 GiB) / dp + activations per device; use ARMS=baseline,zero1 on small-HBM chips.
set -euo pipefail
# The harness lives in the checkout's benchmarks/ (not in the wheel): importable from anywhere.
export PYTHONPATH="$(cd "$(dirname "$0")/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"

MODEL=${1:-qwen3-0.6b}
OUT=${2:-bench_out/accelerator}
read -r DEVICES PLATFORM < <(python -c "import jax; print(jax.device_count(), jax.default_backend())")
# XLA's GPU compiler may reduce in an order that varies from run to run (the baseline's own final loss moved
# by 6e-4 between two runs on an H200); with its deterministic ops Zero-1 and nnx.Optimizer are bit-identical
# there, for 2% more step time in both arms. An XLA_FLAGS of the caller's own is kept as it is.
if [ "$PLATFORM" = "gpu" ] && [ -z "${XLA_FLAGS:-}" ]; then
  export XLA_FLAGS=--xla_gpu_exclude_nondeterministic_ops=true
fi
# One device: dp=1, nothing to split; the arms' times and memory then show what the wrapper itself costs.
DP=""
if [ "$DEVICES" -lt 2 ]; then
  echo "bench_accelerator: one device; Zero-1 has nothing to split at dp=1 (the wrapper's cost only)" >&2
  DP=1
fi
for n in 2 4 8 16 32 64 128 256; do
  if [ "$n" -le "$DEVICES" ]; then DP="${DP:+$DP,}$n"; fi
done
MAX_DP=${DP##*,}
ARMS_FLAG=()
if [ -n "${ARMS:-}" ]; then ARMS_FLAG=(--arms "$ARMS"); fi

# No preallocation: the arms of one cell are built and freed one cell at a time.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
exec python -m benchmarks.bench \
  --model "$MODEL" --dp "${DP_LIST:-$DP}" --ga "${GA:-1,8}" \
  --batch "${BATCH:-$((4 * MAX_DP))}" --seq-len "${SEQ_LEN:-1024}" \
  --steps "${STEPS:-20}" --warmup "${WARMUP:-3}" "${ARMS_FLAG[@]}" --out "$OUT"
