"""One row of a plan: a lever's step compiled whole at one micro-batch; for an estimate (``--estimate``), at
two reduced depths and extrapolated per layer, and whole anyway where the line comes near the limit or the two
depths disagree. The compiler's refusal is a row too (its figures None). Every kind of model's compile comes
to its figures by one path (:func:`compile_and_read`)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax

from nnx_zero1_plan.abstract import abstract_bytes_per_device, bytes_by_dtype, state_split
from nnx_zero1_plan.calibrated_time import calibrated_step, read_program
from nnx_zero1_plan.calibration import Calibration, built_otherwise, for_step
from nnx_zero1_plan.chips import CHIPS
from nnx_zero1_plan.compiled import collectives_of, hbm_oom, step_figures, step_flops
from nnx_zero1_plan.estimate import NEAR, NEAR_LIMIT, estimate_mark, extrapolate_row, not_alike
from nnx_zero1_plan.gpu_matmuls import tensor_core_priced
from nnx_zero1_plan.gpu_schedule import dumped_schedule
from nnx_zero1_plan.gpu_twin import as_scheduled, compile_twin, needs_twin, twin_devices
from nnx_zero1_plan.inputs import error_line, shortened
from nnx_zero1_plan.levers import state_axes, with_offload
from nnx_zero1_plan.networks import network_per_step, over_the_slow_network
from nnx_zero1_plan.on_chip import Kept, Program
from nnx_zero1_plan.planned_model import PlannedModel
from nnx_zero1_plan.program_record import ProgramRecord
from nnx_zero1_plan.row import PER_LAYER, Figures, Made, Row, StateSplit
from nnx_zero1_plan.search import fits_in
from nnx_zero1_plan.step_time import predict_step_time, rates_for
from nnx_zero1_plan.steps import StepShape, compile_split, compile_step, lever_state
from nnx_zero1_plan.targets import Target


def with_step_time(figures: Figures, programs: Sequence[tuple[str, ProgramRecord, int]], shape: StepShape,
                   timing: RowCompiler | None, lever_name: str) -> Figures:
  """``figures`` with the predicted time of the ``programs`` one step of ``lever_name`` runs on ``timing``'s
  target (a GPU's records with its scheduler's estimates: :func:`gpu_estimates`), and the calibrated time
  (:func:`calibrated`)."""
  if timing is None:
    return figures
  target = timing.target
  slow = _across(figures)
  tokens = shape.batch * shape.seq_len * shape.ga / len(target.devices)
  figures = predict_step_time(programs, CHIPS[target.chip], devices=len(target.devices),
                              tokens_per_device=tokens, compute_dtype=timing.compute_dtype, slow_bytes=slow,
                              figures=figures)
  return calibrated(figures, [(record, times) for _, record, times in programs], timing, lever_name, shape.ga)


def _across(figures: Figures) -> int:
  """The bytes one device sends per step between slices or nodes (0 on one)."""
  return figures.collectives.across_bytes if figures.collectives else 0


def gpu_estimates(programs: Sequence[tuple[str, ProgramRecord, int]],
                  scheduled: Mapping[str, Mapping[str, float]], target: Target
                  ) -> list[tuple[str, ProgramRecord, int]]:
  """``programs`` with XLA's GPU scheduler's estimates (``scheduled``) on their records, each bfloat16 matmul
  with a float32 result priced as the tensor cores run it (:func:`~nnx_zero1_plan.gpu_matmuls.
  tensor_core_priced`)."""
  probed_on = twin_devices(target.chip, target.hbm_bytes) if needs_twin(target) else target.devices
  priced = tensor_core_priced(scheduled, [record for _, record, _ in programs], probed_on)
  return [(name, dataclasses.replace(record, estimates=priced.get(record.module or "")), times)
          for name, record, times in programs]


def calibrated(figures: Figures, programs: Sequence[tuple[ProgramRecord, int]], timing: RowCompiler,
               lever: str, ga: int) -> Figures:
  """``figures`` with the calibrated time of ``programs`` (each program's record and the runs a step makes of
  it) by ``timing``'s calibrations built as ``lever``'s step at ``ga`` is; as they are where there are none,
  or no predicted time."""
  calibration = for_step(timing.all_calibrations, lever, ga)
  if calibration is None or figures.predicted_step_s is None or figures.step_time is None:
    return dataclasses.replace(figures, calibrated_step_s=None, calibrated_collective_s=None)
  read = [(read_program(record, rates_for(CHIPS[timing.target.chip])), times) for record, times in programs]
  step_s, collective_s = calibrated_step(read, calibration, timing.target.name)
  timed = bool(calibration.collectives_on(timing.target.name))
  step_s = over_the_slow_network(step_s, collective_s, CHIPS[timing.target.chip], _across(figures))[0]
  return dataclasses.replace(figures, calibrated_step_s=step_s,
                             calibrated_collective_s=collective_s if timed else None)


@contextlib.contextmanager
def _gpu_schedule(timing: RowCompiler | None) -> Iterator[tuple[dict[str, Any] | None, Callable[[], Any]]]:
  """For a target priced by its scheduler, the compiler options that dump its estimates into a folder removed
  after, and a reader of them; elsewhere no options, nothing read."""
  if timing is None or timing.target.backend.prices_in_cycles:
    yield None, lambda: None
    return
  with dumped_schedule() as (options, read):
    yield options, read


class Compiled(NamedTuple):
  """A lever's step as its model's kind compiled it: the programs one step runs, in order (each ``(name,
  executable, record, runs a step makes of it)``), the mesh they run on, the figures only the kind knows
  (its state's, the compile's seconds), and the program that runs once per micro-batch, whose collectives are
  one micro-batch's (None: a loop's trip's); a one-GPU step's twin, compiled on demand (:mod:`gpu_twin`), and
  what keeps its program, given its record as timed."""

  programs: Sequence[tuple[str, Any, ProgramRecord, int]]
  mesh: Any
  known: Figures
  micro_batch: str | None = None
  twin: Callable[[], tuple[ProgramRecord, dict[str, dict[str, float]]]] | None = None
  keep: Callable[[ProgramRecord], None] | None = None


def read_compile(step: Compiled, timing: RowCompiler | None) -> Figures:
  """The figures of a compiled step, for every kind of model, read by
  :func:`~nnx_zero1_plan.compiled.step_figures` on its mesh's slices or nodes, with the figures its kind
  knows."""
  target = timing.target if timing is not None else None
  domains = [target.domain_of(d) for d in step.mesh.devices.flat] if target else None  # in the mesh's order
  backend = target.backend if target else None
  counted = {name: collectives_of(record, domains, backend) for name, _, record, _ in step.programs}
  resident = step.known.opt_state_bytes_per_device or 0
  figures = step_figures([(compiled, counted[name], n) for name, compiled, _, n in step.programs], resident)
  if step.micro_batch is not None and figures.collectives is not None:
    collectives = dataclasses.replace(figures.collectives, per_micro_batch=counted[step.micro_batch].per_step)
    figures = dataclasses.replace(figures, collectives=collectives)
  return dataclasses.replace(figures, **{k: v for k, v in vars(step.known).items() if v is not None})


def compile_and_read(compile: Callable[[dict[str, Any] | None], Compiled], at: str, lever_name: str,
                     shape: StepShape, progress: Callable[[str], None] | None, timing: RowCompiler | None,
                     known: Callable[[], Figures] = Figures, said: bool = True) -> Figures:
  """The one path from a kind's compile of a lever's step (``compile``, given the compiler's options) to the
  row's figures: its progress lines (none where ``said`` is False: a kept program, compiled already), the
  compiler's refusal as a row with the figures ``known`` before it, the step's figures read
  (:func:`read_compile`), timed and calibrated against ``timing``'s target (:func:`with_step_time`)."""
  say = progress or (lambda line: None)
  if said:
    say(f"compiling {at} ...")
  started = time.perf_counter()
  try:
    with _gpu_schedule(timing) as (options, read):
      step = compile(options)
      scheduled = read()
  except COMPILER_REFUSALS as e:
    return refused(e, started, say, at, known())
  figures = read_compile(step, timing)
  if said:
    say(compiled_line(at, figures.compile_s or 0.0, figures))
  programs = [(name, record, times) for name, _, record, times in step.programs]
  # A GPU's: its scheduler's estimates put on the records, unless a kept program carries them already.
  if scheduled is not None and timing is not None and programs[0][1].estimates is None:
    if step.twin is not None and needs_twin(timing.target):  # timed by its twin
      with contextlib.suppress(*COMPILER_REFUSALS):  # refused: no estimates, and the row says so
        scheduled = as_scheduled(programs[0][1], *step.twin())
    programs = gpu_estimates(programs, scheduled, timing.target)
  if step.keep is not None:
    step.keep(programs[0][1])
  return with_step_time(figures, programs, shape, timing, lever_name)


def compiled_figures(lever_name: str, step: str, source: Any, mesh: Any, shape: StepShape,
                     depth: int | None = None, progress: Callable[[str], None] | None = None,
                     timing: RowCompiler | None = None) -> Figures:
  """One compile of the lever's ``step`` (``"one"`` program or ``"split"``: gradients, then update) at
  ``depth`` layers (None: the model's own), for a model the planner builds: the row's
  :class:`~nnx_zero1_plan.row.Figures`, timed against ``timing``'s target (None: not timed), or the compiler's
  refusal (``error``, ``hbm_oom``; the compiled figures None)."""
  lever = with_offload(lever_name, shape.offload_fraction)
  # A one-program step compiled whole is kept for its run (--measure), and a second row of it reads it back.
  kept = timing.kept if timing is not None and step == "one" and depth is None else None
  key = _program_key(lever_name, source, shape)
  program = None if kept is None else kept.programs.get(key)
  state_figures: dict[str, Any] = {}  # what a refusal still says

  def compile(options: dict[str, Any] | None) -> Compiled:
    state = lever_state(lever, lambda: source.build(depth), shape.optimizer, mesh)
    by_kind = state.opt_state_bytes_by_memory_kind
    state_figures.update({
        "opt_state_bytes_per_device": by_kind.get("device", 0), "opt_state_bytes_by_memory_kind": by_kind,
        "opt_state_bytes_by_dtype": bytes_by_dtype(state.state[1]),
        "param_bytes_per_device": abstract_bytes_per_device(state.state[0]),
        "state_split": StateSplit(list(state_axes(lever)), state_split(state.state[1], state_axes(lever)))})
    sizes = (source.loss_fn, mesh, shape.batch, shape.seq_len, shape.ga)
    twin: Callable[[], tuple[ProgramRecord, dict[str, dict[str, float]]]] | None = None
    keep: Callable[[ProgramRecord], None] | None = None
    if program is not None:  # compiled already, for its run (--measure): not again
      programs = [("step", program.compiled, program.record, 1)]
      seconds = program.compile_s
    elif step == "one":  # each program's text read once, into the record every figure is read from
      compiled, seconds = compile_step(lever, state, *sizes, compiler_options=options)
      programs = [("step", compiled, ProgramRecord.read(compiled.as_text()), 1)]
      if timing is not None:
        twin = functools.partial(compile_twin, lever, lambda: source.build(depth), source.loss_fn, mesh,
                                 shape, timing.target)
      if kept is not None:
        made = (compiled, seconds, lever, lambda: source.build(None), mesh, state, shape)

        def keep(record: ProgramRecord) -> None:
          kept.programs[key] = Program(*made, record)
    else:
      grads, update, seconds = compile_split(lever, state, *sizes, compiler_options=options)
      programs = [(name, p, ProgramRecord.read(p.as_text()), 1) for name, p in (("gradients", grads),
                                                                                ("update", update))]
    flops, flops_source = step_flops(programs[0][1], programs[0][2])
    known = Figures(**state_figures, flops_per_device=flops, flops_source=flops_source, compile_s=seconds)
    return Compiled(programs, mesh, known, twin=twin, keep=keep)

  at = compile_words(lever_name, step, shape, depth)
  return compile_and_read(compile, at, lever_name, shape, progress, timing, lambda: Figures(**state_figures),
                          said=program is None)


# Zero1Error (a ValueError) when the optimizer refuses the model; the rest, the compiler's refusals.
COMPILER_REFUSALS = (jax.errors.JaxRuntimeError, ValueError, TypeError, NotImplementedError)


def compile_words(lever_name: str, step: str, shape: StepShape, depth: int | None = None) -> str:
  """What a compile is of, as its progress lines say it."""
  at = f"{lever_name} ({step}) at micro-batch {shape.batch}" + (f", {depth} layers" if depth else "")
  if with_offload(lever_name, shape.offload_fraction).picks_offload:
    at += f", {shape.offload_fraction:.0%} of the state offloaded"
  return at


def compiled_line(at: str, seconds: float, figures: Figures) -> str:
  """The progress line of the compile of ``at`` the compiler accepted in ``seconds``."""
  return f"compiled {at} in {seconds:.0f} s: peak {(figures.peak_bytes_per_device or 0) / 2**30:.2f} GiB"


def refused(e: Exception, started: float, say: Callable[[str], None], at: str, known: Figures) -> Figures:
  """The compiler's refusal ``e`` of the compile of ``at`` begun at ``started``, said, as a row's figures:
  those ``known`` before it, the error and its seconds."""
  error = error_line(e, 400)
  seconds = time.perf_counter() - started
  say(f"compiled {at}: refused in {seconds:.0f} s ({shortened(error, 160)})")
  return dataclasses.replace(known, error=error, hbm_oom=hbm_oom(str(e)), compile_s=seconds)


def _program_key(lever: str, source: Any, shape: StepShape) -> tuple[str, int, StepShape]:
  """Where a kept program is found: its lever, its model (under one remat policy: one source) and shape."""
  return lever, id(source), shape


_ESTIMATED_TIME = "an estimate: its time extrapolated per layer, its parts and MFU not"
# A kept program of a lever at a shape run and profiled on this process's chips, for its build's calibration
# (None: it did not run).
Profile = Callable[[str, StepShape, Program], Calibration | None]


@dataclasses.dataclass(frozen=True)
class RowCompiler:
  """What every row of a plan is compiled against: the target, the bytes per device a step may use on it
  (the reserve or margin taken off), the dtype the steps compute in (their MFU's peak), the calibrations each
  row is also priced by (those built as its step is: ``for_step``), and with ``--measure`` the store its
  programs and their runs' calibrations are kept in (``kept``) and the run that profiles a row's kept program
  for a calibration (``profile``)."""

  target: Target
  usable: int
  progress: Callable[[str], None] | None = None  # called with one line as each compile starts and ends
  compute_dtype: str = "bfloat16"
  kept: Kept | None = None
  calibrations: tuple[Calibration, ...] = ()
  profile: Profile | None = None

  @property
  def all_calibrations(self) -> tuple[Calibration, ...]:
    """The calibrations given and those this plan's runs made."""
    return (*self.calibrations, *(self.kept.profiled if self.kept else ()))

  def program(self, lever: str, model: PlannedModel, shape: StepShape) -> Program | None:
    """The kept program of ``lever``'s one-program step at ``shape`` (None: not compiled, or not kept)."""
    key = _program_key(lever, model.source_at(shape.batch), shape)
    return self.kept.programs.get(key) if self.kept else None

  def row(self, lever: str, step: str, model: PlannedModel, shape: StepShape,
          remat: str | None = None) -> Row:
    """One lever's row at ``shape``'s micro-batch (an estimate's depths: ``model.reduced``), its ``fits`` the
    one verdict (:func:`nnx_zero1_plan.search.fits_in`); an estimate's is None and ``made.fits_estimate`` says
    what the line says."""
    target = self.target
    source = model.source_at(shape.batch)
    figures, made = self._at_depths(lever, step, model, source, model.reduced, shape)
    near = (figures.peak_bytes_per_device or 0) > NEAR_LIMIT * target.hbm_bytes
    if made.depth_extrapolated_from and near or made.not_alike:
      extrapolated, why = figures, made.not_alike or NEAR
      figures, made = self._at_depths(lever, step, model, source, None, shape)
      both = (figures.compile_s or 0.0) + (extrapolated.compile_s or 0.0)
      figures = dataclasses.replace(figures, compile_s=both)
      made = dataclasses.replace(made, extrapolated_peak_bytes_per_device=extrapolated.peak_bytes_per_device,
                                 compiled_whole_because=why)
    peak = figures.peak_bytes_per_device
    verdict = fits_in(figures, self.usable)
    if (verdict and not made.depth_extrapolated_from and step == "one"
        and all(built_otherwise(c, lever, shape.ga) for c in self.all_calibrations)):
      # the first row of its build with no calibration built as it is: priced by its own run
      done = self.priced_by_own_run(lever, model, shape, figures)
      figures = figures if done is None else done[0]
    figures = dataclasses.replace(figures,
                                  headroom_bytes_per_device=None if peak is None else self.usable - peak,
                                  compile_s=round(figures.compile_s or 0.0, 1))
    if made.depth_extrapolated_from:
      marked = [k for k in (*PER_LAYER, "headroom_bytes_per_device") if getattr(figures, k) is not None]
      mark = estimate_mark(source.full_depth, made.depth_extrapolated_from, marked)
      made = dataclasses.replace(made, estimate=mark, fits_estimate=verdict)
      verdict = None
    if target.domains > 1 and figures.collectives:
      networks = network_per_step(figures.collectives, target.chip, target.backend, figures.step_time)
      made = dataclasses.replace(made, network_per_step=networks)
    return Row(lever=lever, step=step, compiled_for=target.name, device_kind=target.device_kind,
               mesh=model.axes, model=source.name, batch=shape.batch, figures=figures, made=made,
               hbm_bytes=target.hbm_bytes, usable_bytes=self.usable, fits=verdict,
               activation_sharding=model.activation_sharding, remat=remat)

  def priced_by_own_run(self, lever: str, model: PlannedModel, shape: StepShape,
                        figures: Figures) -> tuple[Figures, Calibration] | None:
    """The kept program of ``lever`` at ``shape`` run and profiled (:attr:`profile`), its calibration kept,
    and ``figures`` priced by its build's calibrations with it among them; None where nothing ran (no
    ``--measure``, no kept program, or no profile)."""
    if self.profile is None or self.kept is None or (program := self.program(lever, model, shape)) is None:
      return None
    made = self.profile(lever, shape, program)
    if made is None:
      return None
    self.kept.profiled.append(made)
    return calibrated(figures, [(program.record, 1)], self, lever, shape.ga), made

  def _at_depths(self, lever: str, step: str, model: PlannedModel, source: Any, depths: Sequence[int] | None,
                 shape: StepShape) -> tuple[Figures, Made]:
    """The lever's figures compiled whole (no ``depths``), or at the two ``depths`` and extrapolated to the
    full depth (a refusal at either is the row's), and how they were made."""
    def compiled(depth: int | None) -> Figures:
      compile = model.compiles or compiled_figures
      return compile(lever, step, source, model.device_mesh, shape, depth, self.progress, self)

    if not depths:
      figures = compiled(None)
      config = figures.maxtext_config  # a MaxText row's layers, as its config chose them (it compiles whole)
      return figures, Made(depth=source.full_depth or (config.num_decoder_layers if config else None))
    d1, d2 = depths
    r1 = compiled(d1)
    r2 = compiled(d2) if not r1.error else r1
    compile_s = (r1.compile_s or 0.0) + ((r2.compile_s or 0.0) if r2 is not r1 else 0.0)
    if r1.error or r2.error:
      refused = r1 if r1.error else r2
      return dataclasses.replace(refused, compile_s=compile_s), Made(depth=d1 if r1.error else d2)
    figures = extrapolate_row(r1, r2, d1, d2, source.full_depth, PER_LAYER)
    if figures.predicted_step_s:
      tokens = (r2.tokens_per_s_per_device or 0.0) * (r2.predicted_step_s or 0.0)
      figures = dataclasses.replace(figures, tokens_per_s_per_device=tokens / figures.predicted_step_s,
                                    mfu=None, step_time=None, time_absent=_ESTIMATED_TIME)
    doubt = (not_alike(r1.temp_bytes_per_device, r2.temp_bytes_per_device, d1, d2)
             or not_alike(r1.peak_bytes_per_device, r2.peak_bytes_per_device, d1, d2, "peak"))
    return (dataclasses.replace(figures, compile_s=compile_s),
            Made(depth=source.full_depth, depth_extrapolated_from=[d1, d2], not_alike=doubt))
