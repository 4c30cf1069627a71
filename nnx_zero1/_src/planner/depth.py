"""Real models in minutes: compile at reduced depth, extrapolate per layer.

Every per-device figure of a stack of identical layers is, to the compiler, a
fixed part (embeddings, head, batch) plus one part per layer: two compiles at
depths ``d1 < d2`` give both, and the full depth's figure follows. Arguments
(parameters, optimizer state) are exactly linear; temporaries are linear as long
as the compiler schedules each layer alike, which the planner's docs measure.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["NEAR_LIMIT", "extrapolate", "extrapolate_row", "near_the_limit"]

# Above this share of the usable memory a compiler trades overlap for memory (XLA's GPU scheduler plans
# against its limit): a reduced-depth program, far from it, schedules its layers with more temp each.
NEAR_LIMIT = 0.75


def extrapolate(at_d1: float, at_d2: float, d1: int, d2: int, depth: int) -> int:
  """The figure at ``depth`` layers, on the line through (d1, at_d1) and (d2, at_d2), rounded.

  Example::

    >>> extrapolate(110, 120, 1, 2, 28)   # 100 fixed + 10 per layer
    380
  """
  if d2 <= d1:
    raise ValueError(f"extrapolation needs two depths d1 < d2, got {d1} and {d2}")
  per_layer = (at_d2 - at_d1) / (d2 - d1)
  return round(at_d1 + per_layer * (depth - d1))


def extrapolate_row(r1: Mapping[str, Any], r2: Mapping[str, Any], d1: int, d2: int, depth: int,
                    keys: tuple[str, ...]) -> dict[str, Any]:
  """Row ``r2`` with each of ``keys`` (numbers, or nested dicts of numbers) extrapolated to ``depth``.

  A key whose value is None in either row stays None (a compile that was refused).

  Example::

    >>> r1 = {"temp": 10, "collectives": {"all-reduce": {"count": 3, "bytes": 30}}}
    >>> r2 = {"temp": 12, "collectives": {"all-reduce": {"count": 5, "bytes": 50}}}
    >>> extrapolate_row(r1, r2, 1, 2, 4, ("temp", "collectives"))
    {'temp': 16, 'collectives': {'all-reduce': {'count': 9, 'bytes': 90}}}
  """

  def walk(a: Any, b: Any) -> Any:
    if a is None or b is None:
      return None
    if isinstance(b, Mapping):
      return {k: walk(a.get(k), v) for k, v in b.items()}
    return extrapolate(a, b, d1, d2, depth)

  return {**r2, **{k: walk(r1.get(k), r2.get(k)) for k in keys}}


def near_the_limit(peak: int | None, usable: int) -> bool:
  """Whether an extrapolated peak is close enough to the usable memory that only a whole compile says.

  Measured: Tunix's qwen3_8b baseline on 8x H100 extrapolated to a 15.55 GiB temp from 2 and 4
  layers, where the whole program, near the GPU scheduler's limit, needs 9.51 GiB.

  Example::

    >>> near_the_limit(61 * 2**30, 59 * 2**30), near_the_limit(35 * 2**30, 59 * 2**30)
    (True, False)
  """
  return peak is not None and peak > NEAR_LIMIT * usable
