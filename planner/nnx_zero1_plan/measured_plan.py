"""``--measure``'s part of a plan, where the target's chips are this process's: the first fitting row of each
build run and profiled as it is compiled, for the calibration the rows built as it is are priced by, and
after the plan each fitting row's programs (and the recommended point) run as they were compiled."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import jax

from nnx_zero1_plan import compilers
from nnx_zero1_plan.calibrated_time import calibrate, read_program
from nnx_zero1_plan.calibration import Calibration
from nnx_zero1_plan.cells import ms
from nnx_zero1_plan.chips import CHIPS
from nnx_zero1_plan.on_chip import TIMED, WARMUP, Program, measured_batches, run_program
from nnx_zero1_plan.planned_model import PlannedModel
from nnx_zero1_plan.recommend import Recommendation
from nnx_zero1_plan.request import PlanRequest
from nnx_zero1_plan.row import Figures, Measured, Point, Row
from nnx_zero1_plan.row_compiler import Profile, RowCompiler, StepShape, calibrated
from nnx_zero1_plan.step_time import rates_for
from nnx_zero1_plan.targets import Target


def profiler(target: Target, progress: Callable[[str], None] | None) -> Profile:
  """``--measure``'s profile of a row's kept program on this process's chips
  (:attr:`~nnx_zero1_plan.row_compiler.RowCompiler.profile`): a few steps run and profiled, the calibration
  of its build made of them; None where it did not run."""
  say = progress or (lambda line: None)

  def profile(lever: str, shape: StepShape, program: Program) -> Calibration | None:
    at = f"{lever} (one) at micro-batch {shape.batch} x GA {shape.ga}"
    say(f"profiling {at}: {WARMUP} + {TIMED} steps, then a profile ...")
    run, ops = run_program(program, profile=True)
    if ops is None or run.step_s is None:
      say(f"profiled {at}: {run.error or 'no profile'}")
      return None
    priced = read_program(program.record, rates_for(CHIPS[target.chip]))
    calibration = calibrate(priced, ops, lever=lever, micro_batch=shape.batch, ga=shape.ga,
                            seq_len=shape.seq_len, step_s=run.step_s, chip=target.chip, jax=jax.__version__,
                            libtpu=compilers.require_libtpu(), topology=target.name)
    say(f"calibrated on {at}: {ms(run.step_s)} ms measured")
    return calibration

  return profile


def measured_rows(compiler: RowCompiler, plans: Mapping[str | None, PlannedModel], request: PlanRequest,
                  rows: Sequence[Row], recommended: Recommendation | None) -> list[Row]:
  """``rows`` with their runs on this process's chips: each row's kept program at each of its
  :func:`~nnx_zero1_plan.on_chip.measured_batches` and, for the recommended row, the recommended
  micro-batch (a batch the row ran already, as a split of ``--global-batch``, not again)."""
  done = []
  for row in rows:
    batches = list(measured_batches(row))
    if recommended and _is_recommended(row, recommended) and recommended.micro_batch not in batches:
      batches.append(recommended.micro_batch)
    ran = {m.batch: m for m in row.measured or ()}
    runs = [ran.get(b) or run_at(compiler, plans[row.remat], request, row, b) for b in batches]
    done.append(dataclasses.replace(row, measured=tuple(runs)) if runs else row)
  return done


def edge_profiled(compiler: RowCompiler, model: PlannedModel, request: PlanRequest, row: Row) -> Row:
  """``row`` with its search's largest micro-batch, which the compiler may fuse anew, run and profiled where
  ``--measure`` profiles (its run kept in ``measured``), and every point of the search whose program is kept
  priced again by its build's calibrations, that run among them; ``row`` as it is elsewhere."""
  found = row.searched
  edge = None if found is None else found.max_micro_batch
  if compiler.profile is None or found is None or found.at_max is None or edge in (None, row.batch):
    return row
  assert edge is not None
  shape = StepShape(edge, request.seq_len, row.ga or request.ga, request.optimizer)
  at = Figures(predicted_step_s=found.at_max.predicted_step_s, step_time=row.figures.step_time)
  done = compiler.priced_by_own_run(row.lever, model, shape, at)
  if done is None:
    return row
  made = done[1]
  own = lambda f: (f.calibrated_step_s, f.calibrated_collective_s)  # noqa: E731

  def again(point: Point) -> tuple[float | None, float | None]:
    if point.batch == edge:
      return own(done[0])
    program = compiler.program(row.lever, model, dataclasses.replace(shape, batch=point.batch))
    if program is None or point.calibrated_step_s is None:
      return own(point)
    figures = dataclasses.replace(at, predicted_step_s=point.predicted_step_s)
    return own(calibrated(figures, [(program.record, 1)], compiler, row.lever, shape.ga))

  prices = {p.batch: again(p) for p in found.search}  # the row's own micro-batch and the edge among them
  priced = lambda p, batch: dataclasses.replace(  # noqa: E731
      p, **dict(zip(("calibrated_step_s", "calibrated_collective_s"), prices.get(batch, own(p)))))
  searched = dataclasses.replace(found, at_max=priced(found.at_max, found.at_max.batch),
                                 search=tuple(priced(p, p.batch) for p in found.search))
  figures = priced(row.figures, row.batch)
  return dataclasses.replace(row, figures=figures, searched=searched,
                             measured=(*(row.measured or ()), Measured(edge, made.runs[0].step_s)))


def run_at(compiler: RowCompiler, model: PlannedModel, request: PlanRequest, row: Row,
           batch: int | None = None) -> Measured:
  """``row``'s kept program at ``batch`` (None: the row's own), run on this process's chips as compiled."""
  say: Callable[[str], None] = compiler.progress or (lambda line: None)
  batch = row.batch if batch is None else batch
  fraction = row.offloaded.offload_fraction if row.offloaded else 0.0
  shape = StepShape(batch, request.seq_len, row.ga or request.ga, request.optimizer, fraction)
  program = compiler.program(row.lever, model, shape)
  if program is None:
    return Measured(batch, None, error="not compiled whole for this machine's chips")
  at = f"{row.lever} ({row.step}) at micro-batch {batch}" + (f" x GA {shape.ga}" if shape.ga > 1 else "")
  say(f"running {at}: {WARMUP} + {TIMED} steps ...")
  run, _ = run_program(program)
  say(f"ran {at}: {run.error or f'{ms(run.step_s or 0.0)} ms, the median of {TIMED}'}")
  return run


def _is_recommended(row: Row, recommended: Recommendation) -> bool:
  return (row.lever, row.step, row.remat) == (recommended.lever, recommended.step, recommended.remat)


def said_measured(recommended: Recommendation, rows: Sequence[Row]) -> Recommendation:
  """``recommended`` with a note of its run on this machine's chips, where it ran."""
  seconds = next((m.step_s for r in rows if _is_recommended(r, recommended)
                  for m in r.measured or () if m.batch == recommended.micro_batch and m.step_s), None)
  if seconds is None:
    return recommended
  note = f"measured on this machine's chips: {ms(seconds)} ms a step (the median of {TIMED})"
  return dataclasses.replace(recommended, notes=(*recommended.notes, note))
