"""Tunix's activation sharding constraints in the planner (``nnx_zero1_plan/tunix_sharding.py``): the specs
a ``--tunix-sharding`` option gives on a mesh, and a ``tunix:`` model's step traced with them on CPU devices,
where Tunix's own ``shard`` would apply none."""

import importlib
import importlib.util

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh

from nnx_zero1_plan import parse_args
from nnx_zero1_plan.inputs import PlanError
from nnx_zero1_plan.request import PlanRequest
from nnx_zero1_plan.tunix_sharding import activation_specs, specs_for

# google-tunix 0.1.7's llama3 ShardingConfig.get_default_sharding(): its activation fields.
LLAMA3 = {"act_btd": ("fsdp", None, "tp"), "act_btf": ("fsdp", None, "tp"),
          "act_btnh": ("fsdp", None, "tp", None)}
MESH = ("data", "fsdp", "tp")
HAS_TUNIX = importlib.util.find_spec("tunix") is not None


def test_batch_entries_gain_the_meshs_data_axes_and_lose_the_axes_it_lacks():
  on_mesh = activation_specs(LLAMA3, MESH)
  assert on_mesh == {"act_btd": (("data", "fsdp"), None, "tp"), "act_btf": (("data", "fsdp"), None, "tp"),
                     "act_btnh": (("data", "fsdp"), None, "tp", None)}
  # On a pod, as the batch itself is split: replica, data, fsdp.
  assert activation_specs(LLAMA3, ("replica", *MESH))["act_btd"][0] == ("replica", "data", "fsdp")
  assert activation_specs({"act_btd": (("data", "fsdp"), None, None)}, ("data", "fsdp")) == {
      "act_btd": (("data", "fsdp"), None, None)}  # a data axis already there is not added twice
  # qwen3 with sequence parallelism names sp; a mesh without sp or tp keeps fsdp alone.
  assert activation_specs({"act_btd": ("fsdp", "sp", "tp")}, ("fsdp",)) == {"act_btd": ("fsdp", None, None)}
  assert activation_specs(LLAMA3, ("data", "fsdp"), add_data_axes=False)["act_btd"] == ("fsdp", None, None)


def test_tunix_sharding_none_and_a_json_object_of_fields():
  assert specs_for(LLAMA3, "none", MESH) is None
  assert specs_for(LLAMA3, "default", MESH) == activation_specs(LLAMA3, MESH)
  # As given: the batch entry keeps what the mesh has (no replica here), the fields left out stay Tunix's.
  given = specs_for(LLAMA3, '{"act_btd": [["replica", "data", "fsdp"], null, "tp"]}', MESH)
  assert given == {**LLAMA3, "act_btd": (("data", "fsdp"), None, "tp")}
  with pytest.raises(PlanError, match="this model's activation fields: act_btd, act_btf, act_btnh"):
    specs_for(LLAMA3, '{"act_bsd": [null]}', ())
  for bad in ("xla", '["data"]', '{"act_btd": "data"}', '{"act_btd": [[1]]}'):
    with pytest.raises(PlanError, match="default or none, or a JSON object"):
      specs_for(LLAMA3, bad, ())
  assert parse_args(["--model", "tunix:qwen3_0p6b", "--topology", "h100:8"]).tunix_sharding == "default"
  with pytest.raises(PlanError, match="--tunix-sharding applies to tunix: models"):
    PlanRequest("tests.support.planner_toys:tiny_lm", "h100:8", tunix_sharding="none")


def _lowered_constraints(model: str, option: str, mesh: Mesh, lever: str = "baseline") -> list[str]:
  """The sharding constraints in the lowered one-program step of ``model`` at one layer on ``mesh``."""
  from nnx_zero1_plan.levers import LEVERS
  from nnx_zero1_plan.models import model_source
  from nnx_zero1_plan.steps import abstract_batch, lever_state, step_jit

  source = model_source(model, tunix_sharding=option)
  state = lever_state(LEVERS[lever], lambda: source.build(1), "adamw", mesh)
  tokens = abstract_batch(LEVERS[lever], mesh, 8, 16, 1)
  step = step_jit(state.graphdef, state.shardings, tokens.sharding, LEVERS[lever], source.loss_fn, 1)
  with jax.set_mesh(mesh):
    text = step.lower(state.state, tokens).as_text()
  return [line for line in text.splitlines() if "sharding_constraint" in line]


@pytest.mark.skipif(not HAS_TUNIX, reason="needs Tunix: pip install \".[tunix]\"")
def test_a_tunix_models_step_carries_its_constraints_on_cpu_devices_too():
  """Tunix's ``shard`` applies nothing on a CPU; the planner's trace applies the ShardingConfig's specs on
  the mesh, with data in the batch entries, and leaves Tunix's ``shard`` as it was afterwards."""
  from nnx_zero1_plan.models import model_source

  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("data", "fsdp", "tp"),
              axis_types=(AxisType.Auto,) * 3)
  applied = _lowered_constraints("tunix:llama3p2_1b", "default", mesh)
  # Per layer: the attention's q, k, v and output, and the embedding's output, each in the gradient too.
  assert len(applied) >= 5 and all('{"data", "fsdp"}' in line for line in applied), applied[:3]
  assert _lowered_constraints("tunix:llama3p2_1b", "none", mesh) == []
  tunix_llama3 = importlib.import_module("tunix.models.llama3.model")
  assert tunix_llama3.shard.__module__ == tunix_llama3.__name__  # Tunix's own again
  source = model_source("tunix:llama3p2_1b")
  assert source.activation_sharding is not None
  assert source.activation_sharding(mesh.axis_names)["act_btnh"] == (("data", "fsdp"), None, "tp", None)
  # Inside zero1-accum's per-replica shard_map every axis of a data-only mesh is manual: nothing to name.
  data_only = Mesh(np.array(jax.devices()[:8]).reshape(8, 1, 1), ("data", "fsdp", "tp"),
                   axis_types=(AxisType.Auto,) * 3)
  per_replica = [_lowered_constraints("tunix:llama3p2_1b", option, data_only, "zero1-accum")
                 for option in ("default", "none")]
  assert per_replica[0] == per_replica[1]
