"""``--measure``'s part of a plan, where the target's chips are this process's: the first fitting row's
program run and profiled before the rest are compiled, for the calibration every row is then also priced
by, and after the plan each fitting row's programs (and the recommended point) run as they were compiled."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import jax

from nnx_zero1_plan import compilers
from nnx_zero1_plan.calibrated_time import calibrate, read_program
from nnx_zero1_plan.calibration import Calibration
from nnx_zero1_plan.chips import CHIPS
from nnx_zero1_plan.levers import LEVERS
from nnx_zero1_plan.measure import RowCompiler, StepShape
from nnx_zero1_plan.on_chip import TIMED, WARMUP, measured_batches, run_program
from nnx_zero1_plan.planned_model import PlannedModel
from nnx_zero1_plan.recommend import Recommendation
from nnx_zero1_plan.request import PlanRequest
from nnx_zero1_plan.row import Measured, Row
from nnx_zero1_plan.step_time import rates_for

__all__ = ["first_calibration", "measured_rows", "said_measured"]


def first_calibration(compiler: RowCompiler, rows: Sequence[tuple[str | None, str]],
                      row_of: Callable[[str | None, str], Row], plans: Mapping[str | None, PlannedModel],
                      request: PlanRequest) -> Calibration | None:
  """This chip's calibration from the first of ``rows`` (``(remat policy, lever)``, in the plan's order) whose
  one-program step fits: ``row_of`` makes its row as the plan does (its programs kept: the plan does not
  compile them again), and its own program is run and profiled (:func:`~nnx_zero1_plan.on_chip.
  run_program`); None where none fits or runs, and off a TPU."""
  say = compiler.progress or (lambda line: None)
  if compiler.target.platform != "tpu":  # a calibration is of the TPU compiler's cycles
    return None
  for policy, lever in rows:
    if LEVERS[lever].picks_offload:  # its share of the state is searched, not given
      continue
    row = row_of(policy, lever)
    ga = row.ga or request.ga
    shape = StepShape(row.batch, request.seq_len, ga, request.optimizer)
    program = compiler.program(lever, plans[policy], shape)
    if not row.verdict or program is None:
      continue
    at = f"{lever} (one) at micro-batch {row.batch} x GA {ga}"
    say(f"profiling {at}: {WARMUP} + {TIMED} steps, then a profile ...")
    run, ops = run_program(program, profile=True)
    if ops is None or run.step_s is None:
      say(f"profiled {at}: {run.error or 'no profile'}")
      continue
    chip = compiler.target.chip
    priced = read_program(program.compiled.as_text(), rates_for(CHIPS[chip]))
    calibration = calibrate(priced, ops, lever=lever, micro_batch=row.batch, ga=ga, seq_len=request.seq_len,
                            step_s=run.step_s, chip=chip, jax=jax.__version__,
                            libtpu=compilers.require_libtpu())
    say(f"calibrated on {at}: {run.step_s * 1e3:,.1f} ms measured")
    return calibration
  return None


def measured_rows(compiler: RowCompiler, plans: Mapping[str | None, PlannedModel], request: PlanRequest,
                  rows: Sequence[Row], recommended: Recommendation | None) -> list[Row]:
  """``rows`` with their runs on this process's chips: each row's kept program at each of its
  :func:`~nnx_zero1_plan.on_chip.measured_batches` and, for the recommended row, the recommended
  micro-batch, run as it was compiled (:func:`~nnx_zero1_plan.on_chip.run_program`)."""
  say: Callable[[str], None] = compiler.progress or (lambda line: None)
  done = []
  for row in rows:
    batches = list(measured_batches(row))
    if recommended and _is_recommended(row, recommended) and recommended.micro_batch not in batches:
      batches.append(recommended.micro_batch)
    runs = []
    for batch in batches:
      fraction = row.offloaded.offload_fraction if row.offloaded else 0.0
      shape = StepShape(batch, request.seq_len, row.ga or request.ga, request.optimizer, fraction)
      program = compiler.program(row.lever, plans[row.remat], shape)
      if program is None:
        runs.append(Measured(batch, None, error="not compiled whole for this machine's chips"))
        continue
      say(f"running {row.lever} ({row.step}) at micro-batch {batch}: {WARMUP} + {TIMED} steps ...")
      run, _ = run_program(program)
      said = run.error or f"{(run.step_s or 0.0) * 1e3:,.1f} ms, the median of {TIMED}"
      say(f"ran {row.lever} ({row.step}) at micro-batch {batch}: {said}")
      runs.append(run)
    done.append(dataclasses.replace(row, measured=tuple(runs)) if runs else row)
  return done


def _is_recommended(row: Row, recommended: Recommendation) -> bool:
  return (row.lever, row.step, row.remat) == (recommended.lever, recommended.step, recommended.remat)


def said_measured(recommended: Recommendation, rows: Sequence[Row]) -> Recommendation:
  """``recommended`` with a note of its run on this machine's chips, where it ran."""
  seconds = next((m.step_s for r in rows if _is_recommended(r, recommended)
                  for m in r.measured or () if m.batch == recommended.micro_batch and m.step_s), None)
  if seconds is None:
    return recommended
  note = f"measured on this machine's chips: {seconds * 1e3:,.1f} ms a step (the median of {TIMED})"
  return dataclasses.replace(recommended, notes=(*recommended.notes, note))
