"""The largest micro-batch that fits, found with as few compiles as the arithmetic allows.

A step's peak grows close to linearly with its micro-batch (the activations), so
two compiles give a line and the line gives the limit; the compiles at the
predicted limit and one step above it confirm the edge. Where the line is wrong
(the compiler rematerialises or schedules differently near the limit) the edge
is bisected between the largest micro-batch known to fit and the smallest known
not to. Pure: the compiles are the caller's ``measure``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

__all__ = ["Probe", "Edge", "round_down", "line_limit", "find_edge"]


@dataclasses.dataclass(frozen=True)
class Probe:
  """One compile at one micro-batch: its peak bytes per device and whether it fits.

  Attributes:
    batch: the global micro-batch, in sequences.
    peak: peak bytes per device (None when the compiler refused the program).
    fits: the peak is within the usable memory (and the compiler accepted it).
    error: the compiler's refusal, in one line (None when it compiled).
  """

  batch: int
  peak: int | None
  fits: bool
  error: str | None = None


@dataclasses.dataclass(frozen=True)
class Edge:
  """Where a lever stops fitting.

  Attributes:
    max_micro_batch: the largest micro-batch that fits (None: not even the smallest).
    above: the micro-batch one step above it, compiled and refused (None: the search's cap fits).
    refused_because: why ``above`` does not fit: the compiler's refusal, or its peak against the
      usable memory.
    probes: every compile, in the order they ran.
  """

  max_micro_batch: int | None
  above: int | None
  refused_because: str | None
  probes: tuple[Probe, ...]


def round_down(batch: float, step: int) -> int:
  """``batch`` rounded down to a multiple of ``step``, at least ``step``.

  Example::

    >>> round_down(43.9, 4), round_down(2, 4)
    (40, 4)
  """
  return max(step, int(batch) // step * step)


def line_limit(p1: Probe, p2: Probe, usable: int, step: int) -> int | None:
  """The micro-batch at which the line through two compiles reaches ``usable`` (None: no rising line).

  Example::

    >>> line_limit(Probe(8, 10, True), Probe(16, 18, True), usable=50, step=4)
    48
  """
  if p1.peak is None or p2.peak is None or p1.batch == p2.batch:
    return None
  slope = (p2.peak - p1.peak) / (p2.batch - p1.batch)
  if slope <= 0:
    return None
  return round_down(p1.batch + (usable - p1.peak) / slope, step)


def _why(probe: Probe, usable: int) -> str:
  if probe.error:
    return probe.error
  peak = "?" if probe.peak is None else f"{probe.peak / 2**30:.2f}"
  return f"peak {peak} GiB > usable {usable / 2**30:.2f} GiB"


def _line_guess(probes: dict[int, Probe], usable: int, step: int) -> int | None:
  """The line's limit through the compiles nearest the edge that have a peak: the largest that fits and the
  smallest that does not, else the two largest that fit."""
  known = sorted((p for p in probes.values() if p.peak is not None), key=lambda p: p.batch)
  fitting, over = [p for p in known if p.fits], [p for p in known if not p.fits]
  if fitting and over:
    return line_limit(fitting[-1], over[0], usable, step)
  return line_limit(fitting[-2], fitting[-1], usable, step) if len(fitting) > 1 else None


def _between(lo: int, hi: int | None, step: int, cap: int) -> int | None:
  """Bisection's next micro-batch (doubling while nothing was refused); None when the bracket is closed."""
  target = min(2 * lo, round_down(cap, step)) if hi is None else round_down((lo + hi) // 2, step)
  return target if target > lo and (hi is None or target < hi) else None


def find_edge(measure: Callable[[int], Probe], *, step: int, usable: int, start: int, cap: int = 1 << 14,
              max_compiles: int = 12) -> Edge:
  """The largest multiple of ``step`` whose compile fits, and the compile one step above it that does not.

  Args:
    measure: compiles the step at a global micro-batch and says what it needs (a :class:`Probe`).
    step: the micro-batch's unit: the batch axes' size (every device gets whole sequences).
    usable: bytes per device the step may use (the margin taken off already).
    start: the first micro-batch to compile (the user's ``--batch``).
    cap: the largest micro-batch the search compiles.
    max_compiles: a bound on the compiles; when it is reached the bracket so far is returned.

  Returns:
    An :class:`Edge`.

  Example::

    >>> peak = lambda b: 2 + b  # GiB-like units: 2 of state, 1 per sequence
    >>> edge = find_edge(lambda b: Probe(b, peak(b), peak(b) <= 50), step=4, usable=50, start=8)
    >>> edge.max_micro_batch, edge.above, len(edge.probes)
    (48, 52, 4)
  """
  probes: dict[int, Probe] = {}

  def at(batch: int) -> Probe:
    if batch not in probes:
      probes[batch] = measure(batch)
    return probes[batch]

  def edge(lo: int | None, hi: int | None) -> Edge:
    because = None if hi is None else _why(probes[hi], usable)
    return Edge(lo, hi, because, tuple(probes.values()))

  first = round_down(start, step)
  if not at(first).fits:
    if first == step or not at(step).fits:
      return edge(None, step)
    lo, hi = step, first
  else:
    lo, hi = first, None
  trust_line, guessed = True, None  # the line is tried once: its limit, then one step above it
  while len(probes) < max_compiles and (hi is None or hi - lo > step):
    guess = _line_guess(probes, usable, step) if trust_line else None
    if guess is not None and guess > lo and (hi is None or guess < hi) and guess <= cap:
      batch = guessed = guess
    elif guessed is not None and guessed == lo and lo + step not in probes and lo + step <= cap:
      batch, trust_line = lo + step, False  # confirm the line's limit: one step above it must not fit
    else:
      halfway = _between(lo, hi, step, cap)
      if halfway is None:
        break
      batch = halfway
    fits = at(batch).fits
    if batch == guessed and not fits:
      trust_line = False  # the line overshot: bisect
    lo, hi = (batch, hi) if fits else (lo, batch)
  return edge(lo, hi)
