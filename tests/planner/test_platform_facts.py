"""The platform's and a compiled program's small facts, once doctests of their modules: the chip table's GPU
names, a GPU described to its compiler, the install lines, jax's pool, a program's classes of work, a
convolution's window and taps, a TPU refusal's older wording, a program's compiler cost."""

import jax
import jax.numpy as jnp

from nnx_zero1_plan import compilers
from nnx_zero1_plan.chips import CHIPS, chip_of
from nnx_zero1_plan.compiled import cost, hbm_oom, step_flops
from nnx_zero1_plan.gpu_chips import GPU_CHIPS, target_config
from nnx_zero1_plan.hlo_flops import _taps, _window
from nnx_zero1_plan.inputs import BACKENDS
from nnx_zero1_plan.program_record import ProgramRecord
from nnx_zero1_plan.row import HbmOom
from nnx_zero1_plan.targets import gpu_pool_bytes, usable_bytes


def test_the_chip_table_names_each_chip_and_its_platform_is_a_backend():
  assert (chip_of("NVIDIA H100 80GB HBM3"), chip_of("TPU v6 lite")) == ("h100", "v6e")
  assert {chip.platform for chip in CHIPS.values()} == set(BACKENDS)
  assert round(CHIPS["v6e"].compute.clock_hz / 1e9, 3) == 1.751
  assert 'device_description_str: "NVIDIA H100 80GB HBM3"' in target_config(GPU_CHIPS["h100"])


def test_install_lines_pool_and_reserve():
  assert compilers.gpu_install_hint("0.12.0.1") == (
      "pip install --no-deps jax-cuda13-plugin==0.12.0.1 jax-cuda13-pjrt==0.12.0.1 (Python >= 3.12)")
  assert compilers.lockfile_holders("/nonexistent/libtpu_lockfile") == []
  assert compilers.clear_stale_lockfile("/nonexistent/libtpu_lockfile") is False
  assert gpu_pool_bytes("h200") == 112583507967  # 112,583,507,968 B measured on an H200
  tpu = BACKENDS["tpu"]
  assert (usable_bytes(1000, tpu), usable_bytes(1000, tpu, margin=0.05)) == (1000, 950)
  assert usable_bytes(2**30, BACKENDS["cuda"]) == 805306368


def test_a_record_grades_each_instruction_by_its_class_and_kind_of_work():
  record = ProgramRecord.read("""HloModule m, num_partitions=2
%g (p: f32[8,8]) -> f32[8,8] {
  ROOT %d = f32[8,8]{1,0} dot(%p, %p), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
ENTRY %main (p: f32[8,8]) -> f32[8,8] {
  %f = f32[8,8]{1,0} fusion(%p), calls=%g, backend_config={"estimated_cycles":"12"}
  ROOT %ar = f32[8,8]{1,0} all-reduce(%f), replica_groups={}, to_apply=%add
}""")
  f, ar = record.computations["main"]
  assert (record.runs, f.work, f.kind) == ({"main": 1, "g": 1}, "matmul-f32", "matmul")
  assert ar.collective.groups(record.devices) == ((0, 1),)


def test_a_convolutions_window_and_the_taps_that_land_on_its_input():
  assert _window("size=1x16 pad=0_0x15_15 rhs_reversal=0x1") == [(0, 1, 1, (0, 0), 1, 1),
                                                                (1, 16, 1, (15, 15), 1, 1)]
  assert _window("size=8x16 stride=7x15 lhs_dilate=8x16")[1] == (1, 16, 15, (0, 0), 16, 1)
  assert (_taps(8, 8, 7, (0, 0), 8, 1), _taps(4, 3, 1, (1, 1), 1, 1)) == (1.0, 2.5)


def test_a_refusals_numbers_and_a_programs_cost_and_flops():
  message = ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the total memory "
             "required for HLO temporaries (52.59G) exceeds available HBM (31.24G). HLO module: jit")
  assert hbm_oom(message) == HbmOom(56468082524, 33543694581, "HLO temporaries")
  assert hbm_oom("Used 2.00T of 15.48G hbm. Exceeded hbm capacity by 1.98T.").available_bytes == 16621523435
  assert cost(jax.jit(lambda x: x * 2).lower(jnp.ones(4)).compile())["flops"] == 4
  compiled = jax.jit(lambda a, b: a @ b).lower(jnp.ones((2, 3)), jnp.ones((3, 4))).compile()
  assert step_flops(compiled, ProgramRecord.read(compiled.as_text())) == (48, "hlo_dots")
