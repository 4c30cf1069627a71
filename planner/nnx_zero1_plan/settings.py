"""A plan's settings as planned: plan.json's ``meta``, a frozen record written and read by one function each.

The planning process writes it once, from the request as the plan resolved it (its mesh and micro-batch set,
:meth:`~nnx_zero1_plan.request.PlanRequest.resolved`) and what the target and its compilers said
(:meth:`PlanSettings.of`); the caller reads it back from plan.json (:meth:`PlanSettings.from_json`). Its
fields are plan.json's names, in plan.json's order, so :meth:`PlanSettings.to_json` writes the object a kept
plan holds, byte for byte. Pure.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from nnx_zero1_plan.request import STEPS, PlanRequest

__all__ = ["PlanSettings", "ADDED_LATER"]

# The keys a plan kept before the planner wrote them lacks (plan.json written by an older planner); any other
# missing key is an error.
ADDED_LATER = ("batch_default", "tunix_sharding", "gpus_per_node", "maxtext_deferral")


@dataclasses.dataclass(frozen=True)
class PlanSettings:
  """plan.json's ``meta``: the request's settings as planned, the target's memory, the compilers.

  Attributes:
    model: the model, as ``--model`` spells it.
    layers: its depth (a MaxText model's from the config its rows compiled; None where unknown).
    topology: the target, as ``--topology`` spells it.
    device_kind: jax's name for the chip.
    mesh: every mesh axis and its size, as the plan resolved them.
    batch: the global micro-batch the rows compiled (``--batch``, or the default it resolved to).
    seq_len: tokens per sequence.
    batch_default: the sentence that states the default micro-batch, where ``--batch`` was not given.
    ga: micro-batches per optimizer step.
    optimizer: the optimizer's name (:data:`nnx_zero1_plan.request.OPTIMIZER_CODE`).
    param_dtype: ``--param-dtype`` (None: the model's own).
    param_dtypes: the parameters' dtypes, as the model holds them, sorted.
    compute_dtype: ``--compute-dtype``.
    remat: ``--remat``, as given.
    levers: the levers planned.
    steps: each step shape planned and what it is (:data:`nnx_zero1_plan.request.STEPS`).
    compiler: the target's compiler and its version.
    jax: jax's version.
    hbm_bytes: the memory a program may use per device, as the compiler reports it.
    hbm_source: where ``hbm_bytes`` comes from.
    usable_bytes: ``hbm_bytes`` less the reserve or the margin.
    peak_source: where a row's peak comes from (:data:`nnx_zero1_plan.compiled.PEAK_SOURCE`).
    gpu_memory_fraction: the GPU pool's share (None on a TPU).
    depth_extrapolated_from: the reduced depths an estimate's first row was compiled at (None: whole).
    estimate: ``--estimate``.
    overrides: a MaxText model's config overrides.
    search: ``--search``.
    margin: ``--margin`` (None: the backend's reserve).
    batch_unit: the batch axes' size; a micro-batch is a multiple of it.
    slices: ``--slices``.
    domains: the slices or nodes the target's devices sit in.
    activation_sharding: a ``tunix:`` model's activation specs (``"none"`` without them; None for other
      models).
    tunix_sharding: ``--tunix-sharding``.
    gpus_per_node: ``--gpus-per-node``.
    maxtext_deferral: ``--maxtext-deferral``.
    absent: the keys of :data:`ADDED_LATER` a plan kept before the planner wrote them lacks: their fields
      hold None, and :meth:`to_json` leaves them out, as that plan.json has them (empty for a new plan).
  """

  model: str
  layers: int | None
  topology: str
  device_kind: str
  mesh: Mapping[str, int]
  batch: int
  seq_len: int
  batch_default: str | None
  ga: int
  optimizer: str
  param_dtype: str | None
  param_dtypes: Sequence[str]
  compute_dtype: str | None
  remat: str | None
  levers: Sequence[str]
  steps: Mapping[str, str]
  compiler: str
  jax: str
  hbm_bytes: int
  hbm_source: str
  usable_bytes: int
  peak_source: str
  gpu_memory_fraction: float | None
  depth_extrapolated_from: Sequence[int] | None
  estimate: bool
  overrides: Mapping[str, str] | None
  search: bool
  margin: float | None
  batch_unit: int
  slices: int
  domains: int
  activation_sharding: Mapping[str, Any] | str | None
  tunix_sharding: str | None
  gpus_per_node: int | None
  maxtext_deferral: str | None
  absent: frozenset[str] = frozenset()

  def __post_init__(self) -> None:
    for name in _LISTS:  # JSON's lists as tuples, so a record read back equals the one written
      value = getattr(self, name)
      if isinstance(value, list):
        object.__setattr__(self, name, tuple(value))

  @classmethod
  def of(cls, request: PlanRequest, *, layers: int | None, device_kind: str, batch_default: str | None,
         param_dtypes: Sequence[str], compiler: str, jax: str, hbm_bytes: int, hbm_source: str,
         usable_bytes: int, peak_source: str, depth_extrapolated_from: Sequence[int] | None,
         batch_unit: int, domains: int, activation_sharding: Mapping[str, Any] | str | None) -> PlanSettings:
    """The settings of a plan made for ``request``, as the plan resolved it (its mesh and micro-batch set:
    :meth:`~nnx_zero1_plan.request.PlanRequest.resolved`); the rest is what the model, the target and the
    compilers said (each keyword is the field of that name).

    Raises:
      ValueError: ``request`` is not resolved (no micro-batch).

    Example::

      >>> request = PlanRequest("m.models:build", "v6e:2x2", batch=8, mesh="data=4", levers="zero1")
      >>> settings = PlanSettings.of(
      ...     request, layers=2, device_kind="TPU v6 lite", batch_default=None, param_dtypes=["float32"],
      ...     compiler="libtpu", jax="0.8.1", hbm_bytes=2**34, hbm_source="the compiler", usable_bytes=2**34,
      ...     peak_source="the compiler", depth_extrapolated_from=None, batch_unit=4, domains=1,
      ...     activation_sharding=None)
      >>> settings.mesh, settings.levers, list(settings.to_json())[:4]
      ({'data': 4}, ('zero1',), ['model', 'layers', 'topology', 'device_kind'])
      >>> PlanSettings.from_json(settings.to_json()) == settings
      True
    """
    r = request
    return cls(
        model=str(r.model_ref), layers=layers, topology=r.topology, device_kind=device_kind,
        mesh=dict(r.mesh_sizes), batch=r.resolved_batch, seq_len=r.seq_len, batch_default=batch_default,
        ga=r.ga, optimizer=r.optimizer, param_dtype=r.param_dtype, param_dtypes=tuple(param_dtypes),
        compute_dtype=r.compute_dtype, remat=r.remat, levers=tuple(r.levers),
        steps={s: STEPS[s] for s in r.steps}, compiler=compiler, jax=jax, hbm_bytes=hbm_bytes,
        hbm_source=hbm_source, usable_bytes=usable_bytes, peak_source=peak_source,
        gpu_memory_fraction=r.gpu_memory_fraction if r.platform == "cuda" else None,
        depth_extrapolated_from=depth_extrapolated_from, estimate=r.estimate, overrides=r.overrides,
        search=r.search, margin=r.margin, batch_unit=batch_unit, slices=r.slices, domains=domains,
        activation_sharding=activation_sharding, tunix_sharding=r.tunix_sharding,
        gpus_per_node=r.gpus_per_node, maxtext_deferral=r.maxtext_deferral)

  def to_json(self) -> dict[str, Any]:
    """plan.json's ``meta``: every field by its name, in order (tuples as lists; the keys in ``absent``
    left out). A value JSON has no type for is left as it is, for ``json.dump`` to refuse."""
    listed = lambda value: list(value) if isinstance(value, tuple) else value
    return {name: listed(getattr(self, name)) for name in _KEYS if name not in self.absent}

  @classmethod
  def from_json(cls, fields: Mapping[str, Any]) -> PlanSettings:
    """The record :meth:`to_json` wrote (plan.json's ``meta``, or a kept plan's from an older planner).

    Raises:
      KeyError: a key no field has, or one missing that is not in :data:`ADDED_LATER` (a plan.json
        written by another version of the planner).
    """
    unknown, missing = set(fields) - set(_KEYS), set(_KEYS) - set(fields) - set(ADDED_LATER)
    if unknown or missing:
      raise KeyError(f"plan.json's meta has keys no field has: {sorted(unknown)}, or lacks: "
                     f"{sorted(missing)}")
    absent = frozenset(ADDED_LATER) - set(fields)
    values: dict[str, Any] = {name: None if name in absent else fields[name] for name in _KEYS}
    return cls(**values, absent=absent)


_KEYS = tuple(f.name for f in dataclasses.fields(PlanSettings) if f.name != "absent")
_LISTS = ("param_dtypes", "levers", "depth_extrapolated_from")
