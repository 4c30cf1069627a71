"""The step-time model's arithmetic (``nnx_zero1_plan.step_time``, ``gpu_schedule``, the recommendation by
throughput) on hand-written compiled programs: each figure computed here by hand from the HLO's bytes, the
cycles and the chip table's rates, never restated. Pure: no compiler (lane 2 times real compiles)."""

import dataclasses

import pytest

from nnx_zero1_plan.chips import CHIPS
from nnx_zero1_plan.gpu_schedule import parse_schedule
from nnx_zero1_plan.networks import at_rate, on_a_cycle, slice_shape
from nnx_zero1_plan.program_record import ProgramRecord
from nnx_zero1_plan.recommend import BY_THROUGHPUT, ORDER, by_throughput, recommend
from nnx_zero1_plan.request import PlanRequest
from nnx_zero1_plan.row import Figures, Made, Point, Row
from nnx_zero1_plan.step_time import (
  NO_ESTIMATE,
  NO_SCHEDULE,
  Rates,
  cycle_class,
  predict_step_time,
  program_time,
  rates_for,
)
from tests.support.rows import searched

CLOCK = 1e9  # a round clock: 1,000 cycles are a microsecond
RING = 1e9  # one device's ring rate, bytes per second, whatever the group

_FUSION = ('  %{name} = f32[256]{{0}} fusion(%p), kind=kLoop, calls=%c, '
           'backend_config={{"estimated_cycles":"{cycles}"}}')


def _fusion(name: str, cycles: int) -> str:
  return _FUSION.format(name=name, cycles=cycles)


def _module(entry: list[str], *others: str, partitions: int = 4) -> str:
  return "\n".join([f"HloModule jit_f, num_partitions={partitions}", *others,
                    "ENTRY %main (p: f32[256]) -> f32[256] {", *entry, "}"])


def _rates(host: float | None = None) -> Rates:
  return Rates(CLOCK, at_rate(RING), host)


def test_a_programs_classes_of_work_are_its_estimated_instructions():
  assert cycle_class(_module([_fusion("a", 12), "  ROOT %r = f32[256]{0} negate(%a)"])) == {"vector"}


def test_compute_is_the_cycles_over_the_clock():
  t = program_time(_module([_fusion("a", 3000), _fusion("b", 2000), "  ROOT %r = f32[256]{0} negate(%b)"]),
                   _rates())
  assert t.compute_s == pytest.approx(5000 / CLOCK) and t.total_s == pytest.approx(5000 / CLOCK)
  assert t.collective_s == 0 and t.unestimated == 0


def test_a_loops_trip_count_multiplies_its_body_both_spellings():
  body = "\n".join(["%body (q: (s32[], f32[256])) -> (s32[], f32[256]) {", _fusion("inner", 700), "}"])
  condition = "\n".join(["%cond (q: (s32[], f32[256])) -> pred[] {",
                         "  %n = s32[]{:T(128)} constant(6)",
                         "  %i = s32[]{:T(128)} get-tuple-element(%q), index=0",
                         "  ROOT %lt = pred[]{:T(512)} compare(%i, %n), direction=LT", "}"])
  tpu = program_time(_module(["  %w = (s32[], f32[256]) while(%t), condition=%cond, body=%body",
                              _fusion("after", 100)], body, condition), _rates())
  assert tpu.compute_s == pytest.approx((6 * 700 + 100) / CLOCK)  # the TPU compiler's counter < 6
  gpu = program_time(_module(['  %w = (s32[], f32[256]) while(%t), condition=%cond, body=%body, '
                              'backend_config={"known_trip_count":{"n":"9"}}'], body, condition), _rates())
  assert gpu.compute_s == pytest.approx(9 * 700 / CLOCK)  # XLA's annotation wins over the condition


def test_a_synchronous_collective_is_its_ring_bytes_over_the_rate_all_exposed():
  # f32[256] = 1,024 bytes, all-reduced over 4 devices: a ring sends 2 x 3/4 of it.
  t = program_time(_module([_fusion("a", 1000),
                            "  %ar = f32[256]{0} all-reduce(%a), replica_groups={{0,1,2,3}}, to_apply=%add"]),
                   _rates())
  sent = 2 * 1024 * 3 // 4
  assert t.collective_s == pytest.approx(sent / RING) and t.exposed_collective_s == pytest.approx(sent / RING)
  assert t.total_s == pytest.approx(1000 / CLOCK + sent / RING) and t.collectives == 1


