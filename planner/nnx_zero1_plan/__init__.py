"""Will it fit? ``plan()``: a training step compiled for TPUs or NVIDIA GPUs, never run.

Its own distribution, ``nnx-zero1-plan`` (``pip install ./planner``; the compilers' install lines: README.md).
Each lever's step, one program or two (``--steps``), is compiled by the target's real compiler (libtpu for
TPUs, XLA's GPU compiler deviceless for NVIDIA GPUs) on a machine with neither, and read for its per-device
memory and collectives against the memory the compiler says a program may use. The models it takes are
:mod:`nnx_zero1_plan.models`'s, its settings :class:`PlanRequest`'s.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from nnx_zero1_plan.cells import collective_cell
from nnx_zero1_plan.child import plan_in_child
from nnx_zero1_plan.chips import CHIPS, chip_of
from nnx_zero1_plan.cli import main, parse_args, request_of
from nnx_zero1_plan.compilers import AotUnavailable, require_libtpu, start_cpu_jax
from nnx_zero1_plan.gpu_chips import GPU_CHIPS
from nnx_zero1_plan.inputs import ONE_SLICE, PlanError, parse_topology
from nnx_zero1_plan.levers import LEVERS, Lever
from nnx_zero1_plan.request import PlanRequest
from nnx_zero1_plan.result import Plan
from nnx_zero1_plan.row import Row
from nnx_zero1_plan.settings import PlanSettings

# The steps the planner compiles and what it reads from them, for a loop of your own (and the benchmarks):
# each imported from its module when first asked for, as those modules import jax and plan()'s caller never
# does. Documented in docs/planner.md ("Your own loop").
_ON_FIRST_USE = {name: module for module, names in {
    "steps": ("OPTIMIZERS", "make_optimizer", "lever_state", "placed_state", "placed_batch", "run_steps",
              "StepRuns", "abstract_batch", "step_jit", "compile_step", "compile_split"),
    "on_chip": ("profiled", "device_ops"),
    "abstract": ("AbstractState", "with_state_homes", "abstract_bytes_per_device", "bytes_by_memory_kind"),
    "compiled": ("memory", "split_memory", "summed", "hbm_oom"),
    "step_time": ("predict_step_time", "program_time", "Rates", "cycle_class"),
    "gpu_schedule": ("dump_options", "scheduled_seconds"),
    "program_record": ("ProgramRecord",),
    "models": ("model_source",),
}.items() for name in names}

# The same API's pure names (the chip table, a collectives' table cell, libtpu's version) are imported above.
__all__ = ["Plan", "Row", "PlanSettings", "PlanError", "PlanRequest", "AotUnavailable", "plan", "parse_args",
           "request_of", "main", "compile_only_devices", "LEVERS", "Lever", "start_cpu_jax", "CHIPS",
           "chip_of", "collective_cell", "require_libtpu", *_ON_FIRST_USE]


def __getattr__(name: str) -> Any:
  """A name of the compiled steps' API, imported from its module when first asked for."""
  module = _ON_FIRST_USE.get(name)
  if module is None:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def compile_only_devices(topology: str, slices: int = ONE_SLICE) -> tuple[Any, ...]:
  """``topology``'s chips (as ``--topology`` and ``--slices`` name them), which compile but never run, in
  the order the printed code's mesh lays them out: a plan's printed code, its ``jax.devices()`` made
  ``compile_only_devices(...)``, compiles to the figures the plan gave.

  Makes this process a planning process (jax on its CPU backend, the compilers' environment set): call it
  before jax starts any other backend.

  Raises:
    PlanError: an unknown topology.
    AotUnavailable: its compiler is not installed (the message says what to install).
    RuntimeError: a backend other than jax's CPU one has started in this process already.

  Example::

    from nnx_zero1_plan import compile_only_devices
    devices = compile_only_devices("v5e:2x4", slices=2)   # 16 TPU v5e chips, compile only
    mesh = jax.make_mesh((2, 8), ("replica", "data"), (AxisType.Auto,) * 2, devices=devices)
  """
  from nnx_zero1_plan.targets import make_target, require_compiler

  parsed = parse_topology(topology, GPU_CHIPS)
  require_compiler(parsed.backend)
  start_cpu_jax()
  return make_target(topology, slices=slices, parsed=parsed).devices


def plan(model: str | PlanRequest, topology: str | None = None, *,
         progress: Callable[[str], None] | None = None, **settings: Any) -> Plan:
  """Compiles each lever's training step for ``topology`` and says what it needs per device: the
  :class:`Plan` (``str()`` is the table). ``model`` and ``topology`` are :class:`PlanRequest`'s, ``settings``
  its other fields by name, or ``model`` a whole :class:`PlanRequest`; ``progress`` is called with a line
  as each compile starts and ends.

  The compiles run in a planning process of its own: the caller's process (a notebook's, a trainer's)
  keeps its environment, its devices and its jax backends, and no file is written unless the caller
  writes the plan (:meth:`Plan.write`).

  Raises:
    PlanError: an unknown model, topology, lever, optimizer or mesh axis, a mesh that does not match,
      or a lever that cannot apply to the model (``zero1-master`` on float32 parameters).
    AotUnavailable: the target's compiler is not installed (the message says what to install).
    TypeError: a setting :class:`PlanRequest` does not have.

  Example::

    result = plan("tunix:qwen3_0p6b", "v6e:2x2", param_dtype="bfloat16", compute_dtype="bfloat16")
    print(result)                      # one row per lever
    result.rows[1].verdict             # peak bytes per device <= what the compiler says is usable
  """
  if isinstance(model, PlanRequest):
    if topology is not None or settings:
      raise TypeError("plan(request) takes the request's own settings; pass nothing else but progress")
    return plan_in_child(model, progress)
  if topology is None:
    raise TypeError("plan() needs a topology, e.g. plan('tunix:qwen3_0p6b', 'v6e:2x2')")
  return plan_in_child(PlanRequest(model, topology, **settings), progress)
