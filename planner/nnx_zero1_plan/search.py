"""The largest micro-batch that fits, found with as few compiles as the arithmetic allows: a line through two
compiles, galloping short of the edge, the line and bisection in turn once bracketed, and the edge below the
first failure wherever the search started (why: docs/planner.md's "How far can I go?")."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from nnx_zero1_plan.bands import judged_by_calibrated, kind_bytes, parts_of, step_s, told_apart
from nnx_zero1_plan.cells import gib
from nnx_zero1_plan.inputs import PlanError
from nnx_zero1_plan.row import Figures, Measured, Offloaded, OffloadPoint, Point, Row, Searched, Split

# Within this share of the usable memory a compile is at the limit, where the compilers' peaks stop rising
# with the micro-batch (XLA's GPU scheduler lands within about 1.5% either side of it on h200:8).
BAND = 0.03
# The largest global micro-batch the search compiles, in sequences: it ends a search in which every compile
# fits (a tiny model on a large pod) before doubling reaches shapes too large to trace; two orders of
# magnitude above the largest edge the documented plans found (152 on h200:8).
MAX_MICRO_BATCH = 1 << 14
# The compiles one lever's search may take before it reports its bracket as unconfirmed: the searches measured
# on h200:8 (docs/planner.md) took 7 to 9, a sharp bend from micro-batch 8 takes 14
# (tests/planner/test_search.py); at about a minute a compile on two cores, a quarter hour per lever at most.
MAX_COMPILES = 16
# At most this many times the largest fitting micro-batch in one jump on the line's guess: from a nearly flat
# start the guess runs to thousands of sequences, where a compile is large, slow and most likely refused.
MAX_JUMP = 8
# The compiles the offload-fraction search may take (:func:`offload_search`); what does not fit by then is
# refused, saying so.
OFFLOAD_COMPILES = 4
# Splits whose calibrated (or predicted) steps are this close to the fastest's are run where the chips are
# (--measure), and the fastest measured is chosen: on the record a step priced across builds missed by 23%.
CLOSE = 0.25


def fits_in(figures: Figures, usable: int) -> bool | None:
  """Whether a compile's figures fit, the one verdict: False where the compiler refused the program for
  memory, else its peak within ``usable``; None where there are no figures (a refusal for another reason)."""
  peak = figures.peak_bytes_per_device
  return False if figures.hbm_oom else None if peak is None else peak <= usable


def round_down(batch: float, step: int) -> int:
  """``batch`` rounded down to a multiple of ``step``, at least ``step``."""
  return max(step, int(batch) // step * step)


def line_limit(p1: Point, p2: Point, usable: int, step: int) -> int | None:
  """The micro-batch at which the line through two compiles' peaks reaches ``usable`` (None: none rises)."""
  peak1, peak2 = p1.peak_bytes_per_device, p2.peak_bytes_per_device
  if peak1 is None or peak2 is None or p1.batch == p2.batch:
    return None
  slope = (peak2 - peak1) / (p2.batch - p1.batch)
  if slope <= 0:
    return None
  return round_down(p1.batch + (usable - peak1) / slope, step)


def _why(point: Point, usable: int) -> str:
  if point.error:
    return point.error
  return f"peak {gib(point.peak_bytes_per_device, none='?')} GiB > usable {gib(usable)} GiB"


