"""The caller's side of a plan where the target's chips are this machine's (``v5e:1x1`` on a one-chip v5e):
jax asked in a child process which devices are here, and the plan made for them (:func:`plan_here`)."""

from __future__ import annotations

import os
from collections.abc import Callable

from nnx_zero1_plan import compilers
from nnx_zero1_plan.child import child_env, plan_in_child, run_worker
from nnx_zero1_plan.inputs import PlanError
from nnx_zero1_plan.local_chips import LocalDevices, chips_may_be_here, not_the_target
from nnx_zero1_plan.request import PlanRequest
from nnx_zero1_plan.result import Plan


def local_devices() -> LocalDevices | None:
  """The devices jax sees on this machine, asked in a child process (this one keeps its own jax, and
  leaves the chips free); None where the child could not say."""
  compilers.clear_stale_lockfile()  # a killed run's lockfile would stop the next process that opens the TPU
  answer = run_worker("probe", None, child_env(os.environ), timeout=180)
  return None if answer.message is None else LocalDevices(**answer.message)


def devices_for(request: PlanRequest, measure: bool = False) -> LocalDevices | None:
  """This machine's devices where they are the request's target's chips (jax asked with ``measure``, or where
  their device files are); None where they are not. :class:`PlanError` for ``--measure`` where they are
  not, or of a ``maxtext:`` model (its steps run in MaxText's engine)."""
  if measure and request.model_ref.kind.engine:
    raise PlanError("--measure runs the planner's own step; a maxtext: model's runs in MaxText's engine "
                    "(time it with MaxText's train)")
  local = local_devices() if measure or chips_may_be_here(request.backend) else None
  why = not_the_target(local, request.topology, request.topology_ref, request.slices)
  if why and measure:
    raise PlanError(f"--measure runs each row's step on this machine's devices, which must be the target's: "
                    f"{why}")
  return None if why else local


def plan_here(request: PlanRequest, progress: Callable[[str], None] | None = None,
              measure: bool = False) -> Plan:
  """The plan made where the target's chips are this machine's (:func:`devices_for`): a TPU's compiled for
  them (a GPU's deviceless, as anywhere, unless ``measure``) and, with ``measure``, the rows' programs run on
  them as they were compiled (:mod:`nnx_zero1_plan.on_chip`)."""
  return plan_in_child(request, progress, local=request.backend.compiles_on_chips or measure, measure=measure)
