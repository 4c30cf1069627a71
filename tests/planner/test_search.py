"""The planner's search for the largest micro-batch that fits: pure logic, compiles stood in by functions."""

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from nnx_zero1_plan.inputs import PlanError
from nnx_zero1_plan.row import Point
from nnx_zero1_plan.search import MAX_COMPILES, find_edge, line_limit, round_down

GIB = 2**30


def probe(batch, peak, fits, error=None):
  """One compile as the search reads it: its peak (None: refused), whether it fits, the refusal."""
  return Point(batch, fits, peak_bytes_per_device=peak, error=error)


def by_peak(peak, usable, refuse_from=None):
  """A stand-in compiler: ``peak(batch)`` bytes, refused outright from ``refuse_from`` on."""
  calls = []

  def measure(batch):
    calls.append(batch)
    if refuse_from is not None and batch >= refuse_from:
      return probe(batch, None, False, f"RESOURCE_EXHAUSTED at {batch}")
    p = peak(batch)
    return probe(batch, p, p <= usable)

  return measure, calls


def brute_force(peak, usable, step, cap, refuse_from=None):
  fitting = [b for b in range(step, cap + 1, step)
             if (refuse_from is None or b < refuse_from) and peak(b) <= usable]
  return max(fitting, default=None)


def test_a_linear_peak_takes_the_two_compiles_of_the_line_the_two_at_the_edge_and_one_below():
  peak = lambda b: 3 * GIB + b * GIB // 4
  measure, calls = by_peak(peak, 15 * GIB)
  edge = find_edge(measure, step=4, usable=15 * GIB, start=8)
  assert edge.max_micro_batch == brute_force(peak, 15 * GIB, 4, 1 << 14) == 48
  assert edge.above == 52 and "peak 16.00 GiB > usable 15.00 GiB" == edge.refused_because
  assert calls == [8, 16, 48, 44, 52]  # 48 is within BAND of the limit: 44, clear of it, vouches below
  assert edge.search_unfinished is None and edge.fits_above == ()


def test_a_line_that_bends_near_the_limit_is_bisected_to_the_same_edge():
  # Temp grows faster past 32 sequences (the compiler rematerialises): the line overshoots.
  peak = lambda b: 2 * GIB + b * GIB // 8 + max(0, b - 32) * GIB // 2
  measure, calls = by_peak(peak, 12 * GIB)
  edge = find_edge(measure, step=4, usable=12 * GIB, start=8)
  assert edge.max_micro_batch == brute_force(peak, 12 * GIB, 4, 1 << 14)
  assert edge.above == edge.max_micro_batch + 4
  assert len(calls) <= 8 and len(set(calls)) == len(calls)  # no compile twice


def test_a_compiler_refusal_is_the_edge_and_its_message_says_why():
  peak = lambda b: b * GIB // 8
  measure, _ = by_peak(peak, 100 * GIB, refuse_from=40)
  edge = find_edge(measure, step=8, usable=100 * GIB, start=8)
  assert (edge.max_micro_batch, edge.above) == (32, 40)
  assert edge.refused_because == "RESOURCE_EXHAUSTED at 40"


def test_a_start_above_the_limit_searches_down():
  peak = lambda b: 2 * GIB + b * GIB // 4
  measure, _ = by_peak(peak, 10 * GIB)
  edge = find_edge(measure, step=2, usable=10 * GIB, start=64)
  assert (edge.max_micro_batch, edge.above) == (32, 34)


def test_nothing_fits_when_the_smallest_micro_batch_does_not():
  measure, calls = by_peak(lambda b: 20 * GIB + b, 16 * GIB)
  edge = find_edge(measure, step=4, usable=16 * GIB, start=16)
  assert edge.max_micro_batch is None and edge.above == 4 and calls == [16, 4]


def test_the_cap_ends_a_search_where_everything_fits():
  measure, _ = by_peak(lambda b: b, 2**60)
  edge = find_edge(measure, step=4, usable=2**60, start=8, cap=256)
  assert (edge.max_micro_batch, edge.above, edge.refused_because) == (256, None, None)


def test_the_line_and_rounding():
  assert round_down(7, 4) == 4 and round_down(1, 4) == 4
  assert line_limit(probe(8, 10, True), probe(16, 10, True), 50, 4) is None  # flat: no prediction
  assert line_limit(probe(8, None, False, "x"), probe(16, 18, True), 50, 4) is None


