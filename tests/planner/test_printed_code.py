"""The recommendation's code runs where it was planned (CI lane 2): each lever's printed code, its device
list the compile-only topology's, builds the plan's mesh (on a pod ``replica`` across the slices or nodes, one
each) and, under it, a small model and the optimizer, abstractly, as the planner does (``nnx.eval_shape``)."""

import json
import subprocess
import sys

import pytest

from tests.support.compiled_plans import HAS_GPU_COMPILER, HAS_LIBTPU, planner_env

_RUN_PRINTED = """
import json, sys, textwrap
from nnx_zero1_plan import compilers
compilers.start_cpu_jax()
import jax
from flax import nnx
from nnx_zero1_plan.inputs import parse_mesh, parse_model
from nnx_zero1_plan.mesh_axes import mesh_axes
from nnx_zero1_plan.printed_code import lever_code
from nnx_zero1_plan.targets import make_target
from tests.support.planner_toys import tiny_lm

def printed(topology, slices, mesh, levers):
  target = make_target(topology, slices=slices)
  where = target.backend.domain
  axes = mesh_axes(parse_mesh(mesh), [], len(target.devices), domains=target.domains, where=where)
  return {"axes": axes, "domains": target.domains,
          "levers": {lever: built(lever, axes, target) for lever in levers}}


def built(lever, axes, target):
  code = lever_code(lever, parse_model("my_pkg.models:build"), mesh=axes, backend=target.backend,
                    domains=target.domains)
  assert code.count("devices = jax.devices()") == 1 and code.count("model = ...") == 1, code
  prelude, body = code.replace("devices = jax.devices()", "devices = list(compile_only)").split(
      "with jax.set_mesh(mesh):\\n")
  namespace = {"compile_only": target.devices, "tiny_lm": tiny_lm}
  exec(prelude, namespace)  # the imports and the mesh, as printed
  block = textwrap.dedent(body).replace("model = ...", "model = tiny_lm()")

  def build():  # the block under the mesh, as printed, traced: these devices compile but never run
    scope = dict(namespace)
    exec(block, scope)
    return scope["model"], scope["optimizer"]

  mesh_built = namespace["mesh"]
  with jax.set_mesh(mesh_built):
    model, optimizer = nnx.eval_shape(build)
  plan = getattr(optimizer, "zero1_plan", None)
  return {
      "names": list(mesh_built.axis_names), "shape": list(mesh_built.devices.shape),
      "types": sorted({str(t) for t in mesh_built.axis_types}),
      # each replica's devices: the slices or nodes they sit in
      "domains": [sorted({target.domain_of(d) for d in mesh_built.devices[r].flat})
                  for r in range(mesh_built.devices.shape[0])] if "replica" in axes else None,
      "devices": sorted(d.id for d in mesh_built.devices.flat) == sorted(d.id for d in target.devices),
      "optimizer": type(optimizer).__name__,
      "split_over": sorted({a for row in plan.state_leaves for e in row.sharding.spec if e
                            for a in (e if isinstance(e, tuple) else (e,))}) if plan else None}
print("RESULT " + json.dumps([printed(*case) for case in json.loads(sys.argv[1])]))
"""


def _printed(*cases: tuple[str, int, str | None, list[str]]) -> list[dict]:
  """Each case's printed code run on its topology's compile-only devices, one process for them all."""
  arg = json.dumps(cases)
  proc = subprocess.run([sys.executable, "-c", _RUN_PRINTED, arg], env=planner_env(), capture_output=True,
                        text=True, timeout=400)
  assert proc.returncode == 0, proc.stderr[-3000:]
  (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
  return json.loads(line[len("RESULT "):])


def _check(out: dict, pod: bool) -> None:
  axes = out["axes"]
  for lever, built in out["levers"].items():
    assert built["names"] == list(axes) and built["shape"] == list(axes.values()), (lever, built)
    assert built["devices"] and built["types"] == ["AxisType.Auto"], (lever, built)
    assert built["optimizer"] == ("Optimizer" if lever == "baseline" else "Zero1Optimizer"), lever
    if pod:  # replica i holds slice (or node) i's devices, and only them
      assert built["domains"] == [[i] for i in range(out["domains"])], (lever, built["domains"])
  if "zero1" in out["levers"]:
    assert out["levers"]["zero1"]["split_over"] == ["data"]
  if "zero1-pod" in out["levers"]:
    assert out["levers"]["zero1-pod"]["split_over"] == ["data", "replica"]


ONE = ["baseline", "zero1", "zero2"]
POD = [*ONE, "zero1-pod"]


@pytest.mark.skipif(not HAS_LIBTPU, reason="needs libtpu: ./planner[aot], Python >= 3.12 (CI lane 2)")
def test_the_printed_code_builds_the_planned_mesh_on_tpu_slices():
  """v5e:2x2, one slice (``jax.make_mesh``) and two (MaxText's hybrid mesh; ``jax.make_mesh`` refuses a
  multi-slice topology's devices), with the default mesh and with fsdp."""
  one, two, fsdp = _printed(("v5e:2x2", 1, None, ONE), ("v5e:2x2", 2, None, POD),
                            ("v5e:2x2", 2, "replica=2,data=2,fsdp=2", POD))
  _check(one, pod=False)
  _check(two, pod=True)
  _check(fsdp, pod=True)


@pytest.mark.skipif(not HAS_GPU_COMPILER, reason="needs XLA's GPU compiler (CI lane 2)")
def test_the_printed_code_builds_the_planned_mesh_on_gpu_nodes():
  """h100:8, one node (``jax.make_mesh``), and h100:2x8, two (the devices ordered node by node: a real
  cluster's hosts are slices to jax, and a compile-only topology's nodes are processes)."""
  one, two, fsdp = _printed(("h100:8", 1, None, ONE), ("h100:2x8", 1, None, POD),
                            ("h100:2x8", 1, "replica=2,data=4,fsdp=2", POD))
  _check(one, pod=False)
  _check(two, pod=True)
  _check(fsdp, pod=True)
