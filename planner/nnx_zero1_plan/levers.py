"""The lever table (:data:`LEVERS`; a new lever is one entry): each lever an optimizer (``nnx.Optimizer``, or
``Zero1Optimizer`` with options) and a gradient accumulation (a ``lax.scan`` of ``nnx.value_and_grad``,
reduced wherever XLA puts it, or ``value_and_grad_accumulated``, reduced once per step)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from nnx_zero1_plan.inputs import PlanError
from nnx_zero1_plan.row import StateSplit

# The options that only narrow what crosses between slices or nodes.
_NARROWING = ("across_dtype", "params_across_dtype")


@dataclasses.dataclass(frozen=True)
class Lever:
  """One way to train: the optimizer's class and options, and how gradients accumulate."""

  zero1: bool = True  # Zero1Optimizer over the data axis (else nnx.Optimizer)
  deferred: bool = False  # value_and_grad_accumulated (else a lax.scan of nnx.value_and_grad)
  optimizer_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  accumulate_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  picks_offload: bool = False  # the plan picks offload_state_to_host's fraction (see run.py)


# In the order the planner suggests them: each saves more device memory than the one before. What each one
# is for, and what each -across lever gives up, is docs/planner.md's --levers.
_POD = {"data_axis": ("replica", "data")}
LEVERS: dict[str, Lever] = {
    "baseline": Lever(zero1=False),
    "zero1": Lever(),
    "zero1-pod": Lever(optimizer_options=_POD),
    "zero1-accum": Lever(deferred=True),
    "zero1-pod-accum": Lever(deferred=True, optimizer_options=_POD),
    "zero1-pod-master-accum": Lever(deferred=True, optimizer_options={**_POD, "master_dtype": "float32"}),
    "zero1-accum-bf16across": Lever(deferred=True, accumulate_options={"across_dtype": "bfloat16"}),
    "zero1-pod-accum-bf16across": Lever(deferred=True, optimizer_options=_POD,
                                        accumulate_options={"across_dtype": "bfloat16"}),
    "zero1-accum-int8across": Lever(deferred=True, accumulate_options={"across_dtype": "int8"}),
    "zero1-pod-accum-int8across": Lever(deferred=True, optimizer_options=_POD,
                                        accumulate_options={"across_dtype": "int8"}),
    "zero1-pod-master-accum-int8across": Lever(
        deferred=True, accumulate_options={"across_dtype": "int8"},
        optimizer_options={**_POD, "master_dtype": "float32", "params_across_dtype": "int8"}),
    "zero2": Lever(deferred=True, accumulate_options={"shard_accumulator": True}),
    "offload-fraction": Lever(picks_offload=True),
    "offload": Lever(optimizer_options={"offload_state_to_host": True}),
    "zero2-offload": Lever(deferred=True, optimizer_options={"offload_state_to_host": True},
                           accumulate_options={"shard_accumulator": True}),
    "zero1-bf16state": Lever(optimizer_options={"state_dtype": "bfloat16"}),
    "zero1-master": Lever(optimizer_options={"master_dtype": "float32"}),
}


def state_axes(lever: Lever) -> tuple[str, ...]:
  """The mesh axes a lever splits the optimizer state over (the baseline: ``data``, where it splits none)."""
  axes = lever.optimizer_options.get("data_axis", "data")
  return (axes,) if isinstance(axes, str) else tuple(axes)


def summed_over(mesh_axes: Sequence[str], state_axes: tuple[str, ...]) -> tuple[str, ...]:
  """The axes a deferred lever sums its gradients over: the state's, and ``replica`` first where the mesh
  has it (a pod's batch is split over it too, so a state split over ``data`` alone is all-reduced over it)."""
  if "replica" in mesh_axes and "replica" not in state_axes:
    return ("replica", *state_axes)
  return state_axes


