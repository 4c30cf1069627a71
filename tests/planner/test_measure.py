"""``--measure`` and the plan where the target's chips are this machine's: everything but a run on the chip.
The refusal where the local devices are not the target's (this machine has CPUs only), the flag, a row's
runs through plan.json and the table, the runs of the very programs the plan compiled (one compile per row),
and the step runner itself, which is device-agnostic, on CPU devices."""

import dataclasses
import json
import re

import jax
import numpy as np
import pytest

from nnx_zero1_plan import LEVERS, PlanError, PlanRequest, main, parse_args
from nnx_zero1_plan import local as local_module
from nnx_zero1_plan.local import devices_for
from nnx_zero1_plan.local_chips import LocalDevices, not_the_target
from nnx_zero1_plan.on_chip import Kept, measured_batches
from nnx_zero1_plan.plan_md import markdown
from nnx_zero1_plan.planned_model import NNX_MODELS
from nnx_zero1_plan.recommend import Recommendation
from nnx_zero1_plan.request import check_topology
from nnx_zero1_plan.row import Figures, Made, Measured, Point, Row, Searched
from nnx_zero1_plan.row_compiler import RowCompiler, StepShape
from nnx_zero1_plan.run import measured_rows
from nnx_zero1_plan.table import table
from nnx_zero1_plan.targets import Target

V5E = LocalDevices("tpu", "TPU v5 lite", 1)


def _row(lever="zero1", fits=True, step="one", **changed):
  figures = Figures(peak_bytes_per_device=14 * 2**30, predicted_step_s=0.2348, compile_s=1.0)
  return Row(lever, step, "v5e:1x1", "TPU v5 lite", {"data": 1}, "m:f", 8, figures, Made(depth=2),
             16_909_336_064, 16_909_336_064, fits, **changed)


def test_the_flag_is_off_unless_asked():
  argv = ["--model", "m:f", "--topology", "v5e:1x1"]
  assert parse_args(argv).measure is False and parse_args([*argv, "--measure"]).measure is True


def test_local_devices_are_the_targets_only_by_platform_kind_and_count():
  why = lambda local, topology, slices=1: not_the_target(local, topology, check_topology(topology), slices)
  assert why(V5E, "v5e:1x1") is None
  assert why(LocalDevices("tpu", "TPU v5 lite", 4), "v5e:2x2") is None
  assert "1 x 'TPU v5 lite' (tpu), not v5e:2x2's 4 v5e" in why(V5E, "v5e:2x2")
  assert "not v6e:1x1's 1 v6e" in why(V5E, "v6e:1x1")
  assert "not v5e:1x1's 2 v5e" in why(LocalDevices("tpu", "TPU v5 lite", 1), "v5e:1x1", slices=2)
  assert "2 x 'cpu' (cpu)" in why(LocalDevices("cpu", "cpu", 2), "v5e:1x1")
  assert "jax sees no CUDA devices" in why(None, "h100:8")


def test_measure_is_refused_in_one_line_where_the_devices_are_not_the_targets(capsys):
  # This machine has CPUs only: a child asks jax which devices it sees.
  assert main(["--model", "tests.support.planner_toys:tiny_lm", "--topology", "v5e:1x1", "--measure"]) == 2
  said = capsys.readouterr().err.strip().splitlines()
  assert len(said) == 1 and re.fullmatch(
      r"nnx_zero1.plan: --measure runs each row's step on this machine's devices, which must be the "
      r"target's: this machine's devices are \d+ x 'cpu' \(cpu\), not v5e:1x1's 1 v5e", said[0]), said
  with pytest.raises(PlanError, match="maxtext: model's runs in MaxText's engine"):
    devices_for(PlanRequest("maxtext:qwen3-0.6b", "v5e:1x1"), measure=True)
  # Without --measure, a plan here goes on as it did: compiled for a compile-only topology.
  assert devices_for(PlanRequest("m:f", "v5e:1x1")) is None


def test_a_local_plan_compiles_where_the_devices_are_the_targets(monkeypatch):
  monkeypatch.setattr(local_module, "chips_may_be_here", lambda platform: True)
  monkeypatch.setattr(local_module, "local_devices", lambda: V5E)
  assert devices_for(PlanRequest("m:f", "v5e:1x1"), measure=True) == V5E
  with pytest.raises(PlanError, match="not v5e:2x2's 4 v5e"):
    devices_for(PlanRequest("m:f", "v5e:2x2"), measure=True)
  assert devices_for(PlanRequest("m:f", "v5e:2x2")) is None  # planned for the compile-only topology