@settings(max_examples=200, derandomize=True, deadline=None)
@given(base=st.integers(0, 20), slope=st.integers(1, 64), bend_at=st.integers(1, 200),
       bend=st.integers(0, 64), usable=st.integers(1, 200), step=st.sampled_from([1, 2, 4, 8]),
       start=st.integers(1, 256))
@example(base=0, slope=1, bend_at=1, bend=0, usable=1, step=1, start=1)
def test_any_rising_peak_gives_the_brute_force_edge(base, slope, bend_at, bend, usable, step, start):
  """Whatever the line's error, the edge is the largest micro-batch that fits, one step below a refusal."""
  peak = lambda b: (base + slope * b + bend * max(0, b - bend_at)) * GIB // 16
  measure, calls = by_peak(peak, usable * GIB)
  edge = find_edge(measure, step=step, usable=usable * GIB, start=start, cap=4096, max_compiles=400)
  expected = brute_force(peak, usable * GIB, step, 4096)
  assert edge.max_micro_batch == expected
  assert edge.above == (step if expected is None else expected + step)
  assert len(set(calls)) == len(calls)


def test_a_flat_start_then_a_line_is_not_compiled_at_the_cap():
  # A small model at small micro-batches: the fixed part dominates and the line is nearly flat.
  peak = lambda b: 40 * GIB + max(0, b - 64) * GIB // 4
  measure, calls = by_peak(peak, 60 * GIB)
  edge = find_edge(measure, step=8, usable=60 * GIB, start=8)
  assert edge.max_micro_batch == brute_force(peak, 60 * GIB, 8, 1 << 14) == 144
  assert edge.above == 152 and max(calls) <= 8 * 16 + 64 and len(calls) <= 9, calls


def test_a_noisy_peak_ends_on_a_fitting_batch_below_a_refused_one():
  # The compiler's peaks wobble by a few MiB between neighbouring micro-batches.
  wobble = [0, 7, -5, 3, -8, 6, -2, 9, -6, 1]
  peak = lambda b: 2 * GIB + b * GIB // 64 + wobble[(b // 8) % 10] * 2**20 * 8
  measure, calls = by_peak(peak, 40 * GIB)
  # A step is 1/8 GiB here: the BAND below the limit (1.2 GiB) holds ten of them, each compiled.
  edge = find_edge(measure, step=8, usable=40 * GIB, start=8, max_compiles=30)
  assert peak(edge.max_micro_batch) <= 40 * GIB < peak(edge.above) and edge.above == edge.max_micro_batch + 8
  assert abs(edge.max_micro_batch - 38 * 64) <= 16 and len(calls) <= 24, calls
  assert edge.search_unfinished is None
  assert all(peak(b) <= 40 * GIB for b in range(edge.max_micro_batch, int(38 * 64 * 0.96), -8))


@pytest.mark.parametrize("start", [4, 8, 40, 200])
def test_a_linear_search_needs_at_most_six_compiles(start):
  peak = lambda b: 7 * GIB + b * 3 * GIB // 32
  measure, calls = by_peak(peak, 15 * GIB)
  edge = find_edge(measure, step=4, usable=15 * GIB, start=start)
  assert edge.max_micro_batch == brute_force(peak, 15 * GIB, 4, 1 << 14)
  assert len(calls) <= 6, calls


def saturating(limit, per_sequence, noise, seed=0):
  """XLA's GPU scheduler near the limit (h200:8, a 1.21B bf16 decoder): the peak rises with the micro-batch,
  then sits within +-``noise`` of ``limit`` in no order, landing above or below it."""
  import random

  wobble = random.Random(seed)
  table = {}

  def peak(batch):
    if batch not in table:
      rising = 4 * GIB + batch * per_sequence
      landed = int(limit * (1 + wobble.uniform(-noise, noise)))
      table[batch] = rising if rising < limit * (1 - noise) else landed
    return table[batch]

  return peak