def lever_blocker(name: str, param_dtypes: Collection[str], domains: int = 1) -> str | None:
  """Why lever ``name`` cannot change anything for parameters of ``param_dtypes`` on a target of ``domains``
  slices or nodes (None: it applies)."""
  lever, dtypes = LEVERS[name], ", ".join(sorted(param_dtypes))
  one = "this target is one (--slices, h100:8x8)"
  if narrowed_dtypes(lever) and domains < 2:
    return f"{name} narrows what crosses between slices or nodes; {one}"
  if "replica" in state_axes(lever) and domains < 2:
    return f"{name} splits the state across slices or nodes too; {one}"
  # Masters of a float32 model keep what params_across_dtype rounds away; without it they change nothing.
  options, bfloat16 = lever.optimizer_options, set(param_dtypes) <= {"bfloat16"}
  masters_only = "master_dtype" in options and "params_across_dtype" not in options
  if masters_only and set(param_dtypes) <= {"float32", "float64"}:
    return f"{name} keeps float32 copies of narrower parameters; these are {dtypes} already"
  if options.get("state_dtype") == "bfloat16" and bfloat16:
    return f"{name} stores the state in bfloat16; for {dtypes} parameters it is bfloat16 already"
  if lever.accumulate_options.get("across_dtype") == "bfloat16" and bfloat16:
    # The gradients have the parameters' dtype: the narrowed hop would send the exact lever's bytes.
    return (f"{name} sends float32 gradients across slices or nodes in bfloat16; {dtypes} parameters' "
            f"gradients cross in bfloat16 already (the lever without -bf16across sends the same bytes)")
  return None


def adds_memory(name: str) -> str | None:
  """What lever ``name`` adds to a device's memory over ``zero1`` (None: nothing)."""
  if not LEVERS[name].zero1:
    return "the whole optimizer state on every device (nothing split)"
  dtype = LEVERS[name].optimizer_options.get("master_dtype")
  return None if dtype is None else f"{dtype} master copies of the parameters (split over the data axes)"


def splits_nothing(name: str, mesh: Mapping[str, int], split: StateSplit | None = None) -> bool:
  """Whether lever ``name`` leaves each device the whole optimizer state on ``mesh``, where splitting it is
  its only saving (no share in host memory, no narrower dtype): its axes come to one device, or its compiled
  layout (``split``, a row's) split none of the state over axes larger than one device."""
  lever = LEVERS.get(name)
  saves_otherwise = {"offload_state_to_host", "state_dtype"} & set(lever.optimizer_options if lever else ())
  if lever is None or not lever.zero1 or lever.picks_offload or saves_otherwise:
    return False
  devices = lambda axes: math.prod(mesh.get(axis, 1) for axis in axes)
  if split is None:
    return devices(state_axes(lever)) == 1
  return sum(v for k, v in split.share.items() if k != "none" and devices(k.split(",")) > 1) < 0.001


def narrowed_dtypes(lever: Lever) -> dict[str, str]:
  """The options of ``lever`` that narrow what crosses between slices or nodes, and their dtypes."""
  options = {**lever.accumulate_options, **lever.optimizer_options}
  return {name: options[name] for name in _NARROWING if name in options}


def memory_twin(name: str) -> str:
  """The lever that holds in device memory what lever ``name`` holds: ``name`` itself, or for a lever that
  only narrows what crosses the slow network (:func:`narrowed_dtypes`), the lever without that."""
  lever = LEVERS[name]
  if not narrowed_dtypes(lever):
    return name
  strip = lambda options: {k: v for k, v in options.items() if k not in _NARROWING}
  plain = dataclasses.replace(lever, optimizer_options=strip(lever.optimizer_options),
                              accumulate_options=strip(lever.accumulate_options))
  return next(other for other, twin in LEVERS.items() if twin == plain)


def with_offload(name: str, fraction: float | None) -> Lever:
  """The lever ``name``, with ``fraction`` of its optimizer state in host memory where it picks the share
  (0 or None: none); any other lever as it is."""
  lever = LEVERS[name]
  if not lever.picks_offload:
    return lever
  return dataclasses.replace(lever, optimizer_options={**lever.optimizer_options,
                                                       "offload_state_to_host": fraction or False})


def engine_attributes(lever_name: str, lever: Lever) -> dict[str, Any] | None:
  """The class attributes of ``Zero1AbstractMaxTextEngine`` that make it ``lever`` (None: MaxText's own)."""
  if not lever.zero1:
    return None
  if "data_axis" in lever.optimizer_options:
    raise PlanError(f"{lever_name} names mesh axes MaxText's mesh has not; MaxText's data axis is "
                    "dcn_data x ici_data, so on several slices its zero1 splits the state across them")
  if lever.deferred and not lever.accumulate_options.get("shard_accumulator"):
    raise PlanError(f"{lever_name} is this library's gradient accumulation; MaxText's engine accumulates "
                    "its own (and defers the data-parallel reduction itself under shard_mode=explicit): "
                    "plan zero1 or zero2")
  attributes = {k.upper(): v for k, v in lever.optimizer_options.items()}
  if lever.accumulate_options.get("shard_accumulator"):
    attributes["SHARD_ACCUMULATOR"] = True
  return attributes
