#!/usr/bin/env bash
# The accelerator measurements of docs/benchmarks.md and docs/accuracy.md, rerun with their raw output kept.
#
#   OUT=/tmp/device scripts/device_check.sh gpu      # one GPU (an H200): about 6 minutes
#   OUT=/tmp/device scripts/device_check.sh gpu N    # one H200, the planner's time checked: commit $OUT/* as
#                                                    # docs/data/device_h200/runN (under 15 minutes)
#   OUT=/tmp/device scripts/device_check.sh tpu 1    # one TPU v5e chip, in three runs of under 10 minutes
#   OUT=/tmp/device scripts/device_check.sh tpu 2    # (each program's start and compile on the chip takes
#   OUT=/tmp/device scripts/device_check.sh tpu 3    # about a minute); commit $OUT/* under docs/data/device_v5e/
#   OUT=/tmp/device scripts/device_check.sh tpu 4    # (later: the fused kinds, and two more cases)
#   OUT=/tmp/device scripts/device_check.sh tpu 5    # (the fused kinds again, on a step's activations too)
#   OUT=/tmp/device scripts/device_check.sh tpu 6    # (a calibration from one run, checked on three more)
#   OUT=/tmp/device scripts/device_check.sh tpu 7    # (calibrated on a run built as the checked ones are)
#   OUT=/tmp/device scripts/device_check.sh tpu 8    # (calibrated on two runs built as the checked ones are)
#   OUT=/tmp/device scripts/device_check.sh tpu 9    # (the search's edge on the chip's own jax; a global batch)
#   OUT=/tmp/device scripts/device_check.sh tpu 10   # (a global batch's splits, each build profiled)
#   OUT=/tmp/device scripts/device_check.sh tpu 11   # (another lever's update, profiled as its own build)
#
# Each measurement writes its folder: the command, its stdout and stderr, its exit status and wall time;
# versions.json says what ran. GPU: the compiler's figure against the allocator (two memory pools), each
# step's median time against the planner's predicted time for the same compiled program, and the wrapper at
# dp=1 with XLA's deterministic ops. TPU: the chip's own constants alone first (benchmarks.chip_rates: the
# clock behind the compiler's cycles, the host link), then the planner's one-program step for every kept
# case (benchmarks.limit --keep: each compiled program's text, its median step time and a profile of each
# instruction's time on the chip), and the planner itself with --measure. docs/accuracy.md's "One TPU v5e
# chip" reads its table off these folders (tests/planner/test_device_records.py).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench_out/device}
PLATFORM=${1:-gpu}
PART=${2:-}
D=examples.planner_decoder
mkdir -p "$OUT"
git rev-parse HEAD > "$OUT/commit" 2> /dev/null || true
python -c "import jax, jaxlib, flax, optax, json, platform; print(json.dumps({'python': platform.python_version(), \
'jax': jax.__version__, 'jaxlib': jaxlib.__version__, 'flax': flax.__version__, 'optax': optax.__version__, \
'devices': [d.device_kind for d in jax.devices()]}))" > "$OUT/versions.json" 2> "$OUT/versions.stderr"

keep() {  # keep NAME COMMAND...: the command, its output and its exit status under $OUT/NAME
  local name=$1; shift
  mkdir -p "$OUT/$name"
  echo "$*" > "$OUT/$name/command"
  local start=$SECONDS
  env "$@" > "$OUT/$name/stdout.txt" 2> "$OUT/$name/stderr.txt"
  echo "rc $? wall $((SECONDS - start)) s" > "$OUT/$name/exit"
}

limit() {  # limit NAME MODEL LEVER BATCHES [ARGS...]: benchmarks.limit, each program and profile kept
  local name=$1 model=$2 lever=$3 batches=$4; shift 4
  keep "$name" python -m benchmarks.limit --model "$model" --lever "$lever" --batch "$batches" "$@" \
    --keep "$OUT/$name/programs" --out "$OUT/$name/out"
}

