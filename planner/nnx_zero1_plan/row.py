"""One lever's row of a plan: a frozen record, and plan.json's row written and read by one function each.

A :class:`Row` holds what identifies the compile (lever, step, target, mesh, model, micro-batch), what the
compiler said (``figures``: the per-device bytes, collectives, flops and the notes on how they were made),
the verdict against the usable memory (``fits``, the one :func:`nnx_zero1_plan.search.fits_in`), and what a
search found (``points``). It reads as a mapping of plan.json's field names, so the tables, the
recommendation and a kept plan.json read a row alike. Pure.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Mapping
from typing import Any

from nnx_zero1_plan.search import OFFLOAD_FIELDS, SEARCH_FIELDS

__all__ = ["Row"]

_IDENTITY = ("lever", "step", "compiled_for", "device_kind", "mesh", "model", "batch")
_VERDICT = ("activation_sharding", "hbm_bytes", "usable_bytes", "fits", "remat")
_POINTS = (*SEARCH_FIELDS, *OFFLOAD_FIELDS)


@dataclasses.dataclass(frozen=True)
class Row(Mapping[str, Any]):
  """One lever's step compiled for the target, as plan.json's row.

  Attributes:
    lever: the lever's name (``baseline``, ``zero1``, ...).
    step: ``"one"`` or ``"split"``.
    compiled_for: the topology.
    device_kind: jax's name for the chip.
    mesh: every mesh axis and its size.
    model: the model's name.
    batch: the global micro-batch the figures are for.
    figures: what the compiler said (``peak_bytes_per_device``, ``collectives``, ``error``, ...), and how
      the figures were made (``depth``, ``estimate``, ``network_per_step``), by plan.json's names.
    activation_sharding: the activation constraints applied (``tunix:`` models), else None.
    hbm_bytes: the memory a program may use per device, as the compiler reports it.
    usable_bytes: ``hbm_bytes`` less the reserve or margin.
    fits: the compiler accepted the whole program and its peak is within ``usable_bytes``; None for an
      estimate, or where a refusal for another reason left no figures.
    remat: the remat policy compiled under (None: the model's own).
    points: what a search found: the largest micro-batch and its neighbours
      (:data:`nnx_zero1_plan.search.SEARCH_FIELDS`), or the share of the state offloaded
      (:data:`nnx_zero1_plan.search.OFFLOAD_FIELDS`); empty without one.
  """

  lever: str
  step: str
  compiled_for: str
  device_kind: str
  mesh: Mapping[str, int]
  model: str
  batch: int
  figures: Mapping[str, Any]
  activation_sharding: Any
  hbm_bytes: int
  usable_bytes: int
  fits: bool | None
  remat: str | None = None
  points: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def to_json(self) -> dict[str, Any]:
    """plan.json's row: the identity, the figures, the verdict, then what a search found.

    Example::

      >>> row = Row.from_json({"lever": "zero1", "step": "one", "compiled_for": "h100:8", "device_kind": "H",
      ...                      "mesh": {"data": 8}, "model": "m:f", "batch": 8, "peak_bytes_per_device": 5,
      ...                      "activation_sharding": None, "hbm_bytes": 9, "usable_bytes": 8, "fits": True,
      ...                      "remat": None, "max_micro_batch": 16})
      >>> row.figures, row.points, row["fits"], Row.from_json(row.to_json()) == row
      ({'peak_bytes_per_device': 5}, {'max_micro_batch': 16}, True, True)
    """
    return dict(self._fields)

  @classmethod
  def from_json(cls, fields: Mapping[str, Any]) -> Row:
    """The row :meth:`to_json` wrote (or a row's fields as the plan compiles them), each in its place."""
    rest = {k: v for k, v in fields.items() if k not in _IDENTITY and k not in _VERDICT}
    return cls(lever=fields["lever"], step=fields["step"], compiled_for=fields["compiled_for"],
               device_kind=fields["device_kind"], mesh=fields["mesh"], model=fields["model"],
               batch=fields["batch"], figures={k: v for k, v in rest.items() if k not in _POINTS},
               activation_sharding=fields.get("activation_sharding"), hbm_bytes=fields["hbm_bytes"],
               usable_bytes=fields["usable_bytes"], fits=fields.get("fits"), remat=fields.get("remat"),
               points={k: v for k, v in rest.items() if k in _POINTS})

  @functools.cached_property
  def _fields(self) -> dict[str, Any]:
    own = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    return {**{k: own[k] for k in _IDENTITY}, **self.figures, **{k: own[k] for k in _VERDICT}, **self.points}

  def __getitem__(self, key: str) -> Any:
    return self._fields[key]

  def __iter__(self) -> Iterator[str]:
    return iter(self._fields)

  def __len__(self) -> int:
    return len(self._fields)
