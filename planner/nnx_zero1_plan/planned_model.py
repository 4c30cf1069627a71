"""The model a plan compiles, described once before any compile: a ``--mesh`` axis a ``tunix:`` or own model
does not name is refused before the compiler is looked for."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from jax.sharding import AxisType, Mesh

from nnx_zero1_plan.abstract import describe_model
from nnx_zero1_plan.inputs import PlanError
from nnx_zero1_plan.levers import LEVERS, lever_blocker
from nnx_zero1_plan.mesh_axes import batch_axes, check_axis_names, mesh_axes
from nnx_zero1_plan.models import model_source
from nnx_zero1_plan.request import PlanRequest
from nnx_zero1_plan.row import Figures

if TYPE_CHECKING:  # a type only: the target is made, its compiler loaded, by targets.make_target
  from nnx_zero1_plan.targets import Target


@dataclasses.dataclass(frozen=True)
class PlannedModel:
  """What a plan compiles: the model at a micro-batch, its mesh, and what the checks and hints need."""

  # global micro-batch -> the model's ModelSource (or MaxTextModel: its config depends on the micro-batch)
  source_at: Callable[[int], Any]
  axes: Mapping[str, int]  # every mesh axis and its size
  # the mesh on the target's devices (None before it is placed, and for MaxText, whose engine builds its own)
  device_mesh: Mesh | None
  reduced: tuple[int, ...] | None  # the depths compiled and extrapolated from (None: whole)
  batch_unit: int  # a micro-batch is a multiple of the batch axes' size
  param_dtypes: frozenset[str]
  compute_dtype: str  # what the step computes in: the peak its MFU is measured against
  named: tuple[str, ...] = ()  # the mesh axes the model's variables name
  # one compile of a lever's step where the model's engine compiles its own (None: the planner's step)
  compiles: Callable[..., Figures] | None = None
  # mesh axes -> the activation constraints a tunix: model applies (ModelSource.activation_sharding)
  constraints: Callable[[Iterable[str]], dict[str, tuple] | str] | None = None

  @property
  def activation_sharding(self) -> dict[str, tuple] | str | None:
    """The activation constraints on the mesh, as a row and the meta say them (None: not ``tunix:``)."""
    return None if self.constraints is None else self.constraints(self.axes)


class ModelPlanner(Protocol):
  """How a plan builds the model of one kind (:class:`~nnx_zero1_plan.inputs.ModelKind`): your own or Tunix's
  NNX model (:data:`NNX_MODELS`), MaxText's engine (:class:`nnx_zero1_plan.maxtext.MaxTextModels`)."""

  def described(self, request: PlanRequest, policy: str | None) -> PlannedModel | None:
    """The model described before the target is made, so a misspelt axis needs no compiler (None: a kind
    described on the target only)."""

  def on_target(self, request: PlanRequest, described: PlannedModel | None, target: Target,
                policy: str | None) -> PlannedModel:
    """The model on the target's devices: its mesh, the batch's unit and, per micro-batch, its source."""


class _NnxModels:
  """``tunix:`` and ``package.module:function`` models: described from one abstract build, then placed."""

  def described(self, request: PlanRequest, policy: str | None) -> PlannedModel:
    """The model under the remat ``policy`` from one abstract build (no compiler needed); a ``--mesh`` axis
    the model does not name and the planner does not know is refused here."""
    source = model_source(request.model_ref, request.param_dtype, request.compute_dtype, policy,
                          request.tunix_sharding, request.lora)
    depths = request.depths
    cut = request.estimate and request.backend.estimates_shallow and (source.full_depth or 0) > max(depths)
    reduced = tuple(depths) if cut else None
    named, dtypes = describe_model(lambda: source.build(reduced[0] if reduced else None))
    check_axis_names(request.mesh_sizes, named)
    computes_in = request.compute_dtype or (next(iter(dtypes)) if len(dtypes) == 1 else "float32")
    return PlannedModel(lambda b: source, dict(request.mesh_sizes), None, reduced, 1, dtypes, computes_in,
                        named, constraints=source.activation_sharding)

  def on_target(self, request: PlanRequest, described: PlannedModel | None, target: Target,
                policy: str | None) -> PlannedModel:
    """Every mesh axis sized (``replica`` across the slices or nodes), the device mesh, the batch's unit;
    a mesh that does not match the device count, or a ``replica`` that does not cross them, refused."""
    assert described is not None
    axes = mesh_axes(described.axes, described.named, len(target.devices), domains=target.domains,
                     where=target.backend.domain)
    device_mesh = Mesh(np.array(target.devices).reshape(tuple(axes.values())), tuple(axes),
                       axis_types=(AxisType.Auto,) * len(axes))
    rows_over = math.prod(axes[a] for a in batch_axes(axes))
    return dataclasses.replace(described, axes=axes, device_mesh=device_mesh, batch_unit=rows_over)


NNX_MODELS: ModelPlanner = _NnxModels()


def refuse_blocked(request: PlanRequest, planned: PlannedModel) -> dict[str, str]:
  """The levers that cannot apply to the model or the target, and why; one the request asks for is refused."""
  blocked = {n: why for n in LEVERS if (why := lever_blocker(n, planned.param_dtypes, request.domains))}
  for name in request.levers:
    if name in blocked:
      raise PlanError(f"--levers {name} does not apply to {request.model}: {blocked[name]}")
  return blocked