def test_a_rows_runs_go_through_plan_json_and_a_row_without_them_writes_as_before():
  plain = _row()
  assert "measured" not in plain.to_json() and Row.from_json(plain.to_json()) == plain
  runs = (Measured(8, 0.191, 3_470_000_000), Measured(13, None, None, "OOM"))
  ran = dataclasses.replace(plain, measured=runs)
  written = json.loads(json.dumps(ran.to_json()))
  assert written["measured"] == [{"batch": 8, "step_s": 0.191, "held_bytes": 3_470_000_000, "error": None},
                                 {"batch": 13, "step_s": None, "held_bytes": None, "error": "OOM"}]
  assert Row.from_json(written) == ran
  assert {k: v for k, v in written.items() if k != "measured"} == plain.to_json()
  # A plan written before the figure was named for what it holds still reads.
  old = {"batch": 8, "step_s": 0.191, "peak_bytes": 7, "error": None}
  assert Measured.from_json(old) == Measured(8, 0.191, 7)


def test_the_table_prints_each_run_beside_the_prediction():
  at_max = Point(13, True, peak_bytes_per_device=15 * 2**30, predicted_step_s=0.4443)
  searched = Searched(13, 14, "OOM", None, (), at_max, None, (at_max,), 9.0)
  ran = _row(searched=searched, measured=(Measured(8, 0.191, 3 * 2**30), Measured(13, 0.3476, 3 * 2**30)))
  assert "measured" not in table([_row()]) and "Measured" not in markdown({}, [_row()], [])
  text = table([ran], wide=False)
  lines = text.splitlines()
  head = next(i for i, line in enumerate(lines) if "step ms (measured)" in line)
  assert lines[head + 2].split() == ["zero1", "one", "8", "234.8", "191.0", "+23%", "14.00", "3.00"]
  assert lines[head + 3].split() == ["zero1", "one", "13", "444.3", "347.6", "+28%", "15.00", "3.00"]
  assert "| zero1 | one | 8 | 234.8 | 191.0 | +23% | 14.00 | 3.00 |  |" in markdown({}, [ran], [])


def test_measure_runs_a_fitting_row_and_a_searchs_largest_but_no_split_step_or_refusal():
  searched = Searched(13, 14, "OOM", None, (), Point(13, True), None, (), 9.0)
  rows = [_row(searched=searched), _row("baseline", fits=False), _row(step="split")]
  assert [measured_batches(r) for r in rows] == [(8, 13), (), ()]


def test_measure_runs_the_programs_the_plan_compiled_each_compiled_once():
  # The plan's own path on two CPU devices: the row compiled once (a second row of it reads the kept
  # program), then run as it was compiled; the recommended point, never compiled, said so rather than run.
  request = PlanRequest("tests.support.planner_toys:tiny_lm", "v5e:2x1", batch=4, seq_len=16)
  target = Target("v5e:2x1", "tpu", "v5e", tuple(jax.devices()[:2]), 2**34, "the test's")
  planned = NNX_MODELS.on_target(request, NNX_MODELS.described(request, None), target, None)
  said = []
  compiler = RowCompiler(target, 2**34, said.append, "float32", kept=Kept())
  shape = StepShape(4, 16, 1, "adamw")
  row = compiler.row("zero1", "one", planned, shape)
  again = compiler.row("zero1", "one", planned, shape)
  assert [line.split(" ...")[0] for line in said if line.startswith("compiling")] == [
      "compiling zero1 (one) at micro-batch 4"]
  assert again.figures == row.figures and row.verdict
  recommended = Recommendation("zero1", "one", 8, None, "", "", (), (), (), ())
  done, = measured_rows(compiler, {None: planned}, request, [row], recommended)
  ran, never = done.measured
  assert ran.batch == 4 and ran.error is None and ran.step_s > 0
  assert never == Measured(8, None, error="not compiled whole for this machine's chips")
  assert "ran zero1 (one) at micro-batch 4: " in said[-1]


def test_each_build_is_profiled_once_and_a_global_batch_runs_its_close_splits():
  """With --measure the first fitting row of each build (its lever, with the accumulation loop or without) is
  profiled as it is compiled, the rest priced by it; --global-batch runs the splits close to the fastest and
  chooses the fastest measured, each split said with its kind of time. On two CPU devices, the profile a
  stand-in for the TPU profiler (CPU programs have no cycles to calibrate)."""
  from nnx_zero1_plan.calibration import Calibration, Run
  from nnx_zero1_plan.run import _lever_row

  request = PlanRequest("tests.support.planner_toys:tiny_lm", "v5e:2x1", seq_len=16, global_batch=8)
  target = Target("v5e:2x1", "tpu", "v5e", tuple(jax.devices()[:2]), 2**34, "the test's")
  planned = NNX_MODELS.on_target(request, NNX_MODELS.described(request, None), target, None)
  profiled = []

  def profile(lever, shape, program):
    profiled.append((lever, shape.batch, shape.ga))
    run = Run(lever, shape.batch, shape.ga, 16, 0.1, 0.1, 0.1, 0.0)
    return Calibration("v5e", jax.__version__, None, (run,), {})

  compiler = RowCompiler(target, 2**34, None, "float32", kept=Kept(), profile=profile)
  builds = ((4, 1, "zero1"), (2, 1, "zero1"), (2, 2, "zero1"), (2, 4, "zero1"), (2, 1, "baseline"))
  for batch, ga, lever in builds:
    assert compiler.row(lever, "one", planned, StepShape(batch, 16, ga, "adamw")).verdict
  assert profiled == [("zero1", 4, 1), ("zero1", 2, 2), ("baseline", 2, 1)]
  assert len(compiler.all_calibrations) == 3
  row = _lever_row(compiler, request, planned, "zero1", "one", None, 2)
  assert [(s.batch, s.ga) for s in row.splits][:2] == [(8, 1), (4, 2)] and all(s.fits for s in row.splits)
  ran = [s for s in row.splits if s.time == "measured"]
  assert ran and all(s.step_s > 0 for s in ran)
  fastest = min(ran, key=lambda s: s.step_s)
  assert (row.batch, row.ga) == (fastest.batch, fastest.ga) and row.measured[0].step_s == fastest.step_s
  done, = measured_rows(compiler, {None: planned}, request, [row], None)
  assert done.measured == row.measured  # not run again after the plan


