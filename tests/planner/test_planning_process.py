"""The planning process is prepared one way, whether the command line runs it in its own process or
``plan()`` starts it (``compilers.planning_environment``): the planner's settings over the caller's,
and libtpu's lockfile removed only when no live process holds it. No compile: nothing loads libtpu."""

import json
import os
import re
import subprocess
import sys

import pytest

from nnx_zero1_plan import PlanError, compilers, plan


def test_the_planners_settings_win_over_the_callers_but_for_the_callers_own():
  caller = {"HOME": "/home/me", "JAX_PLATFORMS": "cuda", "CUDA_VISIBLE_DEVICES": "0,1",
            "ALLOW_MULTIPLE_LIBTPU_LOAD": "0", "TPU_ACCELERATOR_TYPE": "v5litepod-16",
            "TPU_MIN_LOG_LEVEL": "0"}
  env = compilers.planning_environment(caller, "/nonexistent/libtpu_lockfile")
  assert {key: env[key] for key in compilers.ENV.keys() - compilers.CALLERS_OWN} == {
      key: value for key, value in compilers.ENV.items() if key not in compilers.CALLERS_OWN}
  assert env["TPU_MIN_LOG_LEVEL"] == "0" and env["HOME"] == "/home/me"
  assert compilers.planning_environment({}, "/nonexistent/libtpu_lockfile") == compilers.ENV
  assert caller["JAX_PLATFORMS"] == "cuda"  # the caller's mapping is left as it was


def test_a_lockfile_is_removed_only_when_stale(tmp_path):
  lockfile = tmp_path / "libtpu_lockfile"
  lockfile.write_text("")
  with open(lockfile):  # a live holder: another planner's libtpu, or the caller's own on a TPU machine
    compilers.planning_environment({}, str(lockfile))
    assert lockfile.exists()
  compilers.planning_environment({}, str(lockfile))  # no holder left: a killed process's leftover
  assert not lockfile.exists()
  compilers.planning_environment({}, str(lockfile))  # none at all: nothing to do


@pytest.fixture
def callers_values(monkeypatch):
  """A caller whose environment sets every setting of the planner's its own way (monkeypatch puts this
  process's environment back afterwards)."""
  for key in compilers.ENV:
    monkeypatch.setenv(key, "caller's")
  return {key: "caller's" for key in compilers.ENV}


def test_the_command_line_prepares_its_own_process_the_same_way(callers_values):
  expected = compilers.planning_environment(dict(os.environ))
  compilers.start_cpu_jax()
  assert dict(os.environ) == expected
  assert os.environ["CUDA_VISIBLE_DEVICES"] == "-1" and os.environ["TPU_MIN_LOG_LEVEL"] == "caller's"


def test_plan_starts_its_planning_process_prepared_so(callers_values):
  # The planning process reports its environment from the model's builder, before any compile.
  with pytest.raises(PlanError, match="environment") as raised:
    plan("tests.support.planner_toys:tiny_lm_naming_its_environment", "v6e:2x2")
  (reported,) = re.findall(r"environment (\{.*?\})", str(raised.value))
  assert json.loads(reported) == compilers.planning_environment(callers_values)


def test_the_compilers_own_messages_go_to_their_log_and_the_planners_lines_to_the_terminal(tmp_path):
  """XLA's C++ warnings are written to file descriptor 2, out of Python's reach: inside
  ``compiler_messages_to`` they land in the log, the planner's own lines on the terminal's stderr, and after
  the block descriptor 2 is the terminal's again."""
  log = tmp_path / "compiler.log"
  script = (
      "import os, sys\n"
      "from nnx_zero1_plan.compilers import compiler_messages_to\n"
      f"with compiler_messages_to({str(log)!r}) as terminal:\n"
      "  os.write(2, b'W external/xla: Can not reduce memory use below 56.42GiB\\n')\n"
      "  print('nnx_zero1.plan: compiling', file=terminal)\n"
      "os.write(2, b'after\\n')\n")
  proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
  assert proc.returncode == 0, proc.stderr
  assert proc.stderr == "nnx_zero1.plan: compiling\nafter\n"
  assert log.read_text() == "W external/xla: Can not reduce memory use below 56.42GiB\n"
