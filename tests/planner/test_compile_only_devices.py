"""``compile_only_devices``: the devices a plan compiles for, one public call, in a process of its own (it
makes that process a planning process)."""

import subprocess
import sys

import pytest

from tests.support.compiled_plans import HAS_LIBTPU, planner_env

CALL = ("from nnx_zero1_plan import compile_only_devices\n"
        "devices = compile_only_devices({topology!r}, slices={slices})\n"
        "print(len(devices), devices[0].device_kind, devices[0].platform)\n")


def run(topology: str, slices: int = 1) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-c", CALL.format(topology=topology, slices=slices)],
                        env=planner_env(), capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(not HAS_LIBTPU, reason="needs libtpu: ./planner[aot], Python >= 3.12 (CI lane 2)")
def test_two_v5e_slices_are_sixteen_chips_that_compile():
  done = run("v5e:2x4", slices=2)
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.split("\n")[0] == "16 TPU v5 lite tpu", done.stdout


@pytest.mark.skipif(HAS_LIBTPU, reason="the refusal of a process without libtpu (CI lane 1)")
def test_without_the_compiler_it_says_what_to_install():
  done = run("v5e:2x4")
  assert done.returncode != 0, done.stdout
  assert "AotUnavailable" in done.stderr and "pip install" in done.stderr, done.stderr


def test_an_unknown_topology_is_a_plan_error():
  done = run("h300:8")
  assert done.returncode != 0, done.stdout
  assert "PlanError" in done.stderr and "unknown topology 'h300:8'" in done.stderr, done.stderr[-2000:]
