"""The planner's child processes, one entry point that nothing imports, started by
:func:`nnx_zero1_plan.child.run_worker`: ``python -m nnx_zero1_plan.worker plan [--local] [--measure]``, the
planning process (``--local``: for this machine's chips; ``--measure``: the rows' programs run there), or
``probe``, the devices jax sees here."""

from __future__ import annotations

import dataclasses
import json
import sys
import traceback
from collections.abc import Sequence

import jax

from nnx_zero1_plan.child import say
from nnx_zero1_plan.local_chips import LocalDevices
from nnx_zero1_plan.request import PlanRequest
from nnx_zero1_plan.run import make_plan


def plan(flags: Sequence[str]) -> int:
  """The planning process: the request from stdin, the progress and the plan (or the error) to stdout."""
  try:
    request = PlanRequest.from_json(json.loads(sys.stdin.read()))
    result = make_plan(request, progress=lambda line: say({"progress": line}), local="--local" in flags,
                       measure="--measure" in flags)
  except Exception as e:  # every failure goes back to the caller, who raises it
    say({"error": {"type": type(e).__name__, "message": str(e), "traceback": traceback.format_exc()}})
    return 1
  say({"plan": result.to_json()})
  return 0


def probe() -> int:
  """The devices jax sees on this machine, on one answer line."""
  say(dataclasses.asdict(LocalDevices.of(jax.devices())))
  return 0


if __name__ == "__main__":
  verb, *rest = sys.argv[1:]
  sys.exit(plan(rest) if verb == "plan" else probe())
