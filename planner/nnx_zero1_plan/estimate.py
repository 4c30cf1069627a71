"""An estimate (``--estimate``): to the compiler, a stack of identical layers is a fixed part (embeddings,
head, batch) plus one per layer, so two reduced depths give the full one: arguments (parameters, optimizer
state) exactly, temporaries only while the compiler schedules each layer alike, which it does not at full
depth on TPUs (:data:`MEASURED_ERROR`): an estimate, marked on every figure it touches, decides nothing."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from nnx_zero1_plan.row import Estimate

_Record = TypeVar("_Record")

# What an estimate missed where the whole program was compiled too (TPU compiler, libtpu 0.0.50.1): the
# whole program's peak over the estimate's, carried by every estimated row and quoted by the flags' help.
WHOLE_OVER_ESTIMATE_UP_TO = 1.36
MEASURED_ERROR: dict[str, Any] = {
    "whole_peak_over_estimate_up_to": WHOLE_OVER_ESTIMATE_UP_TO,
    "measured": [
        "tunix:llama3p1_8b, v5e:2x4: peak 26.93 GiB whole, 19.79 estimated (x1.36)",
        "tunix:qwen3_8b, v5e:2x4: 28.24 whole, 23.69 estimated (x1.19)",
        "a 7.24B Llama-style bf16 decoder on two v5p:2x2x1 slices, Zero-1: 35.84 whole, 28.79 estimated "
        "(x1.245; temp 18.90 against 8.81); the baseline 57.44 against 48.41 (x1.19)",
    ],
}

# Above this share of the memory an extrapolated (TPU) peak is checked by a whole compile, where only it says:
# whole programs kept more temp than the line said (MEASURED_ERROR), so a peak is trusted only well below it.
NEAR_LIMIT = 0.5
NEAR = "near the limit"  # why an estimated row was compiled whole after its reduced depths


def extrapolate(at_d1: float, at_d2: float, d1: int, d2: int, depth: int) -> int:
  """The figure at ``depth`` layers, on the line through (d1, at_d1) and (d2, at_d2), rounded."""
  if d2 <= d1:
    raise ValueError(f"extrapolation needs two depths d1 < d2, got {d1} and {d2}")
  per_layer = (at_d2 - at_d1) / (d2 - d1)
  return round(at_d1 + per_layer * (depth - d1))


def extrapolate_row(r1: _Record, r2: _Record, d1: int, d2: int, depth: int, keys: Sequence[str]) -> _Record:
  """Record ``r2`` (a frozen dataclass: a row's figures) with each of ``keys`` (numbers, or records or dicts
  of numbers, nested) extrapolated to ``depth``; None in either record (a refused compile) stays None."""

  def walk(a: Any, b: Any) -> Any:
    if a is None or b is None:
      return None
    if dataclasses.is_dataclass(b) and not isinstance(b, type):  # a record of figures: field by field
      return dataclasses.replace(b, **{f.name: walk(getattr(a, f.name), getattr(b, f.name))
                                       for f in dataclasses.fields(b)})
    if isinstance(b, Mapping):
      return {k: walk(a.get(k), v) for k, v in b.items()}
    return extrapolate(a, b, d1, d2, depth)

  return dataclasses.replace(r2, **{k: walk(getattr(r1, k), getattr(r2, k)) for k in keys})  # type: ignore[type-var]


def not_alike(at_d1: int | None, at_d2: int | None, d1: int, d2: int, what: str = "temp") -> str | None:
  """Why two reduced depths cannot be extrapolated, or None: more layers needing less temp (or a lower peak,
  ``what="peak"``) means the compiler did not schedule the layers alike (or they are not alike: Gemma 3
  interleaves local and global attention), so the line through them says nothing of the full depth.

  Measured: Tunix's gemma3_4b_pt on v6e:2x4 needed less temp at 4 layers than at 2, and its line ran to a
  negative temp at 34; llama3p1_70b under Zero-1 across two v5p slices peaked at 37.65 GiB at 2 layers and
  37.26 at 4, a line to 22.24 GiB at 80 where its arguments and temp alone were 86.90.
  """
  if at_d1 is None or at_d2 is None or at_d2 >= at_d1:
    return None
  fell = f"{at_d1 / 2**30:.2f} GiB at {d1} layers to {at_d2 / 2**30:.2f} GiB at {d2}"
  return f"the {what} fell from {fell}"


def estimate_mark(depth: int, extrapolated_from: Sequence[int], figures: Sequence[str]) -> Estimate:
  """What marks an extrapolated row as an estimate in plan.json: how it was made, the figures it touches,
  and the error such estimates were measured to have (:data:`MEASURED_ERROR`)."""
  d1, d2 = extrapolated_from
  return Estimate(f"extrapolated to {depth} layers from {d1}/{d2}", list(figures), **MEASURED_ERROR)