@pytest.mark.parametrize("between", [200, 1000, 5000])
def test_an_async_collective_overlaps_the_compute_scheduled_inside_it(between):
  # all-gather of f32[256] results over 4: sends 3/4 of the result; 768 B at 1 GB/s = 768 ns.
  t = program_time(_module([
      "  %ag = (f32[64]{0}, f32[256]{0}) all-gather-start(%p), replica_groups={{0,1,2,3}}, dimensions={0}",
      _fusion("x", between), "  %d = f32[256]{0} all-gather-done(%ag)"]), _rates())
  collective = 768 / RING
  assert t.collective_s == pytest.approx(collective)
  assert t.exposed_collective_s == pytest.approx(max(0.0, collective - between / CLOCK))
  assert t.total_s == pytest.approx(max(collective, between / CLOCK))


def test_an_async_starts_operands_are_not_counted_as_its_result():
  # XLA's GPU form: reduce-scatter-start's shape is ((operands), (results)); each device sends (n-1) results.
  t = program_time(_module([
      "  %rs = ((f32[256]{0}, f32[512]{0}), (f32[64]{0}, f32[128]{0})) reduce-scatter-start(%p, %q), "
      "replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%add",
      "  %d = (f32[64]{0}, f32[128]{0}) reduce-scatter-done(%rs)"]), _rates())
  assert t.collective_s == pytest.approx((64 + 128) * 4 * 3 / RING)


def test_collectives_share_the_network_one_after_another():
  t = program_time(_module([
      "  %a = f32[256]{0} all-reduce-start(%p), replica_groups={{0,1}}, to_apply=%add",
      "  %b = f32[256]{0} all-reduce-start(%p), replica_groups={{0,1}}, to_apply=%add",
      "  %da = f32[256]{0} all-reduce-done(%a)", "  %db = f32[256]{0} all-reduce-done(%b)"]), _rates())
  each = 2 * 1024 * 1 // 2 / RING
  assert t.total_s == pytest.approx(2 * each) and t.exposed_collective_s == pytest.approx(2 * each)


def test_host_copies_are_timed_at_the_host_link_and_counted_without_one():
  copy = ["  %c = (f32[256]{0:S(5)}, f32[256]{0}, u32[]) copy-start(%p)",
          "  %d = f32[256]{0:S(5)} copy-done(%c)"]
  device_copy = ["  %e = (f32[256]{0:S(1)}, f32[256]{0}, u32[]) copy-start(%p)",
                 "  %f = f32[256]{0:S(1)} copy-done(%e)"]
  timed = program_time(_module(copy + device_copy), _rates(host=2e9))
  assert timed.host_s == pytest.approx(1024 / 2e9) and timed.exposed_host_s == pytest.approx(1024 / 2e9)
  assert program_time(_module(copy), _rates()).host_s is None  # no public host rate: not timed


def test_the_compilers_not_estimated_counts_zero_and_is_counted():
  t = program_time(_module([_fusion("a", 2**63 - 1), _fusion("b", 10)]), _rates())
  assert t.compute_s == pytest.approx(10 / CLOCK) and t.unestimated == 1


def test_a_program_without_cycles_has_no_time_not_a_guess():
  plain = _module(["  ROOT %r = f32[256]{0} fusion(%p), kind=kLoop, calls=%c"])
  assert program_time(plain, Rates(None, at_rate(RING))).compute_s is None
  figures = predict_step_time([("step", plain, 1)], CHIPS["v5e"], devices=4, tokens_per_device=8,
                              compute_dtype="bfloat16")
  assert figures.predicted_step_s is None and figures.time_absent == NO_ESTIMATE
  unscheduled = predict_step_time([("step", plain, 1)], CHIPS["h100"], devices=4, tokens_per_device=8,
                                  compute_dtype="bfloat16")  # a GPU's, without its scheduler's estimates
  assert unscheduled.time_absent == NO_SCHEDULE


