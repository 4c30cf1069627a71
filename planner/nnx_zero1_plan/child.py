"""The parent's side of the planner's child processes (:mod:`nnx_zero1_plan.worker` is theirs). A plan is made
in a child process: the compilers need one prepared for them (:data:`nnx_zero1_plan.compilers.ENV`), the
caller's process must stay as it was, its GPUs visible, and one process at a time may hold a TPU."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from nnx_zero1_plan import compilers
from nnx_zero1_plan.inputs import PlanError
from nnx_zero1_plan.request import PlanRequest
from nnx_zero1_plan.result import Plan

MARK = "nnx_zero1_plan.child:"  # starts every line of a child process's answers on its stdout
_ERRORS = {"PlanError": PlanError, "AotUnavailable": compilers.AotUnavailable}


@dataclasses.dataclass(frozen=True)
class Answer:
  """What a child process said: its last answer (None: none came) and the last lines of its other output."""

  message: dict[str, Any] | None
  other: tuple[str, ...]
  returncode: int | None


def run_worker(verb: str, job: str | None, env: Mapping[str, str], *, flags: Sequence[str] = (),
               progress: Callable[[str], None] | None = None, timeout: float | None = None) -> Answer:
  """Runs ``python -m nnx_zero1_plan.worker VERB FLAGS`` with ``job`` on its stdin (killed after ``timeout``
  seconds), each ``{"progress": line}`` answer to ``progress`` as it comes; the last other answer."""
  command = [sys.executable, "-m", "nnx_zero1_plan.worker", verb, *flags]
  other: list[str] = []
  message = None
  with subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        env=dict(env), text=True) as child:
    assert child.stdin is not None and child.stdout is not None  # both are pipes
    killer = threading.Timer(timeout, child.kill) if timeout else None
    if killer:
      killer.start()
    child.stdin.write(job or "")
    child.stdin.close()
    for line in child.stdout:
      if not line.startswith(MARK):
        other.append(line.rstrip("\n"))
        continue
      said = json.loads(line[len(MARK):])
      if "progress" not in said:
        message = said
      elif progress:
        progress(said["progress"])
    child.wait()
    if killer:
      killer.cancel()
  if message is None and killer is not None and child.returncode and child.returncode < 0:
    other.append(f"no answer in {timeout:.0f} s")
  return Answer(message, tuple(line for line in other if line.strip())[-20:], child.returncode)


def plan_in_child(request: PlanRequest, progress: Callable[[str], None] | None = None,
                  local: bool = False, measure: bool = False) -> Plan:
  """The :class:`Plan` of ``request``, made in a planning process (this process's environment, files and jax
  left alone): with ``local``, for this machine's own devices, the target's chips (the planning process
  keeps the caller's environment, its chips visible), and with ``measure`` the rows' programs run there too.
  Its ``PlanError`` or ``AotUnavailable`` is raised here; any other failure as a ``RuntimeError`` with its
  last lines of output."""
  own = compilers.planning_environment(os.environ)  # a stale libtpu lockfile removed too
  flags = [*(["--local"] if local else []), *(["--measure"] if measure else [])]
  answer = run_worker("plan", json.dumps(request.to_json()), child_env(os.environ if local else own),
                      flags=flags, progress=progress)
  result = answer.message
  if result is not None and "plan" in result:
    return Plan.from_json(result["plan"])
  if result is not None and result["error"]["type"] in _ERRORS:
    raise _ERRORS[result["error"]["type"]](result["error"]["message"])
  why = result["error"]["traceback"] if result is not None else "\n".join(answer.other)
  raise RuntimeError(f"the planning process failed (exit status {answer.returncode}):\n{why}")


def child_env(environ: Mapping[str, str]) -> dict[str, str]:
  """``environ`` with this process's import path, so a ``package.module:function`` model the caller can
  import, a child process of the planner's can too."""
  path = [os.getcwd() if entry == "" else entry for entry in sys.path]
  return {**environ, "PYTHONPATH": os.pathsep.join(path)}


def say(message: Any) -> None:
  """A child process's answer, on a line of its own that starts with :data:`MARK`, for :func:`run_worker`."""
  print(MARK + json.dumps(message), flush=True)