def _line_guess(points: dict[int, Point], usable: int, step: int) -> int | None:
  """The line's limit through the largest compile that fits and one far below it (at most half its
  micro-batch, else the smallest): far apart, so that the compiler's noise of a few MiB between
  neighbouring micro-batches does not tilt the line."""
  fitting = sorted((p for p in points.values() if p.fits and p.peak_bytes_per_device is not None),
                   key=lambda p: p.batch)
  if len(fitting) < 2:
    return None
  top = fitting[-1]
  far = [p for p in fitting[:-1] if p.batch <= top.batch // 2] or fitting[:1]
  return line_limit(far[-1], top, usable, step)


def find_edge(measure: Callable[[int], Point], *, step: int, usable: int, start: int,
              cap: int = MAX_MICRO_BATCH, max_compiles: int = MAX_COMPILES) -> Searched:
  """The largest multiple of ``step`` (the batch axes' size) that fits in ``usable`` bytes per device below
  the first that does not, and that one, from ``start`` (the user's ``--batch``): the
  :class:`~nnx_zero1_plan.row.Searched` record, with every compile (``measure``: a
  :class:`~nnx_zero1_plan.row.Point` at a micro-batch) in the order they ran; after ``max_compiles``, the
  bracket so far (``search_unfinished`` set)."""
  first = round_down(start, step)
  points = {first: measure(first)}  # each micro-batch compiled once: every branch below picks a new one

  def bracket() -> tuple[int | None, int | None]:
    """The smallest compile that does not fit, and the largest that fits below it."""
    hi = min((b for b, p in points.items() if not p.fits), default=None)
    lo = max((b for b, p in points.items() if p.fits and (hi is None or b < hi)), default=None)
    return lo, hi

  def clear(batch: int) -> bool:
    p = points[batch]
    return p.fits and p.peak_bytes_per_device is not None and p.peak_bytes_per_device <= usable * (1 - BAND)

  def edge(unfinished: str | None = None) -> Searched:
    lo, hi = bracket()
    ran = tuple(points.values())
    return Searched(
        max_micro_batch=lo, above=hi, refused_because=None if hi is None else _why(points[hi], usable),
        search_unfinished=unfinished,
        fits_above=tuple(sorted(b for b, p in points.items() if p.fits and hi is not None and b > hi)),
        at_max=None if lo is None else points[lo], at_above=None if hi is None else points[hi], search=ran,
        search_compile_s=round(sum(p.compile_s or 0.0 for p in ran), 1))

  def unconfirmed(lo: int) -> int | None:
    """The next micro-batch below ``lo`` to compile before ``lo`` vouches for the ones below it (every one
    down to a compile clear of the limit), or None when none is left."""
    batch = lo
    while not clear(batch) and batch - step >= step:
      batch -= step
      if batch not in points:
        return batch
    return None

  stride = 0  # once the line stops gaining, the edge is galloped to: one step, two, four, ...
  moved: list[bool] = []  # once bracketed, which end each compile moved (True: the fitting one)
  top = round_down(cap, step)
  while True:
    lo, hi = bracket()
    if lo is None:  # nothing fits yet: the smallest micro-batch, then bisection up from it
      if step in points:
        return edge()
      batch = step
    elif (below := unconfirmed(lo)) is not None:
      batch = below
    elif hi is None and not clear(lo):  # at the limit and nothing refused yet: one step at a time
      batch = lo + step
    elif hi is None:  # nothing refused yet: the line's guess, or galloping
      guess = _line_guess(points, usable, step)
      if guess is None:  # no rising line yet (a fixed part dominates small micro-batches): double
        batch = 2 * lo
      elif guess >= lo + 2 * step:  # a nearly flat line overshoots wildly: at most MAX_JUMP times in one
        batch, stride = min(guess, MAX_JUMP * lo), 0
      else:
        stride = 2 * stride or step
        batch = lo + stride
    elif hi - lo > step:
      # The line between the ends, kept one step inside them; bisection when the line moved the
      # same end twice running (it is bent there, and would creep).
      guess = line_limit(points[lo], points[hi], usable, step)
      if guess is None or moved[-2:] in ([True, True], [False, False]):
        batch = round_down((lo + hi) // 2, step)
      else:
        batch = min(max(guess, lo + step), hi - step)
    else:
      return edge()
    if lo is not None and hi is None and batch > lo and (batch := min(batch, top)) <= lo:
      return edge()  # the cap fits
    if len(points) >= max_compiles:
      return edge(f"the search's {max_compiles} compiles ran out before the edge was confirmed")
    points[batch] = measure(batch)
    if hi is not None:
      moved.append(points[batch].fits)


def next_fraction(peak: int, usable: int, state_bytes: int, fraction: float = 0.0) -> float | None:
  """The share of the optimizer state to offload next, where the step's peak with ``fraction`` offloaded is
  ``peak``: ``fraction`` when it fits, else plus the bytes over ``usable`` as a share of ``state_bytes`` (what
  the whole state saves), rounded up to a hundredth; None when that is more than the whole state."""
  if peak <= usable:
    return fraction
  share = fraction + (peak - usable) / max(state_bytes, 1)
  share = math.ceil(round(share * 100, 6)) / 100
  return None if share > 1 else share


def search_row(first: Row, row_at: Callable[[int], Row], unit: int, usable: int) -> Searched:
  """The row's search for its largest micro-batch from ``first``, compiling the whole program at each
  (``row_at``; :func:`find_edge` compiles each micro-batch once): an edge is the compiler's word, never an
  estimate's."""
  def measure(batch: int) -> Point:
    figures = (first if batch == first.batch else row_at(batch)).figures
    return Point.of(batch, bool(fits_in(figures, usable)), figures)

  return find_edge(measure, step=unit, usable=usable, start=first.batch)


def offload_search(row_with: Callable[[float], Row], usable: int) -> Row:
  """The smallest share of the optimizer state to offload that fits (the ``offload-fraction`` lever), in
  :data:`OFFLOAD_COMPILES` compiles at most, each guess by :func:`next_fraction` (how: docs/planner.md's
  ``offload-fraction``). The row is the last compile's, with its :class:`~nnx_zero1_plan.row.Offloaded`
  record and every compile's seconds."""
  fraction, row = 0.0, row_with(0.0)
  tried: list[OffloadPoint] = []
  refused = None
  while True:
    figures = row.figures
    peak = figures.peak_bytes_per_device
    tried.append(OffloadPoint(fraction, peak, figures.compile_s or 0.0, bool(fits_in(figures, usable))))
    if figures.error or peak is None:
      refused = figures.error or "no figures"
      break
    state = sum((figures.opt_state_bytes_by_memory_kind or {}).values())
    last = tried[-2] if len(tried) > 1 else None  # the line through the last two compiles
    slope = 0.0 if last is None or last.peak_bytes_per_device is None else (
        (last.peak_bytes_per_device - peak) / (fraction - last.fraction))
    share = next_fraction(peak, usable, int(slope) if 0 < slope < state else state, fraction)
    if share is None:
      refused = (f"{gib(peak - usable)} GiB over the usable memory with {fraction:.0%} offloaded, more "
                 f"than the {gib(state * (1 - fraction))} GiB of state still on device saves")
      break
    if share == fraction or len(tried) == OFFLOAD_COMPILES:
      break
    fraction, row = share, row_with(share)
  if not tried[-1].fits and refused is None:
    refused = f"{OFFLOAD_COMPILES} compiles did not find a fraction that fits"
  compile_s = round(sum(t.compile_s for t in tried), 1)
  return dataclasses.replace(row, figures=dataclasses.replace(row.figures, compile_s=compile_s),
                             offloaded=Offloaded(fraction, tuple(tried), refused))


def split_global_batch(row_at: Callable[[int, int], Row], global_batch: int, unit: int,
                       run: Callable[[Row], Measured] | None = None) -> Row:
  """The row of ``global_batch`` sequences a step split into the micro-batch and GA that fit and train fastest
  (``--global-batch``): the micro-batches that divide it compiled largest first until one fits, then smaller
  ones while each trains faster (calibrated, else predicted); a step without a time stops at the largest.
  With ``run`` (``--measure``: a row's step run on this machine's chips), every split that fits within
  :data:`CLOSE` of the fastest is run and the fastest measured chosen. The row chosen has its ``ga`` set (the
  last compiled where none fits) and ``splits`` every split compiled (``row_at``: a row compiled at
  ``(micro-batch, GA)``); a PlanError where no multiple of ``unit`` divides ``global_batch``.
  """
  candidates = [m for m in range(global_batch - global_batch % unit, 0, -unit) if global_batch % m == 0]
  if not candidates:
    raise PlanError(f"--global-batch {global_batch} is not a multiple of the batch axes' size, {unit}: no "
                    "micro-batch splits it")
  tried: list[Row] = []
  best = None
  for micro in candidates:
    tried.append(dataclasses.replace(row_at(micro, global_batch // micro), ga=global_batch // micro))
    if best is not None and not (tried[-1].verdict and _faster(tried[-1], best)):
      break
    if tried[-1].verdict:
      best = tried[-1]
  if best is not None and run is not None:
    tried = [dataclasses.replace(r, measured=(run(r),)) if _close(r, best) else r for r in tried]
    seconds = lambda r: (r.measured or (Measured(r.batch, None),))[0].step_s  # noqa: E731
    ran = [r for r in tried if seconds(r)]
    best = min(ran, key=lambda r: seconds(r) or 0.0) if ran else best
  chosen = best or tried[-1]
  return dataclasses.replace(chosen, splits=tuple(_split(r) for r in tried))


def _close(row: Row, best: Row) -> bool:
  """Whether ``row`` fits and its step is within :data:`CLOSE` of ``best``'s, by the time both have (``best``
  itself where neither has one)."""
  calibrated = judged_by_calibrated((row.figures, best.figures))
  a, b = step_s(row.figures, calibrated), step_s(best.figures, calibrated)
  return bool(row.verdict) and (row is best if a is None or b is None else a <= b * (1 + CLOSE))


def _split(row: Row) -> Split:
  """``row`` as one split tried, its time the best kind it has."""
  f, ran = row.figures, row.measured[0].step_s if row.measured else None
  step, kind = next(((t, k) for t, k in ((ran, "measured"), (f.calibrated_step_s, "calibrated"),
                                         (f.predicted_step_s, "predicted")) if t), (None, None))
  return Split(row.batch, row.ga or 1, row.verdict, f.peak_bytes_per_device, step, kind,
               f.calibrated_step_s if kind == "measured" else None)


def _faster(row: Row, than: Row) -> bool:
  """Whether ``row``'s step is faster than ``than``'s, both by their calibrated time or by their predicted,
  by more than the bands of the parts they differ in allow (:func:`~nnx_zero1_plan.bands.told_apart`)."""
  calibrated = judged_by_calibrated((row.figures, than.figures))
  a, b = (parts_of(r.figures, calibrated, kind_bytes(r.figures.collectives)) for r in (row, than))
  return a is not None and b is not None and told_apart(a, b) == -1
