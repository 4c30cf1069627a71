"""A plan, end to end: one request orchestrated, from the model's description to the recommendation."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence

import jax

from nnx_zero1_plan import compilers
from nnx_zero1_plan.calibration import combined, read_calibrations
from nnx_zero1_plan.compiled import peak_source
from nnx_zero1_plan.levers import LEVERS, splits_nothing
from nnx_zero1_plan.maxtext import MaxTextModels, output_directory
from nnx_zero1_plan.measured_plan import edge_profiled, measured_rows, profiler, run_at, said_measured
from nnx_zero1_plan.mesh_axes import SMALLEST_MICRO_BATCH, batch_axes, micro_batch
from nnx_zero1_plan.planned_model import NNX_MODELS, ModelPlanner, PlannedModel, refuse_blocked
from nnx_zero1_plan.recommend import plan_code, recommend
from nnx_zero1_plan.request import PlanRequest, ResolvedRequest, command_line
from nnx_zero1_plan.result import Plan
from nnx_zero1_plan.row import Row
from nnx_zero1_plan.row_compiler import Kept, RowCompiler, StepShape
from nnx_zero1_plan.search import MAX_COMPILES, offload_search, search_row, split_global_batch
from nnx_zero1_plan.settings import PlanSettings
from nnx_zero1_plan.targets import Target, make_target, require_compiler, usable_bytes
from nnx_zero1_plan.way_out import Change, WayOut, changes_to_try, find_way_out, next_steps


def _micro_batch(request: PlanRequest, planned: PlannedModel) -> tuple[int, str | None]:
  """The plan's micro-batch, and the sentence that states it when ``--batch`` was not given (a model whose
  engine builds its own mesh, MaxText's, splits a given batch over every device and checks it itself)."""
  mesh, unit = planned.device_mesh, planned.batch_unit
  over = " x ".join(batch_axes(mesh.axis_names)) if mesh is not None else "every device"
  batch = (request.batch if mesh is None and request.batch is not None
           else micro_batch(request.batch, unit, over))
  stated = None if request.batch is not None else (
      f"--batch not given: micro-batch {batch}, the smallest of at least {SMALLEST_MICRO_BATCH} sequences "
      f"that splits over the batch axes ({over} = {unit} devices)")
  return batch, stated


def _lever_row(compiler: RowCompiler, request: PlanRequest, model: PlannedModel, name: str, step: str,
               policy: str | None, batch: int) -> Row:
  """One lever's row under one remat policy at ``batch``, searched as the request and the lever ask (the
  global batch's split, the share offloaded, or the largest micro-batch that fits)."""
  shape = StepShape(batch, request.seq_len, request.ga, request.optimizer)
  compiled = lambda **changed: compiler.row(name, step, model, dataclasses.replace(shape, **changed), policy)
  if request.global_batch is not None:  # with --measure the close splits run, the fastest measured chosen
    run = (lambda row: run_at(compiler, model, request, row)) if compiler.kept is not None else None
    return split_global_batch(lambda b, ga: compiled(batch=b, ga=ga), request.global_batch, model.batch_unit,
                              run)
  if LEVERS[name].picks_offload:  # the fraction is searched at --batch, the micro-batch is not
    return offload_search(lambda f: compiled(offload_fraction=f), compiler.usable)
  row = compiled()
  if not request.search:
    return row
  row = dataclasses.replace(row, searched=search_row(row, lambda b: compiled(batch=b), model.batch_unit,
                                                     compiler.usable))
  return edge_profiled(compiler, model, request, row)  # with --measure: the edge run, priced with its run


def _done(name: str, step: str, policy: str | None, topology: str, row: Row) -> str:
  """The progress line after a lever: what its search found."""
  found = ""
  if row.searched is not None:
    found = f"; the largest micro-batch that fits: {row.searched.max_micro_batch}"
  if row.offloaded is not None:
    found = f"; the smallest share of the state to offload: {row.offloaded.offload_fraction:.0%}"
  if row.ga is not None:
    found = f"; the global batch split fastest: micro-batch {row.batch} x GA {row.ga}"
  under = f", remat {policy}" if policy else ""
  return f"done: {name} ({step}{under}) for {topology}{found}"


