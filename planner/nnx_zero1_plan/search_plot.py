"""Each search's points as a PNG beside plan.md: where a larger micro-batch stops paying (remat: more compute
per token), its peak and predicted tokens per second against the micro-batch."""

from __future__ import annotations

import os
from collections.abc import Sequence

from nnx_zero1_plan.row import Row


def draw_search(rows: Sequence[Row], path: str) -> str | None:
  """Each searched lever's peak and predicted tokens per second against the micro-batch, as a PNG at
  ``path``; None (nothing drawn) without a search, a time, or matplotlib."""
  searched = [(f"{r.lever} ({r.step})", sorted(r.searched.search, key=lambda p: p.batch)) for r in rows
              if r.searched is not None and any(p.tokens_per_s_per_device for p in r.searched.search)]
  if not searched:
    return None
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return None
  fig, (memory, speed) = plt.subplots(1, 2, figsize=(11, 4))
  for label, points in searched:
    held = [p for p in points if p.peak_bytes_per_device]
    memory.plot([p.batch for p in held], [(p.peak_bytes_per_device or 0) / 2**30 for p in held], "o-",
                label=label)
    timed = [p for p in points if p.tokens_per_s_per_device and p.fits]
    speed.plot([p.batch for p in timed], [p.tokens_per_s_per_device for p in timed], "o-", label=label)
  memory.axhline(rows[0].usable_bytes / 2**30, color="grey", linestyle="--", label="usable")
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