if [ "$PLATFORM" = gpu ] && [ -n "$PART" ]; then
  # The 1.21B bfloat16 decoder planned on this H200 (h200:1) with --measure: the first run (micro-batch 2)
  # profiled into a calibration, then micro-batches 4 and 8, the same decoder scanned and rematerialised,
  # and the offload lever, each priced by the cost model and by that calibration and run. Each plan's
  # autotune results are kept, for deviceless compiles (XLA_FLAGS=--xla_gpu_load_autotune_results_from=...).
  nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
  plan() {  # plan NAME ARGS...: the planner on this GPU, its plan, its autotune results
    local name=$1; shift
    keep "$name" XLA_FLAGS="--xla_gpu_dump_autotune_results_to=$OUT/$name/autotune.txt" python -m nnx_zero1.plan \
      --topology h200:1 --seq-len 2048 --levers baseline --steps one --measure "$@" --out "$OUT/$name"
  }
  plan calibrate --model "$D:build_1b" --batch 2
  for b in 4 8; do
    plan calibrated_$b --model "$D:build_1b" --batch $b --calibration "$OUT/calibrate"
  done
  plan calibrated_remat --model "$D:build_1b_scanned" --batch 8 --calibration "$OUT/calibrate"
  plan calibrated_offload --model "$D:build_1b" --batch 4 --levers offload --calibration "$OUT/calibrate"
  python - "$OUT" > "$OUT/measured.json" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
rows = [dict(plan=p.parent.name, lever=r["lever"], batch=r["batch"], predicted_s=r.get("predicted_step_s"),
             calibrated_s=r.get("calibrated_step_s"), measured=r.get("measured"))
        for p in sorted(out.glob("*/plan.json")) for r in json.loads(p.read_text())["rows"]]
print(json.dumps({"what": "each plan's rows on this H200: the cost model's, the calibrated and the measured step",
                  "rows": rows}, indent=1))
PY
elif [ "$PLATFORM" = gpu ]; then
  nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
  keep h200_limit_0p2 XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 python -m benchmarks.limit --batch 8,16 \
    --out "$OUT/h200_limit_0p2/out"
  keep h200_limit_0p75 XLA_PYTHON_CLIENT_MEM_FRACTION=0.75 python -m benchmarks.limit --batch 8,24,32 \
    --out "$OUT/h200_limit_0p75/out"
  keep h200_dp1_deterministic BATCH=4 GA=1,8 STEPS=8 WARMUP=1 ARMS=baseline,zero1 \
    bash scripts/bench_accelerator.sh qwen3-0.6b "$OUT/h200_dp1_deterministic/out"
elif [ "${PART:-1}" = 1 ]; then
  keep chip_rates python -m benchmarks.chip_rates --out "$OUT/chip_rates/out"
  limit build_baseline "$D:build" baseline 8,4,13
  limit build_1b_baseline "$D:build_1b" baseline 2,4
  limit build_offload "$D:build" offload 4
  limit build_zero1 "$D:build" zero1 8
elif [ "${PART:-1}" = 2 ]; then
  keep chip_rates python -m benchmarks.chip_rates --out "$OUT/chip_rates/out"
  limit build_scanned_remat "$D:build_scanned" baseline 8
  limit build_zero1_bf16state "$D:build" zero1-bf16state 8
  limit build_1b_zero1_master "$D:build_1b" zero1-master 2
  limit build_seq512 "$D:build" baseline 16 --seq-len 512
  limit build_seq2048 "$D:build" baseline 4 --seq-len 2048
  limit build_baseline_ga4 "$D:build" baseline 4 --ga 4
elif [ "${PART:-1}" = 4 ]; then
  # The fused kinds alone (a matmul with the reductions a step fuses into it), then cases no constant was
  # measured on: the micro-batch part 3 did not reach, and the float32 masters on the smaller model.
  keep chip_rates python -m benchmarks.chip_rates --out "$OUT/chip_rates/out"
  limit build_baseline_12 "$D:build" baseline 12
  limit build_zero1_master "$D:build" zero1-master 4
elif [ "${PART:-1}" = 5 ]; then
  # The fused kinds alone again, with a step's three-dimensional activations among them.
  keep chip_rates python -m benchmarks.chip_rates --out "$OUT/chip_rates/out"
elif [ "${PART:-1}" = 6 ]; then
  # Measure one, predict the rest: --measure calibrates on its first run (build at 4) and searches up; the
  # calibration kept there then times other steps, each run on the chip to check it (8 with zero1, 4 x GA 4).
  keep plan_calibrate python -m nnx_zero1.plan --model "$D:build" --topology v5e:1x1 --batch 4 \
    --levers baseline --steps one --search --measure --out "$OUT/plan_calibrate/out"
  keep plan_calibrated python -m nnx_zero1.plan --model "$D:build" --topology v5e:1x1 --batch 8 \
    --levers baseline,zero1 --steps one --measure --calibration "$OUT/plan_calibrate/out" \
    --out "$OUT/plan_calibrated/out"
  keep plan_calibrated_ga4 python -m nnx_zero1.plan --model "$D:build" --topology v5e:1x1 --batch 4 --ga 4 \
    --levers baseline --steps one --measure --calibration "$OUT/plan_calibrate/out" \
    --out "$OUT/plan_calibrated_ga4/out"
