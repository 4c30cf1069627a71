"""plan.md: the settings, every column of the rows, what the columns mean, the predicted step time part by
part, each search's compiles, the lines under the tables and what to try next."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from nnx_zero1_plan import cells
from nnx_zero1_plan.cells import gib, ms, tokens
from nnx_zero1_plan.row import Row

_PARTS = ("lever", "step", "micro-batch", "step ms", "compute ms", "fast network ms (exposed)",
          "slow network ms", "host copies ms (exposed)", "roofline ms (lower bound)", "MFU", "tok/s/device",
          "programs per step")
_NOTE = ("Compiled ahead of time on a machine without the chips; nothing ran. Per device: `opt` is the "
         "optimizer state in device memory, `args` / `temp` the compiled step's argument and temporary bytes "
         "(`memory_analysis()`), `peak` the compiler's own figure for what the program holds at once (the "
         "settings' `peak_source`; the TPU compiler's temporaries overlap the arguments near the limit), "
         "`args+temp` = args + output - donated + temp, for comparison; `usable` is the memory a program may "
         "use on the chip (TPU: the compiler's available HBM; GPU: jax's memory pool, which the compiler is "
         "told to plan for) less the reserve or margin; `fits`: the compiler accepted the program and peak "
         "<= usable. Step `one` is one program (gradients, then update); `split` is two (gradients, then "
         "update): its args add the optimizer state the gradient program leaves resident, its peak is the "
         "larger program's, its collectives both programs'. The update program's flops and bytes accessed "
         "are the compiler's cost analysis for one device (none on GPU; there a step's flops are its matmuls "
         "counted from the compiled HLO). Collectives are read from the compiled HLO; those in the "
         "micro-batch loop count once per trip (`per micro-batch`).")
_POD_NOTE = (" On a pod, what one device sends per step inside its slice or node (ICI, NVLink) and over the "
             "slow network between them (DCN, InfiniBand): a TPU program's collectives and its megascale "
             "transfers; a GPU program's node-spanning collectives split by NCCL's hierarchical algorithm "
             "(an estimate). The times are estimates: the bytes at the chip's public per-direction "
             "bandwidth, no latency, no overlap.")


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
  has none."""
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
              "matrix units' FLOPs per cycle). A collective takes its ring bytes over the links its group "
              "uses (on a TPU slice each link's public one-way rate, the rings the compiler names, 1 us a "
              "hop; a GPU's NVLink rate), never measured on a slice; the schedule's async collectives "
              "overlap the compute placed between their start and done, the rest is exposed (in brackets). "
              "The slow network's bytes are counted exposed. Roofline: the step's matmul FLOPs over the "
              "chip's peak, a lower bound."]
  return lines + [f"No predicted time: {why}." for why in absent]


def search_lines(rows: Sequence[Row]) -> list[str]:
  """plan.md's table of every point each search compiled: micro-batch, verdict, peak, predicted step and
  tokens per second per device, in micro-batch order."""
  if not any(r.searched is not None for r in rows):
    return []
  head = ("lever", "step", "micro-batch", "fits", "peak GiB", "step ms (pred.)", "tok/s/device")
  body = [(r.lever, r.step, str(p.batch), "yes" if p.fits else "no", gib(p.peak_bytes_per_device),
           ms(p.predicted_step_s), tokens(p.tokens_per_s_per_device))
          for r in rows if r.searched is not None for p in sorted(r.searched.search, key=lambda p: p.batch)]
  return ["", "## Each search's compiles", *markdown_table(head, body)]


def markdown(settings: Mapping[str, Any], rows: Sequence[Row], steps: Sequence[str],
             closing: Sequence[str] = ()) -> str:
  """plan.md: the ``settings`` (plan.json's ``meta``, key by key), the table, the ``closing`` lines under it
  (:mod:`nnx_zero1_plan.closing_lines`') and what to try next where nothing fits (``steps``)."""
  lines = ["# Will it fit? nnx-zero1 plan, compiled ahead of time", ""]
  lines += [f"- {k}: {json.dumps(v) if isinstance(v, dict | list) else v}" for k, v in settings.items()]
  if rows:
    lines += markdown_table(*cells.row_cells(rows))
    lines += ["", _NOTE + (_POD_NOTE if cells.is_pod(rows) else "")]
    edges = cells.edge_cells(rows)
    if edges:
      lines += ["", "## At each lever's largest micro-batch", ""] + markdown_table(cells.EDGE_HEADER, edges)
    head, runs = cells.measured_cells(rows)
    if runs:
      lines += ["", "## Measured", "", cells.MEASURED_TITLE + ".", *markdown_table(head, runs)]
    lines += time_lines(rows) + search_lines(rows)
  lines += closing
  if steps:
    numbered = (f"{i}. {s}" for i, s in enumerate(steps, 1))
    lines += ["", "## Nothing fits: what to try next, in order", "", *numbered]
  return "\n".join(lines) + "\n"
