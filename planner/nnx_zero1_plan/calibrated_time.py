"""A program's step time calibrated on the chip: its priced instructions read once with their kind of work
(:func:`read_program`), a calibration made from one profiled run (:func:`calibrate`), and any program of that
model walked with each kind at its ratio, plus the run's rest and launch (:func:`calibrated_step`).
Collectives and host copies are walked at the chip table's rates beside it (docs/accuracy.md)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from nnx_zero1_plan.calibration import Calibration, Run, summed_kinds
from nnx_zero1_plan.program_record import ProgramRecord, kind_of
from nnx_zero1_plan.step_time import Rates, collective_seconds, compute_seconds, program_time


@dataclasses.dataclass(frozen=True)
class PricedProgram:
  """A compiled program priced: its record, its rates, each instruction the walk prices (name: kind, walked
  seconds per run, runs per call) and whether a collective or host copy runs beside the core."""

  record: ProgramRecord
  rates: Rates
  priced: Mapping[str, tuple[str, float, int]]
  overlapped: bool
  # Each collective as priced (name: kind, walked seconds per run, runs per call), and an async one's -done.
  collectives: Mapping[str, tuple[str, float, int]] = dataclasses.field(default_factory=dict)
  dones: Mapping[str, str] = dataclasses.field(default_factory=dict)


def read_program(program: ProgramRecord | str, rates: Rates) -> PricedProgram:
  """A program's record (or its text, read here) priced as :func:`~nnx_zero1_plan.step_time.program_time`
  walks it: each computation as often as it runs, each priced instruction at its class's clock (a GPU's at
  its scheduler's estimate), its kind."""
  record = ProgramRecord.of(program)
  priced: dict[str, tuple[str, float, int]] = {}
  collectives: dict[str, tuple[str, float, int]] = {}
  dones: dict[str, str] = {}
  overlapped = False
  kind, estimates = kind_of(record), record.estimates
  for i, runs in ((i, runs) for name, runs in record.runs.items() for i in record.computations[name]):
    if i.op.endswith("-done"):
      dones[i.args.split(",")[0].strip().lstrip("%")] = i.name
    if i.op.endswith("-done") or i.op in ("while", "call", "conditional"):
      continue  # a transfer's end is the walk's wait; a callee's instructions are its own computation's
    if i.collective and (seconds := collective_seconds(i, rates, record.devices)):
      collectives[i.name] = (i.collective.op, seconds, runs)
    if i.collective or i.host:
      overlapped = True
    elif (i.name in estimates if estimates is not None else i.cycles is not None and rates.clock_hz) and (
        walked := compute_seconds(i, rates, estimates)) is not None:
      priced[i.name] = (i.kind or kind(i), walked, runs)
  return PricedProgram(record, rates, priced, overlapped, collectives, dones)


def _walk(program: PricedProgram, calibration: Calibration, topology: str | None = None
          ) -> tuple[float, float, float]:
  """(total, compute, exposed collectives) seconds of one call of the program walked with each priced
  instruction at its kind's ratio, and each collective at its kind's where ``topology`` is the slice the
  calibration timed them on; with nothing beside the core, the walk is the sum (without walking)."""
  scaled = {name: seconds * calibration.ratio(kind) for name, (kind, seconds, _) in program.priced.items()}
  if not program.overlapped:
    compute = sum(scaled[name] * runs for name, (_, _, runs) in program.priced.items())
    return compute, compute, 0.0
  own, timed = program.rates, calibration.collectives_on(topology or "")
  ratio = lambda kind: timed[kind].ratio if kind in timed else 1.0
  rates = dataclasses.replace(own, collective_s=lambda kind, *at: own.collective_s(kind, *at) * ratio(kind)
                              ) if timed else own
  walk = program_time(program.record, rates, estimates=scaled)
  return walk.total_s, walk.compute_s or 0.0, walk.exposed_collective_s


def calibrate(program: PricedProgram, profile: Mapping[str, Any], *, lever: str, micro_batch: int, ga: int,
              seq_len: int, step_s: float, chip: str, jax: str, libtpu: str | None,
              topology: str | None = None) -> Calibration:
  """A calibration from one run of ``program`` (the plan row ``lever``, ``micro_batch``, ``ga``,
  ``seq_len``): each kind's chip seconds over the walk's, the rest and the launch; on a slice of more than one
  chip (``topology``), each kind of collective's too. Each instruction is compared per run (the ``profile``'s
  nanoseconds over its count, :func:`nnx_zero1_plan.on_chip.device_ops`); one the profile never saw is left
  out. A collective's chip seconds are its instruction's and an async one's ``-done`` (what the core spent on
  it: one overlapped reads short, as it costs the step little). ``step_s`` is the step's measured wall time.
  """
  ops = profile["ops"]
  per_run = lambda name, runs: ops[name][0] / 1e9 / ops[name][1] * runs if ops.get(name, (0, 0))[1] else 0.0
  kinds = summed_kinds((kind, seconds * runs, per_run(name, runs))
                       for name, (kind, seconds, runs) in program.priced.items() if per_run(name, runs))
  collectives = summed_kinds(
      (kind, seconds * runs, per_run(name, runs) + per_run(program.dones.get(name, ""), runs))
      for name, (kind, seconds, runs) in program.collectives.items() if per_run(name, runs))
  device_s = sum(ns for ns, _ in profile["modules"].values()) / 1e9
  made = Calibration(chip, jax, libtpu, (), kinds, collectives or None, topology if collectives else None)
  total_s, compute_s, _ = _walk(program, made, topology)
  run = Run(lever, micro_batch, ga, seq_len, step_s, device_s, compute_s, device_s - total_s)
  return dataclasses.replace(made, runs=(run,))


def calibrated_step(programs: Sequence[tuple[PricedProgram, int]], calibration: Calibration,
                    topology: str | None = None) -> tuple[float, float]:
  """One step's calibrated seconds on the chip (each program's calibrated walk and its rest as many times as
  the step runs it, and the step's launch once), and the collectives' exposed part of it (each kind at its
  ratio where ``topology`` is the slice the calibration timed them on)."""
  total = exposed = 0.0
  for program, times in programs:
    walk_s, compute_s, collective_s = _walk(program, calibration, topology)
    total += times * (walk_s + calibration.rest_share * compute_s)
    exposed += times * collective_s
  return total + calibration.launch_s, exposed

