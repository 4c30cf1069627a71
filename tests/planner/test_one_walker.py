"""One reading of a compiled program: the FLOP count, the step-time walk and the byte counts run the same
computations the same number of times (``nnx_zero1._src.hlo.executions``) and know the same collectives
(``collective_of``): a ``call``, a conditional's branches, an async all-gather and a collective-permute."""

from __future__ import annotations

from nnx_zero1.testing import collectives, sent_bytes
from nnx_zero1_plan.hlo_flops import dot_flops
from nnx_zero1_plan.step_time import Rates, program_time

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


def test_every_reader_counts_the_call_and_the_heavier_branch_once():
  assert dot_flops(HLO) == 2 * MATMUL  # the call's and the chosen (heavier) branch's; the light one has none
  walk = program_time(HLO, Rates(clock_hz=1e9, network_bytes_per_s=lambda n: 1e9))
  assert round(walk.compute_s * 1e9) == 500 + 1000  # the call's cycles and the heavier branch's, not 10


def test_every_reader_knows_the_same_collectives():
  counted = collectives(HLO)
  sent = sent_bytes(HLO)
  walk = program_time(HLO, Rates(clock_hz=1e9, network_bytes_per_s=lambda n: 1.0))
  assert counted["all-gather"] == {"count": 1, "bytes": 32 * 8 * 4}
  assert counted["collective-permute"] == {"count": 1, "bytes": 8 * 8 * 4}
  assert walk.collectives == sum(c["count"] for c in counted.values()) == 2
  # The walk's network time at one byte a second is the bytes one device sends, as sent_bytes counts them.
  assert round(walk.collective_s) == sum(c["bytes"] for c in sent.values()) == 3 * 8 * 8 * 4 + 8 * 8 * 4
