"""A program's step time calibrated on the chip: each instruction the cost model prices, with its kind of
work (:func:`read_program`); a calibration made from one profiled run of it (:func:`calibrate`); any other
program of that model walked with each kind at its ratio (:func:`calibrated_time`). The TPU compiler prices
a fusion by the tiling it chose, so the walk parts from the chip by kind of work. A calibration carries two
more figures of its run: the rest (the device's seconds beyond the calibrated walk: the gaps between
instructions, those without cycles) as a share of the calibrated compute, and the launch (the step's wall
time beyond the device's: the host's fixed cost). Collectives and host copies are walked at the chip table's
rates, beside the calibrated compute.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from nnx_zero1_plan.calibration import Calibration, Run, summed_kinds
from nnx_zero1_plan.program_record import ProgramRecord
from nnx_zero1_plan.step_time import NOT_ESTIMATED, Rates, program_time


@dataclasses.dataclass(frozen=True)
class PricedProgram:
  """A compiled program priced: its record, its rates, each instruction the walk prices (name: kind, walked
  seconds per run, runs per call) and whether a collective or host copy runs beside the core."""

  record: ProgramRecord
  rates: Rates
  priced: Mapping[str, tuple[str, float, int]]
  overlapped: bool


def read_program(program: ProgramRecord | str, rates: Rates) -> PricedProgram:
  """A program's record (or its text, read here) priced as :func:`~nnx_zero1_plan.step_time.program_time`
  walks it: each computation as often as it runs, each priced instruction at its class's clock, its kind."""
  record = ProgramRecord.of(program)
  priced: dict[str, tuple[str, float, int]] = {}
  overlapped = False
  for i, runs in ((i, runs) for name, runs in record.runs.items() for i in record.computations[name]):
    if i.op.endswith("-done") or i.op in ("while", "call", "conditional"):
      continue  # a transfer's end is the walk's wait; a callee's instructions are its own computation's
    if i.collective or i.host:
      overlapped = True
    elif i.cycles is not None and i.cycles < NOT_ESTIMATED and rates.clock_hz is not None:
      clock = (rates.class_clocks_hz or {}).get(i.work or "", rates.clock_hz)
      priced[i.name] = (i.kind or "", i.cycles / clock, runs)
  return PricedProgram(record, rates, priced, overlapped)


def _walk(program: PricedProgram, calibration: Calibration) -> tuple[float, float]:
  """(total, compute) seconds of one call of the program walked with each priced instruction at its kind's
  ratio; with nothing beside the core, the walk is the sum (the same figure, without walking)."""
  scaled = {name: seconds * calibration.ratio(kind) for name, (kind, seconds, _) in program.priced.items()}
  if not program.overlapped:
    compute = sum(scaled[name] * runs for name, (_, _, runs) in program.priced.items())
    return compute, compute
  walk = program_time(program.record, program.rates, estimates=scaled)
  return walk.total_s, walk.compute_s or 0.0


def calibrate(program: PricedProgram, profile: Mapping[str, Any], *, lever: str, micro_batch: int, ga: int,
              seq_len: int, step_s: float, chip: str, jax: str, libtpu: str | None) -> Calibration:
  """A calibration from one run: each kind's chip seconds over the walk's, the rest and the launch.

  Args:
    program: the profiled program (:func:`read_program`).
    profile: ``{"ops": {name: [ns, count]}, "modules": {name: [ns, count]}}`` per step, of the step's runs
      alone (:func:`nnx_zero1_plan.on_chip.device_ops`).
    lever, micro_batch, ga, seq_len: the plan row it ran.
    step_s: the step's measured wall seconds (a median of steady steps).
    chip, jax, libtpu: the chip table's name and the versions it ran with.

  Returns:
    The :class:`Calibration`. Each instruction is compared per run (the profile's nanoseconds over its
    count, times the walk's runs: a loop's trips are the walk's on both sides); one the profile never saw
    is left out of its kind, and its walked seconds out of the rest.
  """
  ops = profile["ops"]
  kinds = summed_kinds((kind, seconds * runs, ops[name][0] / 1e9 / ops[name][1] * runs)
                  for name, (kind, seconds, runs) in program.priced.items() if ops.get(name, (0, 0))[1])
  device_s = sum(ns for ns, _ in profile["modules"].values()) / 1e9
  made = Calibration(chip, jax, libtpu, (), kinds)
  total_s, compute_s = _walk(program, made)
  run = Run(lever, micro_batch, ga, seq_len, step_s, device_s, compute_s, device_s - total_s)
  return dataclasses.replace(made, runs=(run,))


def calibrated_time(programs: Sequence[tuple[PricedProgram, int]], calibration: Calibration) -> float:
  """One step's calibrated seconds on the chip: each program's calibrated walk (and its rest) as many times as
  the step runs it, and the step's launch once.

  Example::

    >>> from nnx_zero1_plan.step_time import Rates
    >>> hlo = '''ENTRY %main (p: f32[8]) -> f32[8] {
    ...   ROOT %f = f32[8]{0} fusion(%p), calls=%g, backend_config={"estimated_cycles":"1000"}
    ... }'''
    >>> program = read_program(hlo, Rates(clock_hz=1e9, network_bytes_per_s=lambda n: 1e9))
    >>> profile = {"ops": {"f": [500.0, 1]}, "modules": {"jit_step": [600.0, 1]}}
    >>> c = calibrate(program, profile, lever="baseline", micro_batch=8, ga=1, seq_len=1024, step_s=2e-6,
    ...               chip="v5e", jax="0.10.2", libtpu=None)
    >>> c.ratio("vector"), round(calibrated_time([(program, 1)], c) * 1e6, 6)
    (0.5, 2.0)
  """
  total = 0.0
  for program, times in programs:
    walk_s, compute_s = _walk(program, calibration)
    total += times * (walk_s + calibration.rest_share * compute_s)
  return total + calibration.launch_s
