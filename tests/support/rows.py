"""Whole, valid plan rows for the planner's pure tests: one helper, so a test names only what it is about."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from nnx_zero1_plan.row import Figures, Made, Offloaded, Point, Row, Searched

G = 2**30


def make_row(lever: str, *, step: str = "one", batch: int = 8, fits: bool | None = True,
             remat: str | None = None,
             mesh: dict[str, int] | None = None, compiled_for: str = "h100:4", hbm_bytes: int = 16 * G,
             usable_bytes: int | None = None, made: Made | None = None, searched: Searched | None = None,
             offloaded: Offloaded | None = None, **figures: Any) -> Row:
  """A row as the planner compiles it: ``figures`` are :class:`Figures` fields (a misspelt one is a
  TypeError), the rest the row's own.

  Example::

    >>> make_row("zero1", peak_bytes_per_device=G).verdict
    True
  """
  figures.setdefault("compile_s", 1.0)
  return Row(lever=lever, step=step, compiled_for=compiled_for, device_kind="NVIDIA H100 80GB HBM3",
             mesh=mesh or {"data": 4}, model="mymodels.models:build", batch=batch, figures=Figures(**figures),
             made=made or Made(depth=2), hbm_bytes=hbm_bytes,
             usable_bytes=hbm_bytes if usable_bytes is None else usable_bytes, fits=fits, remat=remat,
             searched=searched, offloaded=offloaded)


def searched(edge: int | None, points: Iterable[Point] = (), *, unfinished: str | None = None,
             fits_above: tuple[int, ...] = ()) -> Searched:
  """A search's record whose largest micro-batch is ``edge``, with its ``points``."""
  points = tuple(points)
  at = lambda batch: next((p for p in points if p.batch == batch), None)
  return Searched(max_micro_batch=edge, above=None, refused_because=None, search_unfinished=unfinished,
                  fits_above=fits_above, at_max=at(edge), at_above=None, search=points, search_compile_s=1.0)
