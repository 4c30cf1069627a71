"""How far each part of a predicted step holds, in one table (:data:`BANDS`, each band from the measurements
docs/accuracy.md keeps), and the one rule that ranks two steps by time (:func:`told_apart`): only where no
error those bands allow turns their difference around; otherwise they are equal within what the plan can
tell, and the plan says which part they differ in."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from nnx_zero1_plan.row import Figures, Point

COMPUTE = "compute from the cost model"
COMPUTE_CALIBRATED = "compute calibrated on the chip"
HOST = "host copies"
SLICE = "collectives on the slice"
SLICE_CALIBRATED = "collectives calibrated on the slice"
SLOW = "the slow network"
# Steps whose times are this close are a tie whatever their parts: the cost model's error moves by about as
# much between programs built alike (+12.8%, +13.0% and +14.9% for three levers at one micro-batch on v5e).
SAME_SPEED = 0.02


@dataclasses.dataclass(frozen=True)
class Band:
  """How far a part of the predicted step holds: the plan's error against the chips, least and most (+: the
  plan said more; ``low`` None: no bound, never measured), whether one error holds for every row of a plan (a
  rate, one cost model: their difference keeps its sign) or each row errs its own way (the collectives'
  kinds, priced apart), and what it rests on."""

  low: float | None
  high: float
  shared: bool
  rests_on: str

  def factors(self) -> tuple[float, float]:
    """The least and most the chip's time can be, as a multiple of the plan's."""
    return 1 / (1 + self.high), math.inf if self.low is None else 1 / (1 + self.low)

  def said(self) -> str:
    """The band in words (``+2.1% to +18.5%``)."""
    low = "any amount under" if self.low is None else f"{self.low:+.1%}"
    return f"{low} to {self.high:+.1%}"


# The seed's pair on v6e:2x2 (docs/data/maxtext_qwen3_0p6b_v6e_seed): the program prices Zero-1's collectives
# at 42.0 ms to the baseline's 20.8 where the chips took the same step (437.5 and 437.6 ms), and its tensor-
# parallel arm's 489.0 ms of collectives short of the chips' 918.8 ms step by what its compute (375.2 ms,
# over by the cost model's most) leaves them: tests/planner/test_bands.py holds both to the kept plans.
PAIR_OVER = 1.02
TENSOR_UNDER = -0.19
BANDS: Mapping[str, Band] = {
    COMPUTE_CALIBRATED: Band(-0.044, 0.044, True, "as steps built as the calibrating run came on a v5e"),
    COMPUTE: Band(0.021, 0.185, True, "as 13 steps came on one v5e chip, always over"),
    HOST: Band(-0.021, 0.021, True, "as the offload step came at the host link measured on the v5e"),
    SLICE: Band(TENSOR_UNDER, PAIR_OVER, False,
                "which no chip has measured; on the one slice measured (v6e:2x2), Zero-1 and the baseline "
                "took the same step"),
    SLICE_CALIBRATED: Band(-0.044, 0.044, False, "each kind timed on this slice by --measure"),
    SLOW: Band(None, 0.0, True, "its public peak rate with no latency, never measured"),
}


def parts_of(t: Figures | Point, calibrated: bool) -> dict[str, float] | None:
  """A step's time by the source of each part (seconds): its exposed collectives on the slice, host copies and
  slow network, and the compute the rest of it; None where the step has no such time.

  Example::

    >>> from nnx_zero1_plan.row import StepTime
    >>> t = StepTime("", [], compute_s=0.3, fast_network="ICI", fast_s=0.05, fast_exposed_s=0.02,
    ...              slow_network=None, slow_s=0.0, host_s=None, host_exposed_s=0.0, unestimated_ops=0,
    ...              clock_ghz=None, roofline_s=None)
    >>> parts_of(Figures(predicted_step_s=0.32, step_time=t), calibrated=False)
    {'compute from the cost model': 0.3, 'collectives on the slice': 0.02}
  """
  total = t.calibrated_step_s if calibrated else t.predicted_step_s
  if total is None:
    return None
  st, own = t.step_time, calibrated and t.calibrated_collective_s is not None
  if st is None:
    return {COMPUTE_CALIBRATED if calibrated else COMPUTE: total}
  slice_s = t.calibrated_collective_s if own else st.fast_exposed_s
  parts = {SLICE_CALIBRATED if own else SLICE: slice_s, HOST: st.host_exposed_s, SLOW: st.slow_s}
  compute = {COMPUTE_CALIBRATED if calibrated else COMPUTE: total - sum(p or 0.0 for p in parts.values())}
  return {k: round(v, 9) for k, v in {**compute, **parts}.items() if v}


def _times(x: float, f: float) -> float:
  return 0.0 if x == 0 else x * f


def difference(a: Mapping[str, float], b: Mapping[str, float]) -> tuple[float, float]:
  """The least and most ``a``'s time on the chips can exceed ``b``'s, each part within its band (a shared
  band's one error on both, another's on each apart)."""
  least = most = 0.0
  for source in {**a, **b}:
    x, y = a.get(source, 0.0), b.get(source, 0.0)
    if x == y:
      continue
    small, large = BANDS[source].factors()
    if BANDS[source].shared:
      d = x - y
      least, most = least + _times(d, small if d > 0 else large), most + _times(d, large if d > 0 else small)
    else:
      least, most = least + _times(x, small) - _times(y, large), most + _times(x, large) - _times(y, small)
  return least, most


def told_apart(a: Mapping[str, float], b: Mapping[str, float]) -> int | None:
  """Which of two steps is faster, by parts of one basis (seconds a step, or a token): -1 ``a``, 1 ``b``;
  None where they are within :data:`SAME_SPEED` or the bands of the parts they differ in could turn their
  difference around: equal within what the plan can tell.

  Example::

    >>> told_apart({COMPUTE: 0.388, SLICE: 0.021}, {COMPUTE: 0.38, SLICE: 0.042}) is None  # the seed's pair
    True
    >>> told_apart({COMPUTE: 0.3, SLOW: 0.1}, {COMPUTE: 0.3, SLOW: 0.15})  # 1.5x the bytes between slices
    -1
  """
  ta, tb = sum(a.values()), sum(b.values())
  if abs(ta - tb) <= SAME_SPEED * min(ta, tb):
    return None
  least, most = difference(a, b)
  return -1 if most < 0 else 1 if least > 0 else None


def differ_in(a: Mapping[str, float], b: Mapping[str, float], names: tuple[str, str]) -> str:
  """The parts two steps differ in by more than 1% that could turn their difference around (each row erring
  its own way; all such parts where none does), ms a step each, with the band and what it rests on.

  Example::

    >>> zero1, baseline = {COMPUTE: 0.15, SLICE: 0.1077}, {COMPUTE: 0.156, SLICE: 0.0585}
    >>> print(differ_in(zero1, baseline, ("zero1", "baseline")))
    collectives on the slice (zero1 107.7 ms, baseline 58.5; the plan -19.0% to +102.0% of the chips there), \
which no chip has measured; on the one slice measured (v6e:2x2), Zero-1 and the baseline took the same step
  """
  x, y = (lambda k: a.get(k, 0.0)), (lambda k: b.get(k, 0.0))
  apart = [k for k in {**a, **b} if abs(x(k) - y(k)) > 0.01 * max(x(k), y(k))]
  named = [k for k in apart if not BANDS[k].shared] or apart
  said = [f"{k} ({names[0]} {x(k) * 1e3:.1f} ms, {names[1]} {y(k) * 1e3:.1f}; the plan "
          f"{BANDS[k].said()} of the chips there), {BANDS[k].rests_on}" for k in named]
  return "; ".join(said) or "nothing beyond 1%"