def test_a_gpu_program_is_timed_by_its_schedulers_estimates():
  program = _module(["  %r = f32[256]{0} fusion(%p), kind=kLoop, calls=%c"])
  estimated = dataclasses.replace(ProgramRecord.read(program), estimates={"r": 1e-3})
  timed = predict_step_time([("step", estimated, 1)], CHIPS["h100"], devices=4, tokens_per_device=8,
                            compute_dtype="bfloat16")
  assert timed.predicted_step_s == pytest.approx(1e-3) and timed.time_absent is None
  assert timed.step_time.compute_s == pytest.approx(1e-3)
  assert timed.tokens_per_s_per_device == pytest.approx(8e3)


def _row_groups(size: int, rows: int) -> tuple[tuple[int, ...], ...]:
  return tuple(tuple(range(r * size, (r + 1) * size)) for r in range(rows))


def test_a_tpu_collective_runs_on_the_links_its_groups_rings_use():
  """Each figure by hand from the book's one-way link rate (v6e 9e10, v5e 4.5e10 bytes/s), the ring bytes
  and 1 us per hop: a 2x2's four chips are a cycle of four links (one
  ring at one link's rate, two at twice it); a pair has one link; a column of four on a v5e 4x4 has no
  wraparound (under 16), so its rings' way back shares their links (one link's rate whatever the rings, 3
  hops a step); a row of 16 wraps (two rings at twice the rate)."""
  v6e, v5e = rates_for(CHIPS["v6e"]).collective_s, rates_for(CHIPS["v5e"]).collective_s
  sent = 3 * 10**6  # a 4 MB all-gather's over four
  assert v6e("all-gather", sent, ((0, 1, 2, 3),), 1, 4) == pytest.approx(sent / 9e10 + 3e-6)
  assert v6e("all-gather", sent, ((0, 1, 2, 3),), 2, 4) == pytest.approx(sent / 18e10 + 3e-6)
  assert v6e("all-reduce", 2 * sent, ((0, 1, 2, 3),), 2, 4) == pytest.approx(2 * sent / 18e10 + 6e-6)
  assert v6e("all-gather", sent, ((0, 1), (2, 3)), 2, 8) == pytest.approx(sent / 9e10 + 1e-6)
  column = ((0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15))
  assert v5e("all-gather", sent, column, 2, 16) == pytest.approx(sent / 4.5e10 + 3 * 3e-6)
  assert v5e("all-gather", sent, _row_groups(16, 16), 2, 256) == pytest.approx(sent / 9e10 + 15e-6)


def test_a_slice_is_named_smallest_axis_first_and_a_group_is_a_cycle_across_axes_or_round_a_wrapped_one():
  assert (slice_shape(4, 2), slice_shape(8, 2), slice_shape(3, 2)) == ((2, 2), (2, 4), (3, 1))
  assert on_a_cycle([(0, 0), (1, 0), (0, 1), (1, 1)], (2, 2), (False, False))
  assert not on_a_cycle([(0,), (1,), (2,), (3,)], (4,), (False,))  # a line: no wraparound
  assert not on_a_cycle([(0,), (1,)], (16,), (True,))  # part of a wrapped axis
  assert on_a_cycle([(i,) for i in range(16)], (16,), (True,))