@pytest.mark.parametrize("seed", range(6))
def test_a_saturating_non_monotonic_peak_gives_one_edge_from_any_start_at_the_default_budget(seed):
  usable = 105 * GIB
  peak = saturating(usable, 12 * GIB // 8, 0.015, seed)
  edges = set()
  for start in (8, 48):
    measure, calls = by_peak(peak, usable)
    edge = find_edge(measure, step=8, usable=usable, start=start)  # the planner's budget, MAX_COMPILES
    assert edge.search_unfinished is None and edge.above == edge.max_micro_batch + 8
    # Every micro-batch compiled at or below the edge fits; the one above does not.
    assert all(peak(b) <= usable for b in calls if b <= edge.max_micro_batch) and peak(edge.above) > usable
    assert all(peak(b) <= usable for b in edge.fits_above)
    edges.add(edge.max_micro_batch)
  assert len(edges) == 1, edges
  first_failure = next(b for b in range(8, 1 << 12, 8) if peak(b) > usable)
  assert edges == {first_failure - 8}


def test_fits_above_names_the_compiles_that_fit_past_a_refusal():
  peaks = {8: 10, 16: 20, 24: 101, 32: 99, 40: 120}
  measure = lambda b: probe(b, peaks.get(b, 200), peaks.get(b, 200) <= 100)
  edge = find_edge(measure, step=8, usable=100, start=32)
  assert (edge.max_micro_batch, edge.above) == (16, 24) and edge.fits_above == (32,)


def test_a_spent_budget_is_said():
  peak = lambda b: 3 * GIB + b * GIB // 4
  measure, calls = by_peak(peak, 15 * GIB)
  edge = find_edge(measure, step=4, usable=15 * GIB, start=8, max_compiles=3)
  assert len(calls) == 3 and "3 compiles ran out" in edge.search_unfinished
  assert edge.max_micro_batch is not None and peak(edge.max_micro_batch) <= 15 * GIB


def sharp_bend(b):
  """Flat while a fixed part dominates, then steep: the line from the flat part overshoots far."""
  return 40 * GIB + b * GIB // 20 + max(0, b - 200) * 2 * GIB


@pytest.mark.parametrize("start", [8, 48, 176])
def test_a_sharp_bend_is_found_at_the_default_budget(start):
  measure, calls = by_peak(sharp_bend, 60 * GIB)
  edge = find_edge(measure, step=8, usable=60 * GIB, start=start)  # the planner's budget, MAX_COMPILES
  assert edge.search_unfinished is None, (edge.search_unfinished, calls)
  assert (edge.max_micro_batch, edge.above) == (200, 208), calls
  assert len(calls) <= MAX_COMPILES


def test_a_sharp_bend_a_smaller_budget_cannot_finish_is_said_and_not_wrong():
  measure, calls = by_peak(sharp_bend, 60 * GIB)
  edge = find_edge(measure, step=8, usable=60 * GIB, start=8, max_compiles=12)
  assert len(calls) == 12 and "compiles ran out" in edge.search_unfinished
  assert sharp_bend(edge.max_micro_batch) <= 60 * GIB and edge.max_micro_batch <= 200


def _split_row(micro, ga, fits, seconds, calibrated=None):
  from nnx_zero1_plan.row import Figures, Made, Row

  figures = Figures(predicted_step_s=seconds, calibrated_step_s=calibrated)
  return Row("zero1", "one", "v5e:2x2", "TPU", {"data": 4}, "m:f", micro, figures, Made(), 9, 9, fits)


def test_a_global_batch_is_split_largest_first_then_smaller_while_faster():
  from nnx_zero1_plan.search import split_global_batch

  compiled = []

  def row_at(micro, ga, times):
    compiled.append(micro)
    return _split_row(micro, ga, micro <= 16, times[micro])

  # 64 sequences over a batch unit of 4: 64, 32 and 16 tried; 16 fits first; 8 is faster; 4 is slower.
  row = split_global_batch(lambda m, ga: row_at(m, ga, {64: 1, 32: 1, 16: 0.5, 8: 0.4, 4: 0.45}), 64, 4)
  assert (row.batch, row.ga, compiled) == (8, 8, [64, 32, 16, 8, 4])
  assert row.to_json()["ga"] == 8 and "ga" not in _split_row(8, 1, True, 0.1).to_json()
  # Calibrated times rank where both have one: here they reverse the predicted order.
  times = {8: (0.4, 0.5), 4: (0.45, 0.3), 2: (0.5, 0.6)}
  row = split_global_batch(lambda m, ga: _split_row(m, ga, True, *times[m]), 8, 2)
  assert (row.batch, row.ga) == (4, 2)
  # Nothing fits: the last compile, refused, says so; a unit that divides nothing is refused in one line.
  nothing = split_global_batch(lambda m, ga: _split_row(m, ga, False, None), 8, 4)
  assert (nothing.batch, nothing.ga, nothing.verdict) == (4, 2, False)
  with pytest.raises(PlanError, match="--global-batch 6 is not a multiple of the batch axes' size, 4"):
    split_global_batch(lambda m, ga: _split_row(m, ga, True, 1.0), 6, 4)


def test_splits_close_to_the_fastest_are_run_and_the_fastest_measured_chosen():
  from nnx_zero1_plan.row import Measured
  from nnx_zero1_plan.search import split_global_batch

  row_at = lambda m, ga: _split_row(m, ga, m <= 8, 1 + 0.01 * ga)  # noqa: E731
  ran = split_global_batch(row_at, 32, 1, run=lambda r: Measured(r.batch, 0.4 if r.batch == 4 else 0.5))
  assert (ran.batch, ran.ga) == (4, 8)
  assert [(s.batch, s.step_s, s.time) for s in ran.splits] == [
      (32, 1.01, "predicted"), (16, 1.02, "predicted"), (8, 0.5, "measured"), (4, 0.4, "measured")]


def test_a_refusal_for_memory_does_not_fit_and_one_for_another_reason_has_no_verdict():
  from nnx_zero1_plan.row import Figures, HbmOom
  from nnx_zero1_plan.search import fits_in

  assert fits_in(Figures(peak_bytes_per_device=10), 12)
  assert fits_in(Figures(peak_bytes_per_device=13), 12) is False
  assert fits_in(Figures(hbm_oom=HbmOom(16, 12, "temp")), 12) is False
  assert fits_in(Figures(error="TypeError: ..."), 12) is None


@pytest.mark.parametrize("settings, words", [
    ({"batch": 8}, "leave out --batch"), ({"ga": 4}, "leave out --ga"),
    ({"search": True}, "leave out --search"),
    ({"global_batch": 0}, ">= 1; got 0"), ({"levers": "offload-fraction"}, "searches its share"),
    ({"model": "maxtext:qwen3-0.6b", "steps": "split"}, "sets its micro-batch and GA in its config"),
])
def test_a_global_batch_is_refused_beside_what_would_choose_the_split_for_it(settings, words):
  from nnx_zero1_plan import PlanRequest

  request = {"model": "m:f", "topology": "v5e:2x2", "global_batch": 32, **settings}
  with pytest.raises(PlanError, match=words):
    PlanRequest(**request)


class _Jax0102Stats:
  """A TPU program's memory analysis as jax 0.10.2 (the v5e VM's) returns it: no ``total_allocation_bytes``,
  a ``peak_memory_in_bytes``. The figures are a 702M bfloat16 decoder under ``nnx.scan`` with remat at
  micro-batch 46, seq 1024, compiled for one v5e chip, which the chip runs (2,530 ms a step)."""

  argument_size_in_bytes = int(3.925 * GIB)
  output_size_in_bytes = 0
  alias_size_in_bytes = 0
  temp_size_in_bytes = int(15.166 * GIB)
  peak_memory_in_bytes = int(15.718 * GIB)
  host_argument_size_in_bytes = 0


class _Compiled:
  def __init__(self, stats):
    self.stats = stats

  def memory_analysis(self):
    return self.stats


def test_the_peak_is_the_compilers_own_on_jax_0_10_2_as_on_newer_jax():
  """On jax 0.10.2 the peak is ``peak_memory_in_bytes``, not the sum (19.09 GiB, which refused the edge the
  chip runs): within 0.1 GiB of the newer jax's ``total_allocation_bytes`` for the same program (15.72 GiB),
  and it fits one v5e chip's usable memory where the sum did not."""
  from nnx_zero1_plan.compiled import memory
  from nnx_zero1_plan.row import Figures
  from nnx_zero1_plan.search import fits_in

  usable_v5e = 16_909_336_064  # the chip's bytes_limit, the plans' usable memory on one v5e
  mem = memory(_Compiled(_Jax0102Stats()))
  assert mem["formula_peak"] / GIB == pytest.approx(19.09, abs=0.01)
  assert abs(mem["peak"] - int(15.72 * GIB)) < 0.1 * GIB
  assert fits_in(Figures(peak_bytes_per_device=mem["peak"]), usable_v5e)
  assert not fits_in(Figures(peak_bytes_per_device=mem["formula_peak"]), usable_v5e)
  newer = type("Stats", (_Jax0102Stats,), {"total_allocation_bytes": int(15.72 * GIB)})
  assert memory(_Compiled(newer()))["peak"] == int(15.72 * GIB)
  bare = type("Stats", (), {k: v for k, v in vars(_Jax0102Stats).items() if k != "peak_memory_in_bytes"})
  assert memory(_Compiled(bare()))["peak"] == mem["formula_peak"]  # the sum only where neither exists
