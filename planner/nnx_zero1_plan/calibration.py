"""A step time calibrated on the user's own chip, as a plan carries it (plan.json's ``calibration``): each
kind of instruction's seconds on the chip against the cost model's, from profiled runs of one model there,
and what it was run with. It is made where the chips are (``--measure``:
:mod:`nnx_zero1_plan.calibrated_time`) and travels to a plan made anywhere for the same chip (``--calibration
PATH``)."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence

from nnx_zero1_plan.inputs import PlanError
from nnx_zero1_plan.row import Record, _when_set

# What a step priced across its build has missed by, on the runs kept on one v5e chip (docs/accuracy.md, "One
# TPU v5e chip", held there by tests/planner/test_calibration.py): a plan says it under such a step. The
# worst is a search's largest micro-batch priced from its smallest (61 from 8, run 10); of the others, 15%.
CROSSING = ("on the runs kept on one v5e chip such a step missed the chip by up to 23%, a step built as a "
            "run was within 4.4% (--measure profiles each build it plans)")


@dataclasses.dataclass(frozen=True)
class KindTime(Record):
  """One kind's priced instructions in the profiled programs, every run counted: the walk's seconds, the
  chip's, and the ratio another program's instructions of that kind are priced at (chip over walk)."""

  walk_s: float
  chip_s: float
  ratio: float


@dataclasses.dataclass(frozen=True)
class Run(Record):
  """A profiled run a calibration came from: its plan row (lever, micro-batch, GA, sequence length), the
  step's measured wall seconds, the device's (the profile's programs), its calibrated walk's compute and the
  rest beyond it."""

  lever: str
  micro_batch: int
  ga: int
  seq_len: int
  step_s: float
  device_s: float
  compute_s: float
  rest_s: float

  def built_as(self, lever: str, ga: int) -> bool:
    """Whether a step of ``lever`` at ``ga`` micro-batches is built as this run's was: the same lever (another
    update program) and the accumulation loop alike (GA over 1) or not (the compiler tiles a fusion otherwise
    inside the loop: docs/accuracy.md)."""
    return self.lever == lever and (self.ga > 1) == (ga > 1)


@dataclasses.dataclass(frozen=True)
class Calibration(Record):
  """A model's step time calibrated on one chip, kind by kind: the chip (the planner's chip table's name),
  the jax and libtpu versions it ran with, the runs it came from and each kind's seconds.

  Example::

    >>> c = Calibration("v5e", "0.10.2", None, (Run("baseline", 4, 1, 1024, 0.1, 0.095, 0.09, 0.002),),
    ...                 {"vector": KindTime(0.02, 0.018, 0.9)})
    >>> c.ratio("vector"), c.ratio("matmul")  # a kind the runs never ran: the walk as it is
    (0.9, 1.0)
  """

  chip: str
  jax: str
  libtpu: str | None
  runs: tuple[Run, ...]
  kinds: Mapping[str, KindTime]
  # Each kind of collective (all-reduce, reduce-scatter, ...) timed on the slice the runs were on, and that
  # slice (the plan's topology): only a plan for that slice is priced by them.
  collectives: Mapping[str, KindTime] | None = _when_set()
  slice: str | None = _when_set()

  def ratio(self, kind: str) -> float:
    """A kind's ratio; 1.0 (the walk as it is) for a kind the profiled programs did not run."""
    return self.kinds[kind].ratio if kind in self.kinds else 1.0

  def collectives_on(self, topology: str) -> Mapping[str, KindTime]:
    """The collectives' kinds timed on ``topology`` (none where the runs were on another slice)."""
    return (self.collectives or {}) if self.slice == topology else {}

  @property
  def rest_share(self) -> float:
    """The runs' rest over their calibrated compute."""
    return sum(r.rest_s for r in self.runs) / sum(r.compute_s for r in self.runs)

  @property
  def launch_s(self) -> float:
    """The runs' mean step wall seconds beyond the device's."""
    return sum(r.step_s - r.device_s for r in self.runs) / len(self.runs)

  def said(self, jax: str, libtpu: str | None) -> str:
    """Where the calibration came from, in words, and the versions it ran with where this plan's differ."""
    runs = [f"{r.lever} at micro-batch {r.micro_batch} x GA {r.ga}, seq {r.seq_len}" for r in self.runs]
    plural = "s" * (len(runs) > 1)
    words = f"calibrated on one {self.chip} chip from {len(runs)} run{plural} ({'; '.join(runs)})"
    if self.collectives:
      ratios = ", ".join(f"{k} {t.ratio:.2f}x" for k, t in self.collectives.items())
      words += f"; each kind of collective timed on this {self.slice} against the walk ({ratios})"
    if (jax, libtpu) != (self.jax, self.libtpu):
      words += f"; it ran jax {self.jax}, libtpu {self.libtpu}, this plan jax {jax}, libtpu {libtpu}"
    return words


