"""One record of a compiled program (``nnx_zero1_plan.program_record``), read once when its step compiles, and
every figure read off it: how often each computation runs is one rule (``nnx_zero1._src.hlo.calls``,
compounded by ``executions``), so the record, the walk and the FLOP count run a ``call`` and a conditional's
heavier branch once each; its collectives are those the optimizer's own counts know (an async all-gather, a
collective-permute); and a row compiled and timed with a calibration splits its program's text once."""

from __future__ import annotations

import gzip
import pathlib
import types

import jax

import nnx_zero1._src.hlo as hlo
import nnx_zero1._src.hlo_record as hlo_record
from nnx_zero1.testing import collectives, loop_collectives, sent_bytes
from nnx_zero1_plan import row_compiler
from nnx_zero1_plan.calibration import Calibration, Run
from nnx_zero1_plan.compiled import collectives_of
from nnx_zero1_plan.hlo_flops import dot_flops
from nnx_zero1_plan.networks import at_rate
from nnx_zero1_plan.planned_model import NNX_MODELS
from nnx_zero1_plan.program_record import ProgramRecord
from nnx_zero1_plan.request import PlanRequest
from nnx_zero1_plan.step_time import Rates, program_time
from nnx_zero1_plan.steps import StepShape
from nnx_zero1_plan.targets import Target

_CYCLES = 'backend_config={"estimated_cycles":"%d"}'
HLO = "\n".join([
    "HloModule m, num_partitions=4",
    "%light (p: f32[8,8]) -> f32[8,8] {",
    "  ROOT %n = f32[8,8]{1,0} negate(%p), " + _CYCLES % 10,
    "}",
    "%heavy (p: f32[8,8]) -> f32[8,8] {",
    "  %p = f32[8,8]{1,0} parameter(0)",
    "  %d = f32[8,8]{1,0} dot(%p, %p), lhs_contracting_dims={1}, "
    "rhs_contracting_dims={0}, " + _CYCLES % 1000,
    "  ROOT %cp = f32[8,8]{1,0} collective-permute(%d), source_target_pairs={{0,1},{1,2},{2,3},{3,0}}",
    "}",
    "%callee (p: f32[8,8]) -> f32[8,8] {",
    "  %p = f32[8,8]{1,0} parameter(0)",
    "  ROOT %d2 = f32[8,8]{1,0} dot(%p, %p), lhs_contracting_dims={1}, "
    "rhs_contracting_dims={0}, " + _CYCLES % 500,
    "}",
    "ENTRY %main (p: f32[8,8], i: s32[]) -> f32[32,8] {",
    "  %c = f32[8,8]{1,0} call(%p), to_apply=%callee",
    "  %k = f32[8,8]{1,0} conditional(%i, %c, %c), branch_computations={%light, %heavy}",
    "  %ag = (f32[8,8]{1,0}, f32[32,8]{1,0}) all-gather-start(%k), replica_groups={{0,1,2,3}}, "
    "dimensions={0}",
    "  ROOT %agd = f32[32,8]{1,0} all-gather-done(%ag)",
    "}",
])
MATMUL = 2 * 8 * 8 * 8
KEPT = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "data" / "device_v5e" / "run1" /
        "build_baseline" / "programs" / "baseline_8x1_s1024.hlo.txt.gz")


def test_the_record_runs_the_call_and_the_heavier_branch_once():
  record = ProgramRecord.read(HLO)
  assert record.runs == {"main": 1, "callee": 1, "heavy": 1}  # the light branch never
  assert dot_flops(record) == 2 * MATMUL
  walk = program_time(record, Rates(clock_hz=1e9, collective_s=at_rate(1e9)))
  assert round(walk.compute_s * 1e9) == 500 + 1000  # the call's cycles and the heavier branch's, not 10


def test_the_records_collectives_are_the_optimizers_counts():
  record = ProgramRecord.read(HLO)
  counted = collectives_of(record).to_json()
  assert counted["per_step"] == collectives(HLO) and counted["per_micro_batch"] == loop_collectives(HLO)
  assert counted["sent_per_step"] == sent_bytes(HLO)
  assert counted["per_step"]["all-gather"] == {"count": 1, "bytes": 32 * 8 * 4}
  assert counted["per_step"]["collective-permute"] == {"count": 1, "bytes": 8 * 8 * 4}
  # The walk's network time at one byte a second is the bytes one device sends.
  walk = program_time(record, Rates(clock_hz=1e9, collective_s=at_rate(1.0)))
  assert walk.collectives == 2 and round(walk.collective_s) == 3 * 8 * 8 * 4 + 8 * 8 * 4


def test_a_calibrated_row_splits_its_program_once(monkeypatch):
  # A row compiled and timed against a v5e with a calibration, its compile a kept v5e program (no compiler:
  # lane 1): its text printed once and split into computations once, for every figure the row holds.
  text, read = gzip.decompress(KEPT.read_bytes()).decode(), {"as_text": 0, "split": 0}

  def as_text():
    read["as_text"] += 1
    return text

  def split(hlo_text):
    read["split"] += 1
    return computations(hlo_text)

  stats = types.SimpleNamespace(argument_size_in_bytes=8, output_size_in_bytes=8, alias_size_in_bytes=0,
                                temp_size_in_bytes=8, peak_memory_in_bytes=24, host_argument_size_in_bytes=0)
  compiled = types.SimpleNamespace(as_text=as_text, memory_analysis=lambda: stats)
  computations = hlo.computations
  monkeypatch.setattr(row_compiler, "compile_step", lambda *args, **kwargs: (compiled, 1.0))
  monkeypatch.setattr(hlo, "computations", split)
  monkeypatch.setattr(hlo_record, "computations", split)
  request = PlanRequest("tests.support.planner_toys:tiny_lm", "v5e:1x1", batch=8, seq_len=16)
  target = Target("v5e:1x1", "tpu", "v5e", tuple(jax.devices()[:1]), 2**34, "the test's")
  calibration = Calibration("v5e", jax.__version__, None, (Run("zero1", 8, 1, 16, 0.1, 0.1, 0.1, 0.0),), {})
  compiler = row_compiler.RowCompiler(target, 2**34, None, "bfloat16", calibrations=(calibration,))
  planned = NNX_MODELS.on_target(request, NNX_MODELS.described(request, None), target, None)
  row = compiler.row("zero1", "one", planned, StepShape(8, 16, 1, "adamw"))
  assert row.figures.predicted_step_s and row.figures.calibrated_step_s and row.figures.flops_per_device
  assert read == {"as_text": 1, "split": 1}
