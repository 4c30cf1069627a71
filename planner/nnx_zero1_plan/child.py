"""``plan()``'s planning process: the compilers need one prepared for them (the CUDA plugin and libtpu told
there is no device: :data:`nnx_zero1_plan.compilers.ENV` over the caller's own values), and a notebook's or a
trainer's process must stay as it was, its GPUs visible, so the plan is made in a child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable, Mapping
from typing import Any

from nnx_zero1_plan import compilers
from nnx_zero1_plan.inputs import PlanError
from nnx_zero1_plan.request import PlanRequest
from nnx_zero1_plan.result import Plan

__all__ = ["MARK", "plan_in_child", "child_env", "say", "main"]

MARK = "nnx_zero1_plan.child:"  # starts every line of a child process's answers on its stdout
_ERRORS = {"PlanError": PlanError, "AotUnavailable": compilers.AotUnavailable}


def plan_in_child(request: PlanRequest, progress: Callable[[str], None] | None = None,
                  local: bool = False) -> Plan:
  """Runs ``request`` in a planning process; this process's environment, files and jax are left alone.

  Args:
    request: the plan's settings.
    progress: called with each progress line as the planning process reports it.
    local: compile for this machine's own devices, the target's chips (the planning process keeps the
      caller's environment, its chips visible: :func:`nnx_zero1_plan.targets.local_target`).

  Returns:
    The :class:`Plan`, as the command line would print and write it.

  Raises:
    PlanError, AotUnavailable: as the planning process raised them.
    RuntimeError: the planning process failed otherwise (its last lines of output in the message).
  """
  own = compilers.prepare_planning_process(os.environ)  # a stale libtpu lockfile removed too
  env = child_env(os.environ if local else own)
  command = [sys.executable, "-m", "nnx_zero1_plan.child", *(["--local"] if local else [])]
  other: list[str] = []
  result = None
  with subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        env=env, text=True) as child:
    assert child.stdin is not None and child.stdout is not None  # both are pipes
    child.stdin.write(request.to_json())
    child.stdin.close()
    for line in child.stdout:
      if not line.startswith(MARK):
        other.append(line.rstrip("\n"))
        continue
      message = json.loads(line[len(MARK):])
      if "progress" in message and progress:
        progress(message["progress"])
      result = message if "progress" not in message else result
  if result is not None and "plan" in result:
    return Plan.from_record(result["plan"])
  if result is not None and result["error"]["type"] in _ERRORS:
    raise _ERRORS[result["error"]["type"]](result["error"]["message"])
  why = result["error"]["traceback"] if result is not None else "\n".join(other[-20:])
  raise RuntimeError(f"the planning process failed (exit status {child.returncode}):\n{why}")


def child_env(environ: Mapping[str, str]) -> dict[str, str]:
  """``environ`` with this process's import path, so a ``package.module:function`` model the caller can
  import, a child process of the planner's can too."""
  path = [os.getcwd() if entry == "" else entry for entry in sys.path]
  return {**environ, "PYTHONPATH": os.pathsep.join(path)}


def say(message: Any) -> None:
  """A child process's answer, on a line of its own that starts with :data:`MARK`."""
  print(MARK + json.dumps(message), flush=True)


def main() -> int:
  """The planning process: the request from stdin, the progress and the plan (or the error) to stdout."""
  from nnx_zero1_plan.run import make_plan

  try:
    request = PlanRequest.from_json(sys.stdin.read())
    result = make_plan(request, progress=lambda line: say({"progress": line}), local="--local" in sys.argv)
  except Exception as e:  # every failure goes back to the caller, who raises it
    say({"error": {"type": type(e).__name__, "message": str(e), "traceback": traceback.format_exc()}})
    return 1
  say({"plan": result.to_record()})
  return 0


if __name__ == "__main__":
  sys.exit(main())
