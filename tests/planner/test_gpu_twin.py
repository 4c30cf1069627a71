"""A one-GPU step timed by its twin (nnx_zero1_plan.gpu_twin): the twin does the one GPU's work, kernel for
kernel, and a plan for one H200 prints a time from it (CI lane 2, which has XLA's GPU compiler)."""

import json
import subprocess
import sys

import pytest

from nnx_zero1_plan.gpu_twin import as_scheduled
from nnx_zero1_plan.program_record import ProgramRecord
from tests.support.compiled_plans import HAS_GPU_COMPILER, planner_env

_TWIN = """
import collections, json, pathlib, re, tempfile
from nnx_zero1_plan import compilers
compilers.start_cpu_jax()
from jax.profiler import ProfileData
from nnx_zero1_plan.calibrated_time import calibrate, calibrated_step, read_program
from nnx_zero1_plan.chips import CHIPS
from nnx_zero1_plan.on_chip import device_ops
from nnx_zero1_plan.step_time import rates_for
import numpy as np
from jax.sharding import AxisType, Mesh
from nnx_zero1_plan.gpu_twin import as_scheduled, compile_twin
from nnx_zero1_plan.hlo_flops import dot_flops
from nnx_zero1_plan.levers import LEVERS
from nnx_zero1_plan.models import model_source
from nnx_zero1_plan.program_record import ProgramRecord
from nnx_zero1_plan.request import PlanRequest
from nnx_zero1_plan.row_compiler import gpu_estimates
from nnx_zero1_plan.run import make_plan
from nnx_zero1_plan.steps import StepShape, compile_step, lever_state
from nnx_zero1_plan.targets import make_target

model = "tests.support.planner_toys:tiny_lm_bf16"
plan = make_plan(PlanRequest(model, "h200:1", batch=8, seq_len=64, ga=2, levers="baseline", steps="one"))
source, target, lever = model_source(model), make_target("h200:1"), LEVERS["baseline"]
mesh = Mesh(np.array(target.devices), ("data",), axis_types=(AxisType.Auto,))
build = lambda: source.build(None)
one = compile_step(lever, lever_state(lever, build, "adamw", mesh), source.loss_fn, mesh, 8, 64, 2)[0]
one = ProgramRecord.read(one.as_text())
twin, scheduled = compile_twin(lever, build, source.loss_fn, mesh, StepShape(8, 64, 2, "adamw"), target)

def kernels(record, priced=None):  # each kernel a step launches by op and first result, times it runs
  out = collections.Counter()
  def walk(name, times):
    for i in record.computations[name]:
      if i.op in ("while", "call", "conditional"):
        for call in i.calls:
          walk(call.computation, times * call.times)
      elif i.op in ("fusion", "custom-call") and (priced is None or i.name not in priced):
        out[i.op + " " + re.sub(r"{[^}]*}", "", i.shape).lstrip("(").split(", ")[0].rstrip(")")] += times
  walk(record.entry, 1)
  return out

given = as_scheduled(one, twin, scheduled)[one.module]

# A GPU's profile of two runs of the one GPU's step, built on its own instructions (each kernel as long as the
# plan prices it, times 1.25 for a matmul and 0.8 for the rest, a microsecond between kernels), calibrated.
(_, timed, _), = gpu_estimates([("step", one, 1)], {one.module: given}, target)  # as the plan reads it
priced = read_program(timed, rates_for(CHIPS["h200"]))
speed = lambda kind: 1.25 if kind.startswith("matmul") else 0.8
events, at = [], 0
for trip in [t for _ in range(2) for t in range(2)]:  # two runs, each two trips of the micro-batches' loop
  for name, (kind, seconds, runs) in priced.priced.items():
    if trip < runs:
      ps = round(seconds * speed(kind) * 1e12)
      events.append(f'events {{ metadata_id: 1 offset_ps: {at} duration_ps: {ps} stats {{ metadata_id: 1 '
                    f'str_value: "{name}" }} stats {{ metadata_id: 2 str_value: "{one.module}" }} }}')
      at += ps + 10**6
xspace = ProfileData.text_proto_to_serialized_xspace(
    'planes { id: 1 name: "/device:GPU:0" lines { id: 1 name: "Stream #13(Compute)" timestamp_ns: 0 '
    + " ".join(events) + ' } event_metadata { key: 1 value { id: 1 name: "kernel" } } stat_metadata { key: 1 '
    'value { id: 1 name: "hlo_op" } } stat_metadata { key: 2 value { id: 2 name: "hlo_module" } } }')
with tempfile.TemporaryDirectory() as folder:
  pathlib.Path(folder, "t.xplane.pb").write_bytes(xspace)
  ops = device_ops(str(pathlib.Path(folder, "t.xplane.pb")), 2)
device_s = sum(ns for ns, _ in ops["modules"].values()) / 1e9
calibration = calibrate(priced, ops, lever="baseline", micro_batch=8, ga=2, seq_len=64,
                        step_s=device_s + 1e-3, chip="h200", jax="0.12.0.1", libtpu=None, topology="h200:1")
print("RESULT " + json.dumps({
    "row": plan.rows[0].to_json(), "only_one": kernels(one) - kernels(twin),
    "only_twin": kernels(twin) - kernels(one), "flops": [dot_flops(one), dot_flops(twin)],
    "unpriced": kernels(twin, scheduled[twin.module]),
    "given": kernels(one, given), "seconds": [sum(given.values()), sum(scheduled[twin.module].values())],
    "ratios": {k: t.ratio for k, t in calibration.kinds.items()}, "step_s": device_s + 1e-3,
    "calibrated_s": calibrated_step([(priced, 1)], calibration)[0], "walk_s": sum(
        seconds * runs for _, seconds, runs in priced.priced.values())}))
"""


