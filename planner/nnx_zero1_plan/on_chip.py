"""``--measure``: a row's program, compiled by the plan for this process's chips, run there as it was compiled
(never compiled again, so the program timed is the program priced): its state built and placed, a few steps
timed, the first run also profiled instruction by instruction for the plan's calibration."""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import tempfile
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh

from nnx_zero1_plan.abstract import AbstractState
from nnx_zero1_plan.calibration import Calibration
from nnx_zero1_plan.inputs import error_line
from nnx_zero1_plan.levers import Lever
from nnx_zero1_plan.program_record import ProgramRecord
from nnx_zero1_plan.row import Measured, Row
from nnx_zero1_plan.steps import StepShape, placed_batch, placed_state, run_steps

WARMUP, TIMED = 2, 8  # steps run first (the allocator's growth, the program's load), then the steps counted
PROFILED = 3  # steps profiled after them, for a calibration

_NAME = re.compile(r"^%?([^\s=]+)")


@dataclasses.dataclass(frozen=True)
class Program:
  """A row's compiled one-program step (``(state, batch) -> (state, loss)``, the state donated), kept for its
  run with what it was compiled for and its text read once (what its figures and calibrations are read
  from)."""

  compiled: Any
  compile_s: float
  lever: Lever
  build: Callable[[], Any]
  mesh: Mesh
  state: AbstractState
  shape: StepShape
  record: ProgramRecord


class Kept:
  """What a plan keeps as it compiles for ``--measure``, added to as its rows compile: each one-program step
  compiled whole (by lever, model and shape: its run, and a second row of it, read it back) and the
  calibrations its runs made."""

  def __init__(self) -> None:
    self.programs: dict[tuple[str, int, StepShape], Program] = {}
    self.profiled: list[Calibration] = []


def measured_batches(row: Row) -> tuple[int, ...]:
  """The micro-batches ``--measure`` runs a row at: its own where it fits, and the largest a search found
  (none for a two-program step, which the planner's runner does not run, or an estimate)."""
  if row.step != "one" or row.estimated:
    return ()
  batches = [row.batch] if row.verdict else []
  largest = row.searched.max_micro_batch if row.searched is not None else None
  return tuple(batches + ([largest] if largest and largest not in batches else []))


def run_program(program: Program, profile: bool = False) -> tuple[Measured, dict[str, Any] | None]:
  """``program`` run on the devices it was compiled for: ``WARMUP + TIMED`` steps, the median of the timed
  ones, and with ``profile`` :data:`PROFILED` more under the profiler (None: not asked, or the steps did not
  run). A refusal (the allocator's, placing the state or running) is the answer, not raised."""
  shape = program.shape
  try:
    _, state = placed_state(program.lever, program.build, shape.optimizer, program.mesh, program.state)
    tokens = placed_batch(program.lever, program.mesh, shape.batch, shape.seq_len, shape.ga)
  except (jax.errors.JaxRuntimeError, ValueError) as e:  # the state does not fit beside what is held
    return Measured(shape.batch, None, error=error_line(e)), None
  state, runs = run_steps(program.compiled, state, tokens, warmup=WARMUP, timed=TIMED)
  ops = None
  if profile and runs.error is None:
    def step() -> Any:  # the state is donated: each call takes the last one's
      nonlocal state
      state, loss = program.compiled(state, tokens)
      return loss

    ops = profiled(step, PROFILED)
  del state  # its memory back before the next run
  return Measured(shape.batch, runs.step_s, runs.held_bytes, runs.error), ops


def device_ops(xplane: str, runs: int) -> dict[str, Any]:
  """Each instruction's time on the first device per run, from a profile (``jax.profiler.trace``'s
  ``*.xplane.pb``): ``{"ops": {name: [ns, count]}, "modules": {name: [ns, count]}}``, each summed over the
  profile and divided by ``runs``."""
  from jax.profiler import ProfileData

  found: dict[str, dict[str, list[float]]] = {"ops": {}, "modules": {}}
  data = ProfileData.from_file(xplane)
  plane = next((p for p in data.planes if p.name.startswith("/device:") and p.name.endswith(":0")), None)
  for line in plane.lines if plane is not None else ():
    key = {"XLA Ops": "ops", "XLA Modules": "modules"}.get(line.name)
    into = found[key] if key else {}
    for event in line.events if key else ():
      name = _NAME.match(event.name)[1]  # type: ignore[index]  # an op's event is named by its whole line
      ns, count = into.setdefault(name, [0.0, 0])
      into[name] = [ns + event.duration_ns / runs, count + 1 / runs]
  return found


def profiled(call: Callable[[], Any], runs: int) -> dict[str, Any]:
  """:func:`device_ops` of ``runs`` calls of ``call`` (each returns what to wait for), traced together."""
  with tempfile.TemporaryDirectory() as trace:
    with jax.profiler.trace(trace):
      for _ in range(runs):
        out = call()
      jax.block_until_ready(out)
    found = glob.glob(os.path.join(trace, "**", "*.xplane.pb"), recursive=True)
    return device_ops(found[0], runs) if found else {"ops": {}, "modules": {}}
