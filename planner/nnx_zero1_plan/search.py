"""The largest micro-batch that fits, found with as few compiles as the arithmetic allows.

A step's peak grows close to linearly with its micro-batch (the activations), so
two compiles give a line and the line gives the limit; the compiles at the
predicted limit and one step above it confirm the edge. Where the line falls
short, the edge is galloped to (one step, two, four); where it overshoots (the
compiler rematerialises or schedules differently near the limit), the line
between the largest micro-batch known to fit and the smallest known not to
takes turns with bisection. The compiler's peaks are not exactly monotone (a few
MiB of scheduling noise between neighbours), so the edge is a micro-batch that
fits with the one a step above it refused. Pure: the compiles are the caller's
``measure``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

__all__ = ["Probe", "Edge", "round_down", "line_limit", "find_edge", "next_fraction"]


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
  """The line's limit through the largest compile that fits and one far below it (at most half its
  micro-batch, else the smallest): far apart, so that the compiler's noise of a few MiB between
  neighbouring micro-batches does not tilt the line."""
  fitting = sorted((p for p in probes.values() if p.fits and p.peak is not None), key=lambda p: p.batch)
  if len(fitting) < 2:
    return None
  top = fitting[-1]
  far = [p for p in fitting[:-1] if p.batch <= top.batch // 2] or fitting[:1]
  return line_limit(far[-1], top, usable, step)


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
  stride = 0  # once the line stops gaining, the edge is galloped to: one step, two, four, ...
  moved: list[bool] = []  # once bracketed, which end each compile moved (True: the fitting one)
  top = round_down(cap, step)
  while len(probes) < max_compiles and (hi is None or hi - lo > step):
    if hi is None:
      guess = _line_guess(probes, usable, step)
      if guess is None:  # no rising line yet (a fixed part dominates small micro-batches): double
        batch = 2 * lo
      elif guess >= lo + 2 * step:  # at most 8x in one jump: a nearly flat line overshoots wildly
        batch, stride = min(guess, 8 * lo), 0
      else:
        stride = 2 * stride or step
        batch = lo + stride
      batch = min(batch, top)
      if batch <= lo:
        break
    else:
      # The line between the ends, kept one step inside them; bisection when the line moved the
      # same end twice running (it is bent there, and would creep).
      guess = line_limit(probes[lo], probes[hi], usable, step)
      if guess is None or moved[-2:] in ([True, True], [False, False]):
        batch = round_down((lo + hi) // 2, step)
      else:
        batch = min(max(guess, lo + step), hi - step)
    fits = at(batch).fits
    if hi is not None:
      moved.append(fits)
    lo, hi = (batch, hi) if fits else (lo, batch)
  return edge(lo, hi)


def next_fraction(peak: int, usable: int, state_bytes: int, fraction: float = 0.0) -> float | None:
  """The share of the optimizer state to offload next, for a step whose peak with ``fraction`` of it
  offloaded is ``peak``: ``fraction`` when it fits, else ``fraction`` plus the bytes over ``usable`` as a
  share of ``state_bytes`` (the bytes the whole state saves: its bytes per device, or what a line
  through two compiles says), rounded up to a hundredth; None when that is more than the whole state.

  Example::

    >>> next_fraction(peak=110, usable=100, state_bytes=40), next_fraction(95, 100, 40, 0.25)
    (0.25, 0.25)
    >>> next_fraction(150, 100, 40) is None
    True
  """
  if peak <= usable:
    return fraction
  share = fraction + (peak - usable) / max(state_bytes, 1)
  share = math.ceil(round(share * 100, 6)) / 100
  return None if share > 1 else share