def test_a_collective_on_an_unwrapped_axis_comes_near_the_books_measured_one():
  """How to Scale Your Model (sharding.md) profiles a 34 MB all-gather over an unwrapped axis of 4 on a v5e
  at 680 us (its bidirectional ring says 377 us, its no-wrap model 560): the model, fitted to nothing here,
  comes within 20%."""
  column = ((0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15))
  gathered = rates_for(CHIPS["v5e"]).collective_s("all-gather", 34 * 10**6 * 3 // 4, column, 2, 16)
  assert gathered == pytest.approx(680e-6, rel=0.2)


def test_a_gpu_sends_at_its_switchs_rate_whatever_the_group():
  h100, v6e = CHIPS["h100"], CHIPS["v6e"]
  for group in ((0, 1), tuple(range(8))):
    sent = rates_for(h100).collective_s("all-gather", 10**9, (group,), 1, 8)
    assert sent == 10**9 / h100.links.fast_bytes_per_s
  assert rates_for(v6e).clock_hz == v6e.compute.peak_flops_per_s["bfloat16"] / v6e.compute.mxu_flops_per_cycle


def test_a_step_sums_its_programs_runs_and_the_slow_network_and_says_tokens_and_mfu():
  chip = CHIPS["v6e"]  # every cycle at one clock: no class of work measured apart
  clock = chip.compute.clock_hz
  dot = ("  %d = f32[128,128]{1,0} dot(%x, %y), lhs_contracting_dims={1}, rhs_contracting_dims={0}, "
         'backend_config={"estimated_cycles":"3000"}')
  grads = _module(["  %x = f32[128,64]{1,0} parameter(0)", "  %y = f32[64,128]{1,0} parameter(1)", dot])
  update = _module([_fusion("u", 500)])
  t = predict_step_time([("fwd_bwd", grads, 1), ("fwd_bwd_accum", grads, 7), ("update", update, 1)], chip,
                        devices=4, tokens_per_device=4096, compute_dtype="bfloat16", slow_bytes=10**6)
  predicted = (8 * 3000 + 500) / clock + 10**6 / chip.links.slow_bytes_per_s
  assert t.predicted_step_s == pytest.approx(predicted)
  assert t.tokens_per_s_per_device == pytest.approx(4096 / predicted)
  flops = 8 * 2 * 128 * 128 * 64
  assert t.mfu == pytest.approx(flops / predicted / chip.compute.peak_flops_per_s["bfloat16"])
  parts = t.step_time
  assert parts.programs == ["fwd_bwd", "fwd_bwd_accum x7", "update"]
  assert parts.slow_network == "DCN" and parts.slow_s == pytest.approx(10**6 / chip.links.slow_bytes_per_s)
  assert parts.roofline_s == pytest.approx(flops / chip.compute.peak_flops_per_s["bfloat16"])


def test_the_gpu_schedule_reads_each_instructions_estimate_a_zero_start_left_out():
  text = "\n".join(['hlo_module {', '  name: "jit_g"', '  computations {', '    instructions {',
                    '      name: "first"', '      id: 1', '    }', '    instructions {',
                    '      name: "second"', '      id: 2', '    }', '  }', '}', 'computation_schedules {',
                    '  instructions {', '    id: 1',
                    '    end_timestamp_cycles: 40', '  }', '  instructions {', '    id: 2',
                    '    start_timestamp_cycles: 40', '    end_timestamp_cycles: 100', '  }',
                    '  cycles_per_microsecond: 2', '}'])
  name, seconds = parse_schedule(text)
  assert name == "jit_g" and seconds == {"first": 20e-6, "second": 30e-6}
  walked = program_time(_module(["  %first = f32[256]{0} fusion(%p), kind=kLoop, calls=%c",
                                 "  %second = f32[256]{0} fusion(%first), kind=kLoop, calls=%c"]),
                        Rates(None, at_rate(RING)), estimates=seconds)
  assert walked.compute_s == pytest.approx(50e-6)


def _row(lever, batch, tokens_per_s, room, *, searched=None, fits=True):
  figures = Figures(predicted_step_s=None if tokens_per_s is None else batch * 64 / tokens_per_s,
                    tokens_per_s_per_device=tokens_per_s, headroom_bytes_per_device=room,
                    opt_state_bytes_per_device=100 if lever == "baseline" else 25, collectives=None)
  return Row(lever, "one", "v6e:2x2", "TPU v6 lite", {"data": 4}, "m:f", batch, figures, Made(depth=2),
             2**34, 2**34, fits, searched=searched)


_REQUEST = PlanRequest("m:f", "v6e:2x2", mesh="data=4", batch=8, seq_len=64, steps="one")  # as resolved


def test_the_recommendation_is_the_most_tokens_per_second_not_the_largest_micro_batch():
  # zero1's search fits up to 512, where the compiler recomputes to fit: 64 trains fastest.
  points = [Point(b, True, peak_bytes_per_device=b, headroom_bytes_per_device=10,
                  predicted_step_s=b * 64 / tok, tokens_per_s_per_device=tok)
            for b, tok in ((8, 1000.0), (64, 5000.0), (512, 3000.0))]
  rows = [_row("baseline", 8, 990.0, 5), _row("zero1", 8, 1000.0, 10, searched=searched(512, points))]
  rec = recommend(rows, _REQUEST)
  assert rec.order == BY_THROUGHPUT and (rec.lever, rec.micro_batch) == ("zero1", 64)
  assert "zero1 at 64:" in rec.why[0] and "baseline at 8:" in rec.why[0]
  assert "for its throughput" in rec.why[0]


def test_within_two_percent_the_headroom_decides_and_an_untimed_plan_keeps_the_memory_order():
  best, at, why, order = by_throughput([_row("baseline", 8, 1000.0, 5), _row("zero1", 8, 985.0, 9)])
  assert best.lever == "zero1" and "within 2%" in why[0] and order == BY_THROUGHPUT
  untimed = [_row("baseline", 8, None, 5), _row("zero1", 8, None, 9)]
  assert by_throughput(untimed) is None and recommend(untimed, _REQUEST).order == ORDER


_CHIP_NAMES = {"v5e": ["v5e"], "v6e": ["v6e"], "v5p": ["v5p"], "A100": ["a100-80g"],
               "H100, H200": ["h100", "h200"], "B200": ["b200"]}


def _tflops(words: str) -> float:
  return float(words.split()[0].replace(",", "")) * 1e12


def test_each_chips_compute_figures_are_docs_planners_public_figures_in_words():
  """The peaks, matrix units, ports and host links the time model divides by, against docs/planner.md's
  table of the public figures as the makers word them, converted here."""
  from tests.support.docs_tables import table_under

  rows = table_under("docs/planner.md", "| chip | bf16 peak, dense |")
  assert {r[0] for r in rows} == set(_CHIP_NAMES)
  checked = set()
  for chip, bf16, f32, units, ports, host in rows:
    for name in _CHIP_NAMES[chip]:
      c = CHIPS[name].compute
      assert c.peak_flops_per_s["bfloat16"] == _tflops(bf16), name
      f32_peak = _tflops(bf16) if f32 == "as bf16 passes" else _tflops(f32)
      assert c.peak_flops_per_s["float32"] == f32_peak, name
      count, side = (None, None) if units == "-" else (int(units.split(" x ")[0]), int(units.split("x")[-1]))
      assert c.mxu_flops_per_cycle == (None if count is None else count * side * side * 2), name
      assert c.ports == (0 if ports == "-" else int(ports)), name
      rate = None if host == "-" else float(host.split()[1]) * 1e9  # "PCIe 64 GB/s both ways"
      each_way = None if rate is None else rate if "each way" in host else rate / 2
      assert c.host_bytes_per_s == each_way, name
      checked.add(name)
  assert checked == set(CHIPS)


def test_each_class_of_work_runs_at_its_measured_clock_and_each_host_direction_on_its_own_lane():
  clocks = CHIPS["v5e"].compute.class_clocks_hz
  matmul = ("%m (a: bf16[64,64]) -> bf16[64,64] {\n  %a = bf16[64,64]{1,0} parameter(0)\n"
            "  ROOT %d = bf16[64,64]{1,0} convolution(%a, %a), window={size=1}, dim_labels=bf_io->bf\n}")
  program = _module(["  %mm = bf16[64,64]{1,0} fusion(%p), kind=kOutput, calls=%m, "
                     'backend_config={"estimated_cycles":"1000"}', _fusion("v", 1000)], matmul)
  walk = program_time(program, rates_for(CHIPS["v5e"]))
  assert walk.compute_s == pytest.approx(1000 / clocks["matmul-bf16"] + 1000 / clocks["vector"])
  copies = _module(["  %out = (f32[256]{0:S(5)}, f32[256]{0}, u32[]) copy-start(%p)",
                    "  %in = (f32[256]{0}, f32[256]{0:S(5)}, u32[]) copy-start(%p)",
                    "  %o = f32[256]{0:S(5)} copy-done(%out)", "  ROOT %i = f32[256]{0} copy-done(%in)"])
  both = program_time(copies, _rates(host=1024.0))
  assert both.host_s == pytest.approx(2.0) and both.total_s == pytest.approx(1.0)  # the two ways overlap