def combined(*calibrations: Calibration) -> Calibration:
  """Several runs' calibrations as one: each kind's seconds summed, the rest and launch of all the runs (a
  PlanError where they are of other chips or other jax or libtpu versions)."""
  first = calibrations[0]
  if any((c.chip, c.jax, c.libtpu) != (first.chip, first.jax, first.libtpu) for c in calibrations):
    raise PlanError("calibrations of other chips or versions do not combine: "
                    + ", ".join(sorted({f"{c.chip} (jax {c.jax}, libtpu {c.libtpu})" for c in calibrations})))
  def summed(kinds: Callable[[Calibration], Mapping[str, KindTime]]) -> dict[str, KindTime]:
    return summed_kinds((k, t.walk_s, t.chip_s) for c in calibrations for k, t in kinds(c).items())

  # Collectives timed on one slice combine; on several, none is the plan's.
  slices = {c.slice for c in calibrations if c.collectives}
  on = next(iter(slices)) if len(slices) == 1 else None
  return Calibration(first.chip, first.jax, first.libtpu, tuple(r for c in calibrations for r in c.runs),
                     summed(lambda c: c.kinds), summed(lambda c: c.collectives_on(on or "")) or None, on)


def summed_kinds(parts: Iterable[tuple[str, float, float]]) -> dict[str, KindTime]:
  """``(kind, walk seconds, chip seconds)`` summed kind by kind, each kind's ratio theirs (a kind the walk
  gave no time left out)."""
  sums: dict[str, list[float]] = {}
  for kind, walk, chip in parts:
    both = sums.setdefault(kind, [0.0, 0.0])
    both[0], both[1] = both[0] + walk, both[1] + chip
  return {kind: KindTime(walk, chip, chip / walk) for kind, (walk, chip) in sorted(sums.items()) if walk}


def for_step(calibrations: Sequence[Calibration], lever: str, ga: int) -> Calibration | None:
  """The calibrations whose runs were all built as a step of ``lever`` at ``ga`` micro-batches is
  (:meth:`Run.built_as`), combined; all of them where none was (:func:`built_otherwise` says so); None where
  there are none."""
  alike = [c for c in calibrations if all(r.built_as(lever, ga) for r in c.runs)]
  return combined(*(alike or calibrations)) if calibrations else None


def built_otherwise(calibration: Calibration, lever: str, ga: int) -> bool:
  """Whether ``calibration`` has no run built as a step of ``lever`` at ``ga`` is (its time crosses)."""
  return not any(r.built_as(lever, ga) for r in calibration.runs)


def read_calibrations(paths: str, chip: str) -> tuple[Calibration, ...]:
  """The calibration kept in each of ``paths`` (comma-separated: a plan.json, or the folder holding it), of
  one run or several (:func:`combined` makes them one; :func:`for_step` picks those built as a step is); a
  PlanError in one line for a path without one, or one made on another chip than ``chip``."""
  found = []
  for path in paths.split(","):
    file = os.path.join(path, "plan.json") if os.path.isdir(path) else path
    try:
      with open(file) as f:
        plan = json.load(f)
    except (OSError, ValueError) as e:
      raise PlanError(f"--calibration {path}: cannot read it ({type(e).__name__}: {e})") from e
    # Each kind of run apart where the plan kept them so (for_step picks by kind), else its one calibration.
    records = plan.get("calibrations") or ([plan["calibration"]] if plan.get("calibration") else [])
    if not records:
      raise PlanError(f"--calibration {path}: its plan has no calibration (a plan made with --measure has)")
    for calibration in map(Calibration.from_json, records):
      if calibration.chip != chip:
        raise PlanError(f"--calibration {path}: made on a {calibration.chip}, not this plan's {chip}: a "
                        "calibration holds for the chip it was measured on only")
      found.append(calibration)
  return tuple(found)