def _compiles_planned(request: PlanRequest, planned: PlannedModel, rows: int) -> str:
  """The progress line before the first compile: how many compiles the plan will make."""
  each = 2 if planned.reduced else 1  # an estimate compiles two reduced depths (and whole near the limit)
  line = f"planning {rows} rows: {rows * each} compiles"
  if request.search:
    line += f", and up to {MAX_COMPILES} more per row for the search of its largest micro-batch"
  if any(LEVERS[n].picks_offload for n in request.levers):
    line += ", and a few for each offload fraction tried"
  return line


def _left(done: int, rows: int, started: float) -> str:
  """How many rows remain and the time left at the pace of those done."""
  if done == rows:
    return ""
  per_row = (time.perf_counter() - started) / done
  return f" ({rows - done} of {rows} rows left, ~{per_row * (rows - done):.0f} s at the pace so far)"


def _settings(request: ResolvedRequest, planned: PlannedModel, target: Target, rows: Sequence[Row],
              batch_default: str | None, compiler: str, usable: int) -> PlanSettings:
  """plan.json's meta: the request as resolved, the model's depth and dtypes, the target and the compilers."""
  source = planned.source_at(request.batch)
  # A MaxText model's depth is its config's, which its rows' figures say they are for.
  layers = source.full_depth or next((row.made.depth for row in rows if row.made.depth), None)
  extrapolated = [row.made.depth_extrapolated_from for row in rows if row.made.depth_extrapolated_from]
  return PlanSettings(
      request, layers=layers, device_kind=target.device_kind, batch_default=batch_default,
      param_dtypes=sorted(planned.param_dtypes), compiler=compiler, jax=jax.__version__,
      hbm_bytes=target.hbm_bytes, hbm_source=target.hbm_source, usable_bytes=usable,
      peak_source=peak_source(),
      depth_extrapolated_from=extrapolated[0] if extrapolated else None, batch_unit=planned.batch_unit,
      domains=target.domains, activation_sharding=planned.activation_sharding)


def _way_out(compiler: RowCompiler, resolved: ResolvedRequest, planned: PlannedModel, meta: PlanSettings,
             blocked: Mapping[str, str], kind: ModelPlanner) -> WayOut:
  """When nothing fits: the changes that may make room, compiled lightest first until one fits."""
  step = resolved.steps[0]

  def compile_changed(change: Change) -> Row:
    r = change.request
    policy = r.policies[0]
    model = kind.on_target(r, kind.described(r, policy), compiler.target, policy)  # whole: no --estimate
    _micro_batch(r, model)
    return compiler.row(r.levers[0], step, model, StepShape(r.batch, r.seq_len, r.ga, r.optimizer))

  # The changes are tried on Zero-1 where it splits the state here, else on the baseline.
  splits = "zero1" not in blocked and not splits_nothing("zero1", resolved.mesh_sizes)
  lever = "zero1" if splits else "baseline"
  remat = resolved.model_ref.kind.remat_hint
  changes = changes_to_try(resolved, lever=lever, batch_unit=planned.batch_unit, remat=remat,
                           named_axes=planned.named, host_memory=compiler.target.backend.host_memory)
  return find_way_out(changes, compile_changed, lambda c: command_line(c.request, steps=[step]),
                      lambda c: plan_code(c.request, c.request.levers[0],
                                          activation_sharding=meta.activation_sharding))


