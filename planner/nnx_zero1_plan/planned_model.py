"""The model a plan compiles, described once before any compile: its mesh, its batch's unit, its dtypes.

A ``tunix:`` or ``package.module:function`` model is built abstractly once (no compiler needed), so a
``--mesh`` axis it does not name is refused before the compiler is looked for; then it is placed on the
target's devices. A ``maxtext:`` model is described by its config (:func:`describe_maxtext`; MaxText builds
its own mesh). Traces; compiles nothing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import numpy as np
from jax.sharding import AxisType, Mesh

from nnx_zero1_plan.abstract import describe_model
from nnx_zero1_plan.inputs import PlanError, check_axis_names, mesh_axes
from nnx_zero1_plan.levers import LEVERS, lever_blocker
from nnx_zero1_plan.maxtext import MaxTextModel, config_overrides, mesh_axis_names
from nnx_zero1_plan.models import model_source
from nnx_zero1_plan.request import PlanRequest
from nnx_zero1_plan.steps import batch_axes
from nnx_zero1_plan.targets import Target

__all__ = ["PlannedModel", "describe_tunix_or_own", "on_devices", "describe_maxtext", "batch_words",
           "refuse_blocked"]


@dataclasses.dataclass(frozen=True)
class PlannedModel:
  """What a plan compiles: the model at a micro-batch, its mesh, and what the checks and hints need.

  Attributes:
    source_at: global micro-batch -> the model's ``ModelSource`` (or ``MaxTextModel``: its config depends on
      the micro-batch).
    axes: every mesh axis and its size.
    device_mesh: the mesh on the target's devices (None before :func:`on_devices`, and for MaxText, whose
      engine builds its own).
    reduced: the depths compiled and extrapolated from (None: whole).
    batch_unit: a micro-batch is a multiple of the batch axes' size.
    param_dtypes: the parameters' dtypes.
    remat_hint: the remat policy "Try next" suggests (None: the model takes no ``--remat``).
    named: the mesh axes the model's variables name.
  """

  source_at: Callable[[int], Any]
  axes: Mapping[str, int]
  device_mesh: Mesh | None
  reduced: tuple[int, ...] | None
  batch_unit: int
  param_dtypes: frozenset[str]
  remat_hint: str | None
  named: tuple[str, ...] = ()


def describe_tunix_or_own(request: PlanRequest, policy: str | None, sizes: Mapping[str, int] | None = None,
                          estimate: bool | None = None) -> PlannedModel:
  """A ``tunix:`` or ``package.module:function`` model under the remat ``policy``, described from one
  abstract build (no compiler needed): the axes it names and its dtypes.

  Args:
    request: the plan's settings.
    policy: the remat policy (None: the model's own).
    sizes: the ``--mesh`` sizes (default: the request's).
    estimate: compile reduced depths (default: the request's ``estimate``).

  Raises:
    PlanError: a ``--mesh`` axis the model does not name and the planner does not know, or what
      :func:`nnx_zero1_plan.models.model_source` refuses.
  """
  sizes = request.mesh_sizes if sizes is None else sizes
  estimate = request.estimate if estimate is None else estimate
  source = model_source(request.model_ref, request.param_dtype, request.compute_dtype, policy,
                        request.tunix_sharding)
  # An estimate is for TPUs only: XLA's GPU compiler compiles a whole program in minutes, and schedules a
  # deep program's collectives unlike a shallow one's (Zero-1's temp on qwen3_8b: 2.70 GiB by the line,
  # 7.95 whole).
  depths = request.depths
  shallow = not source.full_depth or source.full_depth <= max(depths)
  reduced = tuple(depths) if estimate and request.platform == "tpu" and not shallow else None
  named, dtypes = describe_model(lambda: source.build(reduced[0] if reduced else None))
  check_axis_names(sizes, named)
  remat_hint = "decoder" if request.model_ref.kind == "tunix" else None
  return PlannedModel(lambda b: source, dict(sizes), None, reduced, 1, dtypes, remat_hint, named)


def on_devices(planned: PlannedModel, target: Target) -> PlannedModel:
  """``planned`` on the target's devices: every mesh axis sized (``replica`` across the slices or nodes), the
  device mesh, the batch's unit.

  Raises:
    PlanError: the mesh does not match the device count, or ``replica`` does not cross the slices or nodes.
  """
  where = "slices" if target.platform == "tpu" else "nodes"
  axes = mesh_axes(planned.axes, planned.named, len(target.devices), domains=target.domains, where=where)
  device_mesh = Mesh(np.array(target.devices).reshape(tuple(axes.values())), tuple(axes),
                     axis_types=(AxisType.Auto,) * len(axes))
  rows_over = math.prod(axes[a] for a in batch_axes(device_mesh))
  return dataclasses.replace(planned, axes=axes, device_mesh=device_mesh, batch_unit=rows_over)


def describe_maxtext(request: PlanRequest, target: Target, policy: str | None, batch: int,
                     output_dir: str) -> PlannedModel:
  """A ``maxtext:`` model under the remat ``policy``: its config's overrides at each micro-batch, checked at
  ``batch`` before any compile (MaxText builds its own mesh: the axes are one slice's ``ici_*``), MaxText
  writing under ``output_dir`` (the plan's :func:`nnx_zero1_plan.maxtext.output_directory`).

  Raises:
    PlanError: a GPU target, MaxText missing, or what :func:`nnx_zero1_plan.maxtext.config_overrides`
      refuses.
  """
  model = request.model_ref
  if target.platform != "tpu":
    raise PlanError(f"{model} compiles through MaxText's ahead-of-time engine, for TPU slices only; "
                    f"{request.topology} is a GPU target")
  try:
    known = mesh_axis_names()
  except ImportError as e:
    raise PlanError(f"{model} needs MaxText (Python >= 3.12), from a clone: pip install -r "
                    f".ci/requirements-newest.txt && pip install --no-deps maxtext==0.2.5 ({e})") from e
  axes = mesh_axes(request.mesh_sizes, (), len(target.devices) // target.domains)

  def source_at(micro_batch: int) -> MaxTextModel:
    config = config_overrides(model.name, request.topology, len(target.devices), axes, batch=micro_batch,
                              seq_len=request.seq_len, ga=request.ga, optimizer=request.optimizer,
                              param_dtype=request.param_dtype, compute_dtype=request.compute_dtype,
                              remat=policy, known_axes=known, output_dir=output_dir,
                              overrides=request.overrides, slices=target.domains)
    return MaxTextModel(str(model), config, defer=request.maxtext_deferral == "auto")

  source_at(batch)  # the settings checked before any compile
  weights = (request.overrides or {}).get("weight_dtype") or request.param_dtype or "float32"
  return PlannedModel(source_at, axes, None, None, len(target.devices), frozenset({weights}), "full")


def batch_words(planned: PlannedModel) -> str:
  """The batch axes, as the refusal and the default's sentence name them (``replica x data``)."""
  return " x ".join(batch_axes(planned.device_mesh)) if planned.device_mesh is not None else "the devices"


def refuse_blocked(names: Sequence[str], param_dtypes: Collection[str], model: str,
                   domains: int) -> dict[str, str]:
  """The levers that cannot apply to the model or the target, and why.

  Raises:
    PlanError: one of ``names`` (the levers asked for) is among them.
  """
  blocked = {n: why for n in LEVERS if (why := lever_blocker(n, param_dtypes, domains))}
  for name in names:
    if name in blocked:
      raise PlanError(f"--levers {name} does not apply to {model}: {blocked[name]}")
  return blocked
