"""The planner's pure helpers of inputs, levers, the mesh and the recommendation's notes, each held to what
it says."""

import pytest

from nnx_zero1_plan.inputs import PlanError, error_line, lora_modules, shortened
from nnx_zero1_plan.levers import (
  LEVERS,
  adds_memory,
  lever_blocker,
  memory_twin,
  narrowed_dtypes,
  splits_nothing,
  state_axes,
  summed_over,
)
from nnx_zero1_plan.mesh_axes import check_axis_names, check_replica, mesh_axes, micro_batch
from nnx_zero1_plan.recommend import narrowed_note, saves_little, thin_note
from nnx_zero1_plan.request import PlanRequest
from nnx_zero1_plan.row import Collectives, Figures, Made, MaxTextConfig, Row, StateSplit
from nnx_zero1_plan.way_out import changes_to_try

G = 2**30


def test_inputs_one_line_refusals_and_lora():
  assert error_line(ValueError("no   room")) == "ValueError: no room"
  assert shortened("RESOURCE_EXHAUSTED: HLO temporaries exceed HBM", 30) == "RESOURCE_EXHAUSTED: HLO ..."
  assert lora_modules("qwen3_1p7b").startswith(".*q_proj|.*k_proj|.*v_")
  assert "einsum" in lora_modules("gemma3_4b_pt")


def test_levers_axes_and_what_each_changes():
  assert state_axes(LEVERS["zero1-pod"]) == ("replica", "data")
  assert state_axes(LEVERS["baseline"]) == ("data",)
  assert summed_over(("replica", "data"), ("data",)) == ("replica", "data")
  assert summed_over(("data",), ("data",)) == ("data",)
  assert lever_blocker("zero1-master", {"float32"}) == (
      "zero1-master keeps float32 copies of narrower parameters; these are float32 already")
  assert lever_blocker("zero1-bf16state", {"bfloat16"}) is not None
  assert lever_blocker("zero1", {"float32"}) is None
  for name in ("zero1-accum-bf16across", "zero1-pod-master-accum-int8across"):
    assert lever_blocker(name, {"float32"}, domains=2) is None
  assert lever_blocker("zero1-accum-int8across", {"bfloat16"}, domains=2) is None
  assert adds_memory("zero1-master") == "float32 master copies of the parameters (split over the data axes)"
  assert adds_memory("offload") is None
  assert adds_memory("baseline") == "the whole optimizer state on every device (nothing split)"
  assert narrowed_dtypes(LEVERS["zero1-pod-master-accum-int8across"]) == {
      "across_dtype": "int8", "params_across_dtype": "int8"}
  assert memory_twin("zero1-pod-accum-int8across") == "zero1-pod-accum"
  assert memory_twin("zero1-pod-master-accum-int8across") == "zero1-pod-master-accum"


def test_a_lever_splits_nothing_by_the_mesh_or_by_its_compiled_layout():
  assert splits_nothing("zero2", {"data": 1, "fsdp": 8})
  assert not splits_nothing("zero1", {"data": 4})
  assert not splits_nothing("offload", {"data": 1}) and not splits_nothing("baseline", {"data": 1})
  # Compiled: the share of the state split over axes larger than one device.
  nothing = StateSplit(["replica", "data"], {"none": 1.0})
  assert splits_nothing("zero1-pod", {"replica": 3, "data": 4}, nothing)
  over_data = StateSplit(["replica", "data"], {"data": 0.998, "none": 0.002})
  assert not splits_nothing("zero1-pod", {"replica": 3, "data": 4}, over_data)
  assert splits_nothing("zero1-pod", {"replica": 1, "data": 1}, over_data)


def test_the_mesh_refusals_say_what_would_be():
  assert mesh_axes({"data": 4, "fsdp": 2}, ["fsdp", "tp"], devices=8) == {"data": 4, "fsdp": 2, "tp": 1}
  assert mesh_axes({}, [], devices=16, domains=2) == {"replica": 2, "data": 8}
  assert micro_batch(None, 4, "data") == 8 and micro_batch(16, 8, "data") == 16
  assert micro_batch(None, 64, "replica x data") == 64
  with pytest.raises(PlanError, match=r"replica must be the outermost axis.*--mesh replica=2,data=8$"):
    check_replica({"data": 8, "replica": 2}, domains=2, where="nodes")
  with pytest.raises(PlanError, match="unknown --mesh axis dta; axes the model names or the planner splits "
                                      "over: replica, data, fsdp, tp$"):
    check_axis_names({"dta": 4}, ["fsdp", "tp"])


def _row(lever, figures, fits=True, batch=16, mesh=None):
  return Row(lever, "one", "v5e:2x4", "TPU", mesh or {"data": 8}, "m", batch, figures, Made(depth=2), 81 * G,
             80 * G, fits)


def test_the_recommendations_notes():
  thin = _row("zero1-pod", Figures(headroom_bytes_per_device=G // 20), batch=128)
  assert thin_note(thin, 128) == (
      "thin: zero1-pod at micro-batch 128 leaves 0.05 GiB of 80.00 GiB usable free (0.06%, under 1%); near "
      "its limit the compiler lands within about 1.5% either side: a smaller micro-batch or --margin leaves "
      "room")
  state = lambda n: Figures(opt_state_bytes_per_device=n, peak_bytes_per_device=4 * G)
  rows = [_row("baseline", state(48 * 2**20)), _row("zero1", state(6 * 2**20))]
  assert saves_little(rows[1], rows) == (
      "zero1 saves little here: 0.04 GiB of optimizer state per device, 1.0% of the baseline's 4.00 GiB peak "
      "(under 1.5%, the compiler's own scatter near its limit): nnx.Optimizer is as good")
  assert narrowed_note("zero1") is None
  assert narrowed_note("zero1-accum-bf16across").startswith("zero1-accum-bf16across is not bit-identical:")


def test_the_way_outs_changes_lightest_first():
  request = PlanRequest("tunix:qwen3_8b", "h100:8").resolved({"data": 4, "fsdp": 2}, 16)
  changes = changes_to_try(request, lever="zero1", batch_unit=4, remat="block", named_axes=["fsdp"])
  assert [c.what for c in changes] == [
      "micro-batch 8, 2x the accumulation (the same tokens per step)",
      "micro-batch 4, 4x the accumulation (the same tokens per step)", "remat block",
      "fsdp=4 (data=2): parameters and gradients split too", "the optimizer state in host memory"]


def test_records_read_plan_jsons_objects():
  c = Collectives.from_json({"per_step": {"all-reduce": {"count": 2, "bytes": 6}}})
  assert (c.per_step["all-reduce"].count, c.sent_bytes, c.across_bytes) == (2, 6, 0)
  assert c.to_json() == {"per_step": {"all-reduce": {"count": 2, "bytes": 6}}}
  config = MaxTextConfig("qwen3-0.6b", "ShardMode.EXPLICIT", "None", False, "bfloat16", "float32",
                         "OptimizerType.ADAMW", 28, 8, 64, True)
  assert config.to_json()["num_decoder_layers"] == "28"
  assert MaxTextConfig.from_json(config.to_json()) == config