@pytest.mark.skipif(not HAS_GPU_COMPILER, reason="needs XLA's GPU compiler (CI lane 2)")
def test_one_gpu_step_is_timed_by_a_twin_that_does_its_work():
  proc = subprocess.run([sys.executable, "-c", _TWIN], env=planner_env(), capture_output=True, text=True,
                        timeout=400)
  assert proc.returncode == 0, proc.stderr[-3000:]
  (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
  got = json.loads(line[len("RESULT "):])
  # The twin launches every kernel of the one-GPU step, no other but its own scalar work: one tiny fusion per
  # micro-batch (GA 2) feeding its all-reduce, and one beside the loss. (A kernel of the one GPU may also
  # write a copy of a weight that its order of kernels needs and the twin's does not.)
  assert got["only_one"] == {}
  assert got["only_twin"] == {"fusion f32[1,1]": 2, "fusion f32[]": 1}
  assert got["flops"][0] == got["flops"][1] > 0
  # The scheduler priced every kernel of the twin's loop and entry, and each of the one GPU's has its twin's
  # estimate: all the twin's time but its own scalar work's and all-reduces' (microseconds of 1.7 ms).
  assert got["unpriced"] == {} and got["given"] == {}
  assert 0 < got["seconds"][1] - got["seconds"][0] < 1e-5
  row = got["row"]
  assert row["time_absent"] is None and row["predicted_step_s"] > 0 and 0 < row["mfu"] < 1
  parts = row["step_time"]
  assert parts["source"].startswith("XLA's GPU cost model") and parts["fast_s"] == 0
  assert row["predicted_step_s"] == pytest.approx(parts["compute_s"])
  # --measure's calibration from a GPU's profile (kernels keyed by their instruction): each kind at its
  # speed, and the profiled step priced by it again is the step measured (the millisecond of launch too).
  assert got["ratios"] == {"matmul": pytest.approx(1.25, rel=1e-3), "vector": pytest.approx(0.8, rel=1e-3)}
  assert got["calibrated_s"] == pytest.approx(got["step_s"], rel=1e-6)
  assert got["walk_s"] == pytest.approx(row["predicted_step_s"], rel=1e-6)


def _program(name: str, fusion: str, result: str) -> ProgramRecord:
  """One GPU program: a matmul fusion ``fusion`` with ``result``, and a copy."""
  return ProgramRecord.read(f"""HloModule {name}
%body (a: bf16[64,32], b: bf16[32,16]) -> bf16[64,16] {{
  %a = bf16[64,32]{{1,0}} parameter(0)
  %b = bf16[32,16]{{1,0}} parameter(1)
  ROOT %d = bf16[64,16]{{1,0}} dot(%a, %b), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}
ENTRY %main (a: bf16[64,32], b: bf16[32,16]) -> bf16[64,16] {{
  %a = bf16[64,32]{{1,0}} parameter(0)
  %b = bf16[32,16]{{1,0}} parameter(1)
  %{fusion} = {result} fusion(%a, %b), kind=kCustom, calls=%body
  ROOT %c = bf16[64,16]{{1,0}} copy(%a)
}}""")


def test_a_twins_estimates_go_to_the_one_gpus_kernels_alike():
  twin = _program("jit_twin_step", "gemm_fusion_dot.7", "bf16[64,16]{1,0}")
  scheduled = {"jit_twin_step": {"gemm_fusion_dot.7": 2e-6, "c": 1e-7}}
  one = _program("jit_step", "gemm_fusion_dot.3", "bf16[64,16]{1,0}")
  assert as_scheduled(one, twin, scheduled) == {"jit_step": {"gemm_fusion_dot.3": 2e-6, "c": 1e-7}}
  # A kernel that also writes a copy of a weight pairs by its first result; one of another result, not at all.
  copying = _program("jit_step", "f", "(bf16[64,16]{1,0}, bf16[32,16]{1,0})")
  assert as_scheduled(copying, twin, scheduled) == {"jit_step": {"f": 2e-6, "c": 1e-7}}
  other = _program("jit_step", "f", "bf16[16,64]{1,0}")
  assert as_scheduled(other, twin, scheduled) == {"jit_step": {"c": 1e-7}}
