"""A plan's settings as planned (plan.json's ``meta``), read back from a kept plan byte for byte."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from nnx_zero1_plan.gpu_chips import JAX_GPU_POOL_FRACTION
from nnx_zero1_plan.inputs import spelled_mesh
from nnx_zero1_plan.request import STEPS, ResolvedRequest
from nnx_zero1_plan.row import Record, as_json

# The keys a plan.json written by an older planner may lack; any other missing key is an error.
ADDED_LATER = ("batch_default", "tunix_sharding", "gpus_per_node", "maxtext_deferral", "global_batch", "lora")


@dataclasses.dataclass(frozen=True)
class PlanSettings(Record):
  """plan.json's ``meta``: the request as planned, the model's depth and dtypes, the target's memory, the
  compilers.

  Attributes:
    request: the request as the plan resolved it; plan.json writes its settings by their flags' names
      (``steps`` with what each is, ``gpu_memory_fraction`` None on a TPU).
    layers: the model's depth (a MaxText model's from the config its rows compiled; None where unknown).
    device_kind: jax's name for the chip.
    batch_default: the sentence that states the default micro-batch, where ``--batch`` was not given.
    param_dtypes: the parameters' dtypes, as the model holds them, sorted.
    compiler: the target's compiler and its version.
    jax: jax's version.
    hbm_bytes: the memory a program may use per device, as the compiler reports it.
    hbm_source: where ``hbm_bytes`` comes from.
    usable_bytes: ``hbm_bytes`` less the reserve or the margin.
    peak_source: where a row's peak comes from (:func:`nnx_zero1_plan.compiled.peak_source`).
    depth_extrapolated_from: the reduced depths an estimate's first row was compiled at (None: whole).
    batch_unit: the batch axes' size; a micro-batch is a multiple of it.
    domains: the slices or nodes the target's devices sit in.
    activation_sharding: a ``tunix:`` model's activation specs (``"none"`` without them; None otherwise).
    absent: the keys of :data:`ADDED_LATER` an older plan.json lacks, which :meth:`to_json` leaves out too
      (empty for a new plan; the request holds their defaults).

  Example::

    >>> from nnx_zero1_plan.request import PlanRequest
    >>> request = PlanRequest("m.models:build", "v6e:2x2", levers="zero1").resolved({"data": 4}, 8)
    >>> settings = PlanSettings(
    ...     request, layers=2, device_kind="TPU v6 lite", batch_default=None, param_dtypes=["float32"],
    ...     compiler="libtpu", jax="0.8.1", hbm_bytes=2**34, hbm_source="the compiler", usable_bytes=2**34,
    ...     peak_source="the compiler", depth_extrapolated_from=None, batch_unit=4, domains=1,
    ...     activation_sharding=None)
    >>> settings.request.batch, list(settings.to_json())[:6]
    (8, ['model', 'layers', 'topology', 'device_kind', 'mesh', 'batch'])
    >>> PlanSettings.from_json(settings.to_json()) == settings
    True
  """

  request: ResolvedRequest
  layers: int | None
  device_kind: str
  batch_default: str | None
  # Any sequence, kept as a tuple: one read back from JSON's list is equal.
  param_dtypes: tuple[str, ...] | Sequence[str]
  compiler: str
  jax: str
  hbm_bytes: int
  hbm_source: str
  usable_bytes: int
  peak_source: str
  depth_extrapolated_from: tuple[int, ...] | Sequence[int] | None
  batch_unit: int
  domains: int
  activation_sharding: Mapping[str, Any] | str | None
  absent: frozenset[str] = frozenset()

  def to_json(self) -> dict[str, Any]:
    """plan.json's ``meta``, in its order, each value as :func:`~nnx_zero1_plan.row.as_json` writes it (the
    keys in ``absent`` left out)."""
    r = self.request
    fields = {**{f.name: getattr(r, f.name) for f in dataclasses.fields(r)}, **vars(self),
              "model": str(r.model_ref), "mesh": dict(r.mesh_sizes), "steps": {s: STEPS[s] for s in r.steps},
              "gpu_memory_fraction": r.gpu_memory_fraction if r.backend.pool_fraction else None}
    return {name: as_json(fields[name]) for name in _KEYS if name not in self.absent}

  @classmethod
  def from_json(cls, fields: Mapping[str, Any]) -> PlanSettings:
    """The record :meth:`to_json` wrote (plan.json's ``meta``, or a kept plan's from an older planner).

    Raises:
      KeyError: a key plan.json's meta has not, or one missing that is not in :data:`ADDED_LATER` (a
        plan.json written by another version of the planner).
    """
    unknown, missing = set(fields) - set(_KEYS), set(_KEYS) - set(fields) - set(ADDED_LATER)
    if unknown or missing:
      raise KeyError(f"plan.json's meta has keys no field has: {sorted(unknown)}, or lacks: "
                     f"{sorted(missing)}")
    absent = frozenset(ADDED_LATER) - set(fields)
    written = {"mesh": spelled_mesh(fields["mesh"]), "steps": tuple(fields["steps"]),
               "gpu_memory_fraction": fields["gpu_memory_fraction"] or JAX_GPU_POOL_FRACTION}
    request = ResolvedRequest(**{**{name: fields[name] for name in _REQUEST if name in fields}, **written})
    own: dict[str, Any] = {f.name: fields.get(f.name) for f in dataclasses.fields(cls)
                           if f.name not in ("request", "absent")}
    return cls(request, **own, absent=absent)


# plan.json's meta, in its order: the request's settings and the record's own fields side by side.
_KEYS = ("model", "layers", "topology", "device_kind", "mesh", "batch", "seq_len", "batch_default", "ga",
         "optimizer", "param_dtype", "param_dtypes", "compute_dtype", "remat", "levers", "steps", "compiler",
         "jax", "hbm_bytes", "hbm_source", "usable_bytes", "peak_source", "gpu_memory_fraction",
         "depth_extrapolated_from", "estimate", "overrides", "search", "margin", "batch_unit", "slices",
         "domains", "activation_sharding", "tunix_sharding", "gpus_per_node", "maxtext_deferral",
         "global_batch", "lora")
# The meta's keys that are the request's settings (the mesh, the steps and the GPU pool's share as written).
_REQUEST = tuple(f.name for f in dataclasses.fields(ResolvedRequest) if f.init and f.name in _KEYS)
