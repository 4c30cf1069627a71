"""A one-GPU step timed by its twin (nnx_zero1_plan.gpu_twin): the twin does the one GPU's work, kernel for
kernel, and a plan for one H200 prints a time from it (CI lane 2, which has XLA's GPU compiler)."""

import json
import subprocess
import sys

import pytest

from nnx_zero1_plan.gpu_twin import without_twin_collective
from nnx_zero1_plan.program_record import ProgramRecord
from tests.support.compiled_plans import HAS_GPU_COMPILER, planner_env

_TWIN = """
import collections, json, re
from nnx_zero1_plan import compilers
compilers.start_cpu_jax()
import numpy as np
from jax.sharding import AxisType, Mesh
from nnx_zero1_plan.gpu_twin import compile_twin
from nnx_zero1_plan.hlo_flops import dot_flops
from nnx_zero1_plan.levers import LEVERS
from nnx_zero1_plan.models import model_source
from nnx_zero1_plan.program_record import ProgramRecord
from nnx_zero1_plan.request import PlanRequest
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

print("RESULT " + json.dumps({
    "row": plan.rows[0].to_json(), "only_one": kernels(one) - kernels(twin),
    "only_twin": kernels(twin) - kernels(one), "flops": [dot_flops(one), dot_flops(twin)],
    "collectives": sum(1 for b in twin.computations.values() for i in b if i.collective),
    "unpriced": kernels(twin, scheduled[twin.module])}))
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
  # Its all-reduces are left out of the walk, and the scheduler priced every kernel of the loop and the entry.
  assert got["collectives"] == 0 and got["unpriced"] == {}
  row = got["row"]
  assert row["time_absent"] is None and row["predicted_step_s"] > 0 and 0 < row["mfu"] < 1
  parts = row["step_time"]
  assert parts["source"].startswith("XLA's GPU cost model") and parts["fast_s"] == 0
  assert row["predicted_step_s"] == pytest.approx(parts["compute_s"])


def _twin_hlo(big: str) -> ProgramRecord:
  """A twin's entry: its scalar all-reduce, waited for, and a second all-reduce of ``big``'s shape."""
  return ProgramRecord.read(f"""HloModule twin, num_partitions=2
ENTRY %main (p: f32[], q: {big}) -> (f32[], {big}) {{
  %p = f32[] parameter(0)
  %q = {big} parameter(1)
  %ar = ((f32[]), f32[]) all-reduce-start(%p), replica_groups={{{{0,1}}}}, to_apply=%add
  %d = f32[] all-reduce-done(%ar)
  %r = {big} all-reduce(%q), replica_groups={{{{0,1}}}}, to_apply=%add
  ROOT %t = (f32[], {big}) tuple(%d, %r)
}}""")


def test_a_twin_loses_only_its_scalar_all_reduces():
  assert [i.name for i in without_twin_collective(_twin_hlo("f32[]")).computations["main"]] == ["p", "q", "t"]
  with pytest.raises(ValueError, match="holds no collective but its own"):
    without_twin_collective(_twin_hlo("f32[8]"))
