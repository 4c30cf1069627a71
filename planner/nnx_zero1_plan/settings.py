"""A plan's settings as planned (plan.json's ``meta``), read back from a kept plan byte for byte."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from nnx_zero1_plan.request import ResolvedRequest
from nnx_zero1_plan.row import Record, _keys


def _after(key: str, **how: Any) -> Any:
  """One of the meta's own fields, written after ``key`` (one an older plan.json may lack, None there)."""
  default = None if how.get("later") else dataclasses.MISSING
  return dataclasses.field(default=default, metadata={"after": key, **how})


@dataclasses.dataclass(frozen=True)
class PlanSettings(Record):
  """plan.json's ``meta``: the request as planned, its settings side by side with the model's depth and
  dtypes, the target's memory and the compilers, each written after the key it names.

  Attributes:
    request: the request as the plan resolved it (plan.json has neither its ``depths`` nor ``calibration``).
    layers: the model's depth (a MaxText model's from the config its rows compiled; None where unknown).
    batch_default: the sentence that states the default micro-batch, where ``--batch`` was not given.
    hbm_bytes: the memory a program may use per device, as the compiler reports it; ``usable_bytes`` less
      the reserve or the margin.
    depth_extrapolated_from: the reduced depths an estimate's first row was compiled at (None: whole).
    activation_sharding: a ``tunix:`` model's activation specs (``"none"`` without them; None otherwise).
    absent: the keys marked ``later`` an older plan.json lacks, which :meth:`to_json` leaves out too.
  """

  request: ResolvedRequest = dataclasses.field(metadata={"flat": ("depths", "calibration")})
  _: dataclasses.KW_ONLY
  layers: int | None = _after("model")
  device_kind: str = _after("topology")
  batch_default: str | None = _after("seq_len", later=True)
  # Any sequence, kept as a tuple: one read back from JSON's list is equal.
  param_dtypes: tuple[str, ...] | Sequence[str] = _after("param_dtype")
  compiler: str = _after("steps")
  jax: str = _after("compiler")
  hbm_bytes: int = _after("jax")
  hbm_source: str = _after("hbm_bytes")
  usable_bytes: int = _after("hbm_source")
  peak_source: str = _after("usable_bytes")
  depth_extrapolated_from: tuple[int, ...] | Sequence[int] | None = _after("gpu_memory_fraction")
  batch_unit: int = _after("margin")
  domains: int = _after("slices")
  activation_sharding: Mapping[str, Any] | str | None = _after("domains")
  absent: frozenset[str] = frozenset()


# The keys a plan.json written by an older planner may lack; any other missing key is an error.
ADDED_LATER = _keys(PlanSettings, "later")