elif [ "${PART:-1}" = 7 ]; then
  # A calibration taken on a run built as the checked steps are: GA 4's loop calibrated at 4 x GA 4 and
  # checked at 8 x GA 4 and 2 x GA 4; the scanned model calibrated at 4 and checked at 8.
  keep plan_calibrate_ga4 python -m nnx_zero1.plan --model "$D:build" --topology v5e:1x1 --batch 4 --ga 4 \
    --levers baseline --steps one --measure --out "$OUT/plan_calibrate_ga4/out"
  for b in 8 2; do
    keep plan_calibrated_ga4_$b python -m nnx_zero1.plan --model "$D:build" --topology v5e:1x1 --batch $b \
      --ga 4 --levers baseline --steps one --measure --calibration "$OUT/plan_calibrate_ga4/out" \
      --out "$OUT/plan_calibrated_ga4_$b/out"
  done
  keep plan_calibrate_scanned python -m nnx_zero1.plan --model "$D:build_scanned" --topology v5e:1x1 \
    --batch 4 --levers baseline --steps one --measure --out "$OUT/plan_calibrate_scanned/out"
  keep plan_calibrated_scanned_8 python -m nnx_zero1.plan --model "$D:build_scanned" --topology v5e:1x1 \
    --batch 8 --levers baseline --steps one --measure --calibration "$OUT/plan_calibrate_scanned/out" \
    --out "$OUT/plan_calibrated_scanned_8/out"
elif [ "${PART:-1}" = 8 ]; then
  # Two runs built alike calibrate the others: build at 4 and at 12 (the largest micro-batch but one that
  # fits; 13 the compiler fuses anew), each measured alone, then given together to steps at 8 and at 16 x 512.
  for b in 4 12; do
    keep plan_calibrate_$b python -m nnx_zero1.plan --model "$D:build" --topology v5e:1x1 --batch $b \
      --levers baseline --steps one --measure --out "$OUT/plan_calibrate_$b/out"
  done
  two="$OUT/plan_calibrate_4/out,$OUT/plan_calibrate_12/out"
  for case in "8 1024" "16 512"; do
    set -- $case
    keep plan_calibrated_two_$1_$2 python -m nnx_zero1.plan --model "$D:build" --topology v5e:1x1 --batch $1 \
      --seq-len $2 --levers baseline --steps one --measure --calibration "$two" \
      --out "$OUT/plan_calibrated_two_$1_$2/out"
  done
elif [ "${PART:-1}" = 9 ]; then
  # The planner as a user runs it on the chip's own jax: the scanned, rematerialised model searched to its
  # largest micro-batch (the compiler's own peak on jax 0.10.2; the edge run and profiled, the next refused).
  keep plan_search_scanned python -m nnx_zero1.plan --model "$D:build_scanned" --topology v5e:1x1 \
    --levers baseline --steps one --search --measure --out "$OUT/plan_search_scanned/out"
elif [ "${PART:-1}" = 10 ]; then
  # A fixed global batch of 12 sequences: each split compiled largest first, each build (one program, the
  # accumulation loop) profiled once, the splits close to the fastest run and the fastest measured chosen.
  keep plan_global_batch python -m nnx_zero1.plan --model "$D:build" --topology v5e:1x1 --global-batch 12 \
    --levers baseline --steps one --measure --out "$OUT/plan_global_batch/out"
elif [ "${PART:-1}" = 11 ]; then
  # Two levers at micro-batch 8, each lever's update a build of its own: each profiled as it is compiled and
  # priced by its own run, then both run as the plan's rows.
  keep plan_two_levers python -m nnx_zero1.plan --model "$D:build" --topology v5e:1x1 --batch 8 \
    --levers baseline,zero1-bf16state --steps one --measure --out "$OUT/plan_two_levers/out"
else
  # The planner where the chips are: it compiles for this machine's chip and runs each fitting row's step.
  keep plan_measure python -m nnx_zero1_plan --model "$D:build" --topology v5e:1x1 --batch 8 --seq-len 1024 \
    --levers baseline,zero1 --steps one --measure --out "$OUT/plan_measure/out"
  keep plan_v5e_2x2 timeout 120 python -m nnx_zero1_plan --model "$D:build" --topology v5e:2x2 --batch 8 \
    --levers baseline --steps one --out "$OUT/plan_v5e_2x2/out"
  limit build_baseline_more "$D:build" baseline 10,12
fi
