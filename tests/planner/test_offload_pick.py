"""The ``offload-fraction`` lever's pick: the smallest share of the optimizer state to put in host memory
so that the step fits, from the compiled bytes (pure here: the compiles are stand-in functions)."""

import dataclasses
import math

import pytest

from nnx_zero1_plan.inputs import parse_model
from nnx_zero1_plan.levers import with_offload
from nnx_zero1_plan.printed_code import lever_code
from nnx_zero1_plan.row import Figures
from nnx_zero1_plan.search import next_fraction, offload_search
from nnx_zero1_plan.table import table
from tests.support.rows import make_row

MIB = 2**20
STATE = 400 * MIB


def compiles(peak_at):
  """A stand-in for the planner's compile of the lever with a fraction offloaded: its row, and a log."""
  log = []

  def row_with(fraction):
    log.append(fraction)
    peak = peak_at(fraction)
    device = int(STATE * (1 - fraction))
    return make_row("offload-fraction", peak_bytes_per_device=peak, compile_s=1.0,
                    opt_state_bytes_by_memory_kind={"device": device, "pinned_host": STATE - device},
                    opt_state_bytes_per_device=device)

  return row_with, log


@pytest.mark.parametrize("usable_mib", [1000, 990, 901, 850, 700, 620])
def test_the_pick_is_the_smallest_hundredth_that_fits_when_offload_saves_its_bytes(usable_mib):
  usable = usable_mib * MIB
  row_with, log = compiles(lambda f: 600 * MIB + int(STATE * (1 - f)))  # every offloaded byte leaves the peak
  row = offload_search(row_with, usable)
  smallest = max(0.0, math.ceil((1000 - usable_mib) / 400 * 100) / 100)
  assert row.offloaded.offload_fraction == pytest.approx(smallest)
  assert row.figures.peak_bytes_per_device <= usable and row.offloaded.offload_refused_because is None
  assert len(log) == (1 if smallest == 0 else 2)  # Zero-1's compile, then one that confirms
  assert [t.fraction for t in row.offloaded.offload_search] == log
  assert row.figures.compile_s == len(log)


def test_a_guess_that_misses_moves_up_by_what_it_missed():
  # The compiler keeps a third of each offloaded byte live (copies at the peak): the first guess misses.
  row_with, log = compiles(lambda f: 600 * MIB + int(STATE * (1 - f)) + int(STATE * f / 3))
  row = offload_search(row_with, 850 * MIB)
  assert log[0] == 0.0 and log[1] == pytest.approx(0.38) and len(log) == 3  # the line through two finds it
  assert row.offloaded.offload_search[-1].fits and row.figures.peak_bytes_per_device <= 850 * MIB
  assert all(not t.fits for t in row.offloaded.offload_search[:-1])


def test_when_even_the_whole_state_cannot_make_it_fit_the_row_says_why():
  row_with, log = compiles(lambda f: 600 * MIB + int(STATE * (1 - f)))
  row = offload_search(row_with, 500 * MIB)  # 500 MiB over, the state is 400
  assert log == [0.0]
  assert "more than the 0.39 GiB of state still on device saves" in row.offloaded.offload_refused_because
  assert "no fraction fits" in table([dataclasses.replace(row, fits=False)])


def test_a_compiler_refusal_ends_the_pick_with_its_words():
  row_with, log = compiles(lambda f: 0)
  refused = lambda f: dataclasses.replace(row_with(f), figures=Figures(error="CompileTimeHbmOom: 17 GiB",
                                                                        compile_s=1.0))
  row = offload_search(refused, 100 * MIB)
  assert row.offloaded.offload_refused_because == "CompileTimeHbmOom: 17 GiB" and len(log) == 1


def test_next_fraction_rounds_up_to_a_hundredth_and_refuses_more_than_the_state():
  assert next_fraction(110, 100, 40) == 0.25
  assert next_fraction(101, 100, 300) == 0.01
  assert next_fraction(100, 100, 40, 0.5) == 0.5
  assert next_fraction(141, 100, 40) is None


def test_the_lever_code_writes_the_picked_fraction_in_each_home():
  assert with_offload("offload-fraction", 0.0).optimizer_options == {"offload_state_to_host": False}
  assert lever_code("offload-fraction", parse_model("my.models:build"), 0.37).endswith(
      "Zero1Optimizer(model, optax.adamw(1e-5), mesh, offload_state_to_host=0.37)"
      "  # 1e-5: your learning rate (or an optax schedule)")
  assert lever_code("offload-fraction", parse_model("tunix:qwen3_0p6b"), 0.5).endswith(
      "zero1_data_axis='data', zero1_offload_state_to_host=0.5))"
      "  # 1e-5: your learning rate (or an optax schedule)")
  assert lever_code("offload-fraction", parse_model("maxtext:qwen3-0.6b"), 0.25).endswith(
      "subclassed with OFFLOAD_STATE_TO_HOST = 0.25")
