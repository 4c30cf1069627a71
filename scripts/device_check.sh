#!/usr/bin/env bash
# The GPU measurements of docs/benchmarks.md, rerun with their raw output kept, on a machine with one GPU.
#
#   OUT=/tmp/device scripts/device_check.sh      # then commit $OUT/* under docs/data/
#
# Each measurement writes its folder: the command, its stdout and stderr, the versions. About 6 minutes on
# one H200: the compiler's figure against the allocator (two memory pools), each step's median time against
# the planner's predicted time for the same compiled program (benchmarks.limit's "step ms" and "predicted ms"),
# and the wrapper at dp=1 with XLA's deterministic ops (bench_accelerator.sh sets the flag on GPU hosts).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench_out/device}
mkdir -p "$OUT"
python -c "import jax, jaxlib, flax, optax, json, platform; print(json.dumps({'python': platform.python_version(), \
'jax': jax.__version__, 'jaxlib': jaxlib.__version__, 'flax': flax.__version__, 'optax': optax.__version__, \
'devices': [d.device_kind for d in jax.devices()]}))" > "$OUT/versions.json" 2>&1
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1

keep() {  # keep NAME COMMAND...: the command, its output and its exit status under $OUT/NAME
  local name=$1; shift
  mkdir -p "$OUT/$name"
  echo "$*" > "$OUT/$name/command"
  local start=$SECONDS
  env "$@" > "$OUT/$name/stdout.txt" 2> "$OUT/$name/stderr.txt"
  echo "rc $? wall $((SECONDS - start)) s" > "$OUT/$name/exit"
}

keep h200_limit_0p2 XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 python -m benchmarks.limit --batch 8,16 \
  --out "$OUT/h200_limit_0p2/out"
keep h200_limit_0p75 XLA_PYTHON_CLIENT_MEM_FRACTION=0.75 python -m benchmarks.limit --batch 8,24,32 \
  --out "$OUT/h200_limit_0p75/out"
keep h200_dp1_deterministic BATCH=4 GA=1,8 STEPS=8 WARMUP=1 ARMS=baseline,zero1 \
  bash scripts/bench_accelerator.sh qwen3-0.6b "$OUT/h200_dp1_deterministic/out"