def make_plan(request: PlanRequest, progress: Callable[[str], None] | None = None,
              local: bool = False, measure: bool = False) -> Plan:
  """Compiles every lever's training step for the request's topology in this process, which it keeps on
  jax's CPU backend and expects prepared for the compilers (the command line's, after
  :func:`nnx_zero1_plan.compilers.start_cpu_jax`, or the planning process :func:`nnx_zero1_plan.plan` starts).

  ``progress`` is called with one line as each compile starts and ends, and after each lever. ``local``
  compiles for this process's own devices, the target's chips, jax left on them; with it ``measure`` runs
  each fitting row's program there as it was compiled (``--measure``: :mod:`nnx_zero1_plan.measured_plan`).

  Raises:
    PlanError: what only the model or the compiler can tell (e.g. an axis the model does not name).
    AotUnavailable: the target's compiler is not installed.
  """
  if not local:
    compilers.keep_jax_on_cpu()
  if not request.model_ref.kind.engine:
    return _planned(request, progress, NNX_MODELS, local, measure)
  with output_directory() as folder:  # MaxText writes under its base_output_directory: made for this plan
    return _planned(request, progress, MaxTextModels(folder), local, measure)


def _planned(request: PlanRequest, progress: Callable[[str], None] | None, kind: ModelPlanner,
             local: bool = False, measure: bool = False) -> Plan:
  """:func:`make_plan`'s plan of a model of ``kind``."""
  say = progress or (lambda line: None)
  policies = request.policies
  chip = request.topology_ref.chip
  calibrations = read_calibrations(request.calibration, chip) if request.calibration else ()
  # Described before the compiler is looked for where the kind can be: a misspelt axis needs none.
  described = {p: kind.described(request, p) for p in policies}
  first = described[policies[0]]
  # A lever that cannot apply is refused before the compiler is looked for where the kind is described so far.
  blocked = None if first is None else refuse_blocked(request, first)
  compiler_name = require_compiler(request.backend)
  target = make_target(request.topology, request.gpu_memory_fraction, request.slices,
                       parsed=request.topology_ref, local=local)
  plans = {p: kind.on_target(request, m, target, p) for p, m in described.items()}
  planned = plans[policies[0]]  # the axes, the batch's unit and the hints are alike under every policy
  batch, batch_default = _micro_batch(request, planned)
  batch_default = None if request.global_batch else batch_default  # each row's is chosen, and said
  if batch_default:
    say(batch_default)
  for model in plans.values():
    model.source_at(batch)  # the settings checked at the plan's micro-batch before any compile
  if blocked is None:  # a kind described on the target only (MaxText's)
    blocked = refuse_blocked(request, planned)
  usable = usable_bytes(target.hbm_bytes, target.backend, request.margin)
  # --measure calibrates each build on its own first fitting row where no calibration is given (a given one
  # is the one the runs check).
  profile = profiler(target, progress) if measure and not calibrations else None
  compiler = RowCompiler(target, usable, progress, planned.compute_dtype,
                         kept=Kept() if measure else None, calibrations=calibrations, profile=profile)
  rows = []
  todo = [(p, n, s) for p in policies for n in request.levers for s in request.steps]
  say(_compiles_planned(request, planned, len(todo)))
  started = time.perf_counter()
  for done, (policy, name, step) in enumerate(todo, 1):
    row = _lever_row(compiler, request, plans[policy], name, step, policy, batch)
    rows.append(row)
    say(_done(name, step, policy, request.topology, row) + _left(done, len(todo), started))
  resolved = request.resolved(planned.axes, batch)  # what the plan's meta says and its commands reproduce
  meta = _settings(resolved, planned, target, rows, batch_default, compiler_name, usable)
  hints = next_steps(rows, resolved, list(LEVERS), blocked=blocked, remat=request.model_ref.kind.remat_hint,
                     batch_unit=planned.batch_unit, named_axes=planned.named)
  way_out = None
  if rows and not request.estimate and not any(row.verdict for row in rows):
    way_out = _way_out(compiler, resolved, planned, meta, blocked, kind)
  recommended = recommend(rows, resolved, activation_sharding=meta.activation_sharding)
  if measure:
    rows = measured_rows(compiler, plans, request, rows, recommended)
    recommended = recommended and said_measured(recommended, rows)
  made = compiler.all_calibrations
  return Plan(meta, rows, recommended, way_out, hints, combined(*made) if made else None, made or None)
