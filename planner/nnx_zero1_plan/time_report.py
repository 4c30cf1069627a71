"""A plan's predicted step times in plan.md: every part of each row's time, and each search's points.

The parts are the row's :class:`~nnx_zero1_plan.row.StepTime` (:func:`nnx_zero1_plan.predict_step_time`);
a search's points show where a larger micro-batch stops paying (the compiler rematerialises to fit: more
compute per token), as a table and, where matplotlib is installed, a PNG beside plan.md. Pure, but for the
PNG.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from nnx_zero1_plan.row import Row

__all__ = ["time_lines", "search_lines", "draw_search"]

_PARTS = ("lever", "step", "micro-batch", "step ms", "compute ms", "fast network ms (exposed)",
          "slow network ms", "host copies ms (exposed)", "roofline ms (lower bound)", "MFU", "tok/s/device",
          "programs per step")


def _ms(seconds: float | None) -> str:
  return "-" if seconds is None else f"{seconds * 1e3:,.1f}"


def time_lines(rows: Sequence[Row]) -> list[str]:
  """plan.md's section on the predicted step time: one line per timed row with every part, and why a row
  has none.

  Example::

    >>> time_lines([])
    []
  """
  timed = [r for r in rows if r.figures.step_time is not None]
  absent = sorted({r.figures.time_absent for r in rows if r.figures.time_absent})
  if not timed and not absent:
    return []
  lines = ["", "## Predicted step time (one device)", ""]
  if timed:
    lines += ["| " + " | ".join(_PARTS) + " |", "|" + "|".join("---" for _ in _PARTS) + "|"]
  for r in timed:
    t, f = r.figures.step_time, r.figures
    assert t is not None
    host = "not timed" if t.host_s is None else f"{_ms(t.host_s)} ({_ms(t.host_exposed_s)})"
    slow = "-" if t.slow_network is None else f"{t.slow_network} {_ms(t.slow_s)}"
    cells = (r.lever, r.step, str(r.batch), _ms(f.predicted_step_s), _ms(t.compute_s),
             f"{t.fast_network} {_ms(t.fast_s)} ({_ms(t.fast_exposed_s)})", slow, host, _ms(t.roofline_s),
             "-" if f.mfu is None else f"{f.mfu:.1%}",
             "-" if f.tokens_per_s_per_device is None else f"{f.tokens_per_s_per_device:,.0f}",
             ", ".join(t.programs))
    lines.append("| " + " | ".join(cells) + " |")
  if timed:
    t = timed[0].figures.step_time
    assert t is not None
    lines += ["", f"Compute: {t.source} (clock {t.clock_ghz} GHz: the chip's public bfloat16 peak over its "
              "matrix units' FLOPs per cycle). A collective takes its ring bytes over its network's public "
              "rate; the schedule's async collectives overlap the compute placed between their start and "
              "done, the rest is exposed (in brackets). The slow network's bytes are counted exposed. "
              "Roofline: the step's matmul FLOPs over the chip's peak, a lower bound."]
  lines += [f"No predicted time: {why}." for why in absent]
  return lines


def search_lines(rows: Sequence[Row]) -> list[str]:
  """plan.md's table of every point each search compiled: micro-batch, verdict, peak, predicted step and
  tokens per second per device, in micro-batch order.

  Example::

    >>> search_lines([])
    []
  """
  searched = [r for r in rows if r.searched is not None]
  if not searched:
    return []
  head = ("lever", "step", "micro-batch", "fits", "peak GiB", "step ms (pred.)", "tok/s/device")
  lines = ["", "## Each search's compiles", "", "| " + " | ".join(head) + " |",
           "|" + "|".join("---" for _ in head) + "|"]
  for r in searched:
    assert r.searched is not None
    for p in sorted(r.searched.search, key=lambda p: p.batch):
      peak = "-" if p.peak_bytes_per_device is None else f"{p.peak_bytes_per_device / 2**30:.2f}"
      tokens = "-" if p.tokens_per_s_per_device is None else f"{p.tokens_per_s_per_device:,.0f}"
      lines.append(f"| {r.lever} | {r.step} | {p.batch} | {'yes' if p.fits else 'no'} | {peak} | "
                   f"{_ms(p.predicted_step_s)} | {tokens} |")
  return lines


def draw_search(rows: Sequence[Row], path: str) -> str | None:
  """Each searched lever's peak and predicted tokens per second against the micro-batch, as a PNG at
  ``path``; None (nothing drawn) without a search, a time, or matplotlib."""
  searched = [r for r in rows if r.searched is not None
              and any(p.tokens_per_s_per_device for p in r.searched.search)]
  if not searched:
    return None
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return None
  fig, (memory, speed) = plt.subplots(1, 2, figsize=(11, 4))
  for r in searched:
    assert r.searched is not None
    points = sorted(r.searched.search, key=lambda p: p.batch)
    label = f"{r.lever} ({r.step})"
    held = [p for p in points if p.peak_bytes_per_device]
    memory.plot([p.batch for p in held], [(p.peak_bytes_per_device or 0) / 2**30 for p in held], "o-",
                label=label)
    timed = [p for p in points if p.tokens_per_s_per_device and p.fits]
    speed.plot([p.batch for p in timed], [p.tokens_per_s_per_device for p in timed], "o-", label=label)
  memory.axhline(searched[0].usable_bytes / 2**30, color="grey", linestyle="--", label="usable")
  for axes in (memory, speed):
    axes.set_xscale("log", base=2)
  memory.set(xlabel="micro-batch", ylabel="peak GiB per device", title="memory (compiled)")
  speed.set(xlabel="micro-batch", ylabel="tokens/s per device", title="predicted throughput (fits only)")
  memory.legend(fontsize=8)
  speed.legend(fontsize=8)
  fig.tight_layout()
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path
