"""Judging a step-time goal from noisy timings: met, missed, or inconclusive.

The bench times its arms interleaved (step i of every arm, alternating the
order), so the i-th step of two arms ran under the same machine load. Their
ratio per step is a paired sample; the median of those ratios, with a bootstrap
interval over the steps, says how far the ratio is known. A goal is met when the
whole interval is under it, missed when the whole interval is over it, and
otherwise the timings cannot tell: a busy machine gives an honest
"inconclusive" instead of a verdict drawn from one noisy median.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

__all__ = ["INCONCLUSIVE", "MIN_STEPS", "RatioEstimate", "estimate_ratio", "judge", "judge_all", "overall"]

MIN_STEPS = 5  # fewer paired steps than this give no interval worth the name
_RESAMPLES = 2000
_LEVEL = 0.95


@dataclasses.dataclass(frozen=True)
class RatioEstimate:
  """The median of paired per-step time ratios and its bootstrap interval.

  ``low``/``high`` are None when there were fewer than ``MIN_STEPS`` pairs.
  """

  median: float
  low: float | None
  high: float | None
  steps: int

  @property
  def noise(self) -> float | None:
    """Half the interval's width, relative to the median (0.02 is +-2%)."""
    if self.low is None or self.high is None:
      return None
    return (self.high - self.low) / 2 / self.median

  def __str__(self) -> str:
    if self.low is None:
      return f"{self.median:.3f} ({self.steps} steps)"
    return f"{self.median:.3f} [{self.low:.3f}, {self.high:.3f}]"


def estimate_ratio(times: Sequence[float], reference: Sequence[float], seed: int = 0) -> RatioEstimate:
  """The median of ``times[i] / reference[i]`` with a 95% bootstrap interval over the steps.

  Args:
    times: one arm's step times, in the order they were taken.
    reference: the reference arm's step times, taken interleaved with ``times``.
    seed: the bootstrap's random seed (fixed, so a result file reproduces).

  Returns:
    A ``RatioEstimate``; no interval for fewer than ``MIN_STEPS`` pairs.

  Raises:
    ValueError: the two lists differ in length or are empty.

  Example::

    >>> estimate_ratio([1.0] * 6, [1.0] * 6)
    RatioEstimate(median=1.0, low=1.0, high=1.0, steps=6)
  """
  if len(times) != len(reference) or not times:
    raise ValueError(f"paired step times needed, got {len(times)} and {len(reference)}")
  ratios = np.asarray(times, np.float64) / np.asarray(reference, np.float64)
  median = float(np.median(ratios))
  if len(ratios) < MIN_STEPS:
    return RatioEstimate(median, None, None, len(ratios))
  rng = np.random.default_rng(seed)
  samples = rng.choice(ratios, size=(_RESAMPLES, len(ratios)), replace=True)
  medians = np.median(samples, axis=1)
  tail = (1 - _LEVEL) / 2
  low, high = np.quantile(medians, [tail, 1 - tail])
  return RatioEstimate(median, float(low), float(high), len(ratios))


def judge(estimate: RatioEstimate, goal: float) -> str:
  """``"met"``, ``"missed"`` or ``"inconclusive (noise +-x%)"`` for the goal ratio <= ``goal``.

  Args:
    estimate: the measured ratio and its interval.
    goal: the largest ratio that meets the goal.

  Returns:
    "met" when the whole interval is at or under ``goal``, "missed" when it is
    all over, otherwise "inconclusive" with the interval's half-width.

  Example::

    >>> judge(RatioEstimate(1.10, 1.02, 1.18, 10), goal=1.05)
    'inconclusive (noise ±7.3%)'
  """
  if estimate.low is None or estimate.high is None or estimate.noise is None:
    return f"inconclusive ({estimate.steps} timed steps; {MIN_STEPS} or more give an interval)"
  if estimate.high <= goal:
    return "met"
  if estimate.low > goal:
    return "missed"
  return f"inconclusive (noise ±{100 * estimate.noise:.1f}%)"


def judge_all(verdicts: Sequence[str]) -> str:
  """One verdict for several measurements of the same goal: missed if any is, met if all are.

  Example::

    >>> judge_all(["met", "inconclusive (noise ±3.0%)"])
    'inconclusive (noise ±3.0%)'
  """
  if not verdicts:
    return "not measured"
  if "missed" in verdicts:
    return "missed"
  pending = [v for v in verdicts if v != "met"]
  return pending[0] if pending else "met"


# What "inconclusive" means, said in the bench's own output.
INCONCLUSIVE = (
    "inconclusive: the 95% interval of the paired per-step time ratios lies on both sides of the goal "
    "(noise ±x% is half its width), so this machine's timing noise cannot tell met from missed; a quieter "
    "machine or more --steps can. Memory, collectives and bit-identity never depend on timing."
)


def overall(goals: Sequence[str]) -> str:
  """One line for the bench's goal lines: every goal met, or which were not and how.

  A goal line reads ``NAME (...): MEASURED -> VERDICT``; lines that start ``(no goal)`` are
  figures, not goals.

  Example::

    >>> overall(["memory <= 1.02: 1.000 -> met", "(no goal) step time: 1.1"])
    'verdict: every goal met (1 goal)'
    >>> overall(["memory <= 1.02: 1.000 -> met", "step <= 1.05 (median): 1.1 -> inconclusive (noise ±5%)"])
    'verdict: 1 of 2 goals not met: step <= 1.05 (inconclusive: noise ±5%)'
  """
  judged = [(g.split(": ")[0].split(" (")[0], g.rsplit(" -> ", 1)[1] if " -> " in g else "not measured")
            for g in goals if not g.startswith("(no goal)")]
  left = [f"{name} ({_short(v)})" for name, v in judged if v != "met"]
  plural = "s" if len(judged) != 1 else ""
  if not left:
    return f"verdict: every goal met ({len(judged)} goal{plural})"
  return f"verdict: {len(left)} of {len(judged)} goal{plural} not met: " + "; ".join(left)


def _short(verdict: str) -> str:
  """A goal's verdict with its reason in a few words: ``inconclusive: machine busy``, ``missed``."""
  word, _, reason = verdict.partition(" (")
  return f"{word}: {reason.split(':')[0].split(';')[0].rstrip(')')}" if reason else word