def test_the_step_runner_runs_a_compiled_step_on_cpu_devices():
  from nnx_zero1_plan import abstract_batch, model_source, placed_state, run_steps, step_jit

  mesh = jax.make_mesh((2,), ("data",), (jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
  source = model_source("tests.support.planner_toys:tiny_lm")
  lever = LEVERS["zero1"]
  abstract, state = placed_state(lever, lambda: source.build(2), "adamw", mesh)
  spec = abstract_batch(lever, mesh, 4, 16, 1)
  tokens = jax.device_put(np.ones(spec.shape, np.int32), spec.sharding)
  step = step_jit(abstract.graphdef, abstract.shardings, spec.sharding, lever, source.loss_fn, 1)
  with jax.set_mesh(mesh):
    compiled = step.lower(state, tokens).compile()
  state, runs = run_steps(compiled, state, tokens, warmup=1, timed=3)
  assert runs.error is None and len(runs.times_s) == 4 and runs.step_s == sorted(runs.times_s[1:])[1]
  assert np.isfinite(runs.loss) and runs.loss > 0
  # A step that cannot run (here: a batch of another shape) is the runs' answer, not an exception.
  _, failed = run_steps(compiled, state, tokens[:, :2], warmup=0, timed=2)
  assert failed.step_s is None and failed.error


def test_the_search_priced_again_with_its_largest_micro_batchs_run(monkeypatch):
  """With --measure the search's largest micro-batch is run and profiled, and then every point of the search
  whose program is kept, the row's own micro-batch included, is priced again by the build's calibrations with
  that run among them (each was priced before it); a point with no kept program keeps its price."""
  from nnx_zero1_plan import measured_plan
  from nnx_zero1_plan.calibration import Calibration, Run

  kept = {8, 16, 61}  # 39: its program not kept
  repriced = []

  class Compiler:
    profile = object()

    def priced_by_own_run(self, lever, model, shape, figures):
      run = Run(lever, shape.batch, shape.ga, 16, 1.9, 1.9, 1.8, 0.1)
      return dataclasses.replace(figures, calibrated_step_s=1.95), Calibration("v5e", "0", None, (run,), {})

    def program(self, lever, model, shape):
      return type("Program", (), {"record": shape.batch})() if shape.batch in kept else None

  def again(figures, programs, compiler, lever, ga):
    (record, times), = programs
    repriced.append(record)
    return dataclasses.replace(figures, calibrated_step_s=figures.predicted_step_s * 0.9)

  monkeypatch.setattr(measured_plan, "calibrated", again)
  point = lambda b: Point(b, True, predicted_step_s=b / 25, calibrated_step_s=b / 30)  # noqa: E731
  search = tuple(map(point, (8, 16, 39, 61)))
  found = Searched(61, 62, "RESOURCE_EXHAUSTED", None, (), search[-1], None, search, 1.0)
  row = Row("baseline", "one", "v5e:1x1", "TPU v5 lite", {"data": 1}, "m", 8,
            Figures(predicted_step_s=8 / 25, calibrated_step_s=8 / 30), Made(), 9, 9, True, searched=found)
  request = PlanRequest("tests.support.planner_toys:tiny_lm", "v5e:1x1", seq_len=16, search=True)
  done = measured_plan.edge_profiled(Compiler(), None, request, row)
  prices = {p.batch: p.calibrated_step_s for p in done.searched.search}
  assert prices == {8: pytest.approx(8 / 25 * 0.9), 16: pytest.approx(16 / 25 * 0.9), 39: 39 / 30, 61: 1.95}
  assert done.searched.at_max.calibrated_step_s == 1.95 and sorted(repriced) == [8, 16]  # each priced once
  assert done.figures.calibrated_step_s == pytest.approx(8 / 25 * 0.9)
  assert done.measured == (Measured(61, 1.9),)
