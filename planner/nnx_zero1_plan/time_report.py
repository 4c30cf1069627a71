"""plan.md's step times, and the cells' formats every table of the plan shares. A search's points show where a
larger micro-batch stops paying (remat: more compute per token), as a table and, with matplotlib, a PNG."""

from __future__ import annotations

import os
from collections.abc import Sequence

from nnx_zero1_plan.row import Row

__all__ = ["ms", "gib", "tokens", "markdown_table", "time_lines", "search_lines", "draw_search"]

_PARTS = ("lever", "step", "micro-batch", "step ms", "compute ms", "fast network ms (exposed)",
          "slow network ms", "host copies ms (exposed)", "roofline ms (lower bound)", "MFU", "tok/s/device",
          "programs per step")


def ms(seconds: float | None) -> str:
  """Seconds as every table of the plan prints them: milliseconds (``-``: none)."""
  return "-" if seconds is None else f"{seconds * 1e3:,.1f}"


def gib(n: float | None) -> str:
  """Bytes as every table of the plan prints them: GiB (``-``: none)."""
  return "-" if n is None else f"{n / 2**30:.2f}"


def tokens(per_s: float | None) -> str:
  """Tokens per second as every table of the plan prints them (``-``: none)."""
  return "-" if per_s is None else f"{per_s:,.0f}"


def markdown_table(header: Sequence[str], body: Sequence[Sequence[str]]) -> list[str]:
  """A table as plan.md writes it, after a blank line (a ``|`` in a cell written ``/``)."""
  return ["", "| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|",
          *("| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in body)]


def _parts(r: Row) -> tuple[str, ...]:
  """A timed row's cells in :data:`_PARTS`' order."""
  t, f = r.figures.step_time, r.figures
  assert t is not None
  host = "not timed" if t.host_s is None else f"{ms(t.host_s)} ({ms(t.host_exposed_s)})"
  slow = "-" if t.slow_network is None else f"{t.slow_network} {ms(t.slow_s)}"
  return (r.lever, r.step, str(r.batch), ms(f.predicted_step_s), ms(t.compute_s),
          f"{t.fast_network} {ms(t.fast_s)} ({ms(t.fast_exposed_s)})", slow, host, ms(t.roofline_s),
          "-" if f.mfu is None else f"{f.mfu:.1%}", tokens(f.tokens_per_s_per_device), ", ".join(t.programs))


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
  lines = ["", "## Predicted step time (one device)"]
  t = timed[0].figures.step_time if timed else None
  if t is None:
    lines.append("")
  else:
    lines += [*markdown_table(_PARTS, [_parts(r) for r in timed]), "",
              f"Compute: {t.source} (clock {t.clock_ghz} GHz: the chip's public bfloat16 peak over its "
              "matrix units' FLOPs per cycle). A collective takes its ring bytes over its network's public "
              "rate; the schedule's async collectives overlap the compute placed between their start and "
              "done, the rest is exposed (in brackets). The slow network's bytes are counted exposed. "
              "Roofline: the step's matmul FLOPs over the chip's peak, a lower bound."]
  return lines + [f"No predicted time: {why}." for why in absent]


def search_lines(rows: Sequence[Row]) -> list[str]:
  """plan.md's table of every point each search compiled: micro-batch, verdict, peak, predicted step and
  tokens per second per device, in micro-batch order.

  Example::

    >>> search_lines([])
    []
  """
  if not any(r.searched is not None for r in rows):
    return []
  head = ("lever", "step", "micro-batch", "fits", "peak GiB", "step ms (pred.)", "tok/s/device")
  body = [(r.lever, r.step, str(p.batch), "yes" if p.fits else "no", gib(p.peak_bytes_per_device),
           ms(p.predicted_step_s), tokens(p.tokens_per_s_per_device))
          for r in rows if r.searched is not None for p in sorted(r.searched.search, key=lambda p: p.batch)]
  return ["", "## Each search's compiles", *markdown_table(head, body)]


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
  memory.set(xlabel="micro-batch", ylabel="peak GiB per device", title="memory (compiled)")
  speed.set(xlabel="micro-batch", ylabel="tokens/s per device", title="predicted throughput (fits only)")
  for axes in (memory, speed):
    axes.set_xscale("log", base=2)
    axes.legend(fontsize=8)
  fig.tight_layout()
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path
