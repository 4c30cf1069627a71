"""``python -m nnx_zero1.plan``: the planner's command line, from its own distribution.

The planner (``nnx-zero1-plan``, ``pip install ./planner`` from a clone) compiles a training
step for TPUs and NVIDIA GPUs on a machine with neither; this module forwards to it, so the
command and ``from nnx_zero1.plan import plan`` keep working once it is installed.
"""

import sys

INSTALL = 'pip install ./planner (from a clone of nnx-zero1; "./planner[aot]" adds the TPU compiler)'

try:
  from nnx_zero1_plan import AotUnavailable, Plan, PlanError, main, parse_args, plan
except ModuleNotFoundError as e:
  if e.name != "nnx_zero1_plan":
    raise
  if __name__ != "__main__":
    raise ModuleNotFoundError(f"nnx_zero1.plan needs the planner: {INSTALL}", name=e.name) from e
  print(f"nnx_zero1.plan: the planner is not installed: {INSTALL}", file=sys.stderr)
  sys.exit(2)

__all__ = ["Plan", "PlanError", "AotUnavailable", "plan", "parse_args", "main"]

if __name__ == "__main__":
  sys.exit(main())
