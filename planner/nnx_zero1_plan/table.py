"""A plan's rows as text: the printed table and plan.md (with what to try next when nothing fits)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from nnx_zero1_plan.inputs import spelled_mesh
from nnx_zero1_plan.levers import LEVERS
from nnx_zero1_plan.networks import network_note
from nnx_zero1_plan.recommend import BY_THROUGHPUT, Recommendation, row_sent_bytes
from nnx_zero1_plan.row import Network, OpCount, Point, Row, StateSplit, op_counts
from nnx_zero1_plan.time_report import gib, markdown_table, ms, search_lines, time_lines, tokens
from nnx_zero1_plan.way_out import WayOut

__all__ = ["HEADER", "POD_HEADER", "EDGE_HEADER", "COMPACT", "collective_cell", "network_cell", "dtype_cell",
           "accumulation_note", "time_cells", "header", "cells", "edge_cells", "split_words", "way_out_lines",
           "table", "limit_words", "recommendation_lines", "markdown", "MEASURED_HEADER", "measured_cells"]

HEADER = ("lever", "step", "compiled for", "mesh", "opt GiB", "state dtype", "args GiB", "temp GiB",
          "peak GiB", "args+temp GiB", "usable GiB", "fits", "max micro-batch", "step ms (pred.)",
          "tok/s/device", "MFU", "compile s",
          "collectives per step (count x MiB)", "per micro-batch", "update GFLOP", "update GiB accessed",
          "note")
# A pod's plan has two more columns, before the note: what one device sends per step over each network.
POD_HEADER = ("inside slice/node per step, MiB (est.)", "over the slow network per step, MiB (est.)")

_SHORT = {"all-reduce": "AR", "reduce-scatter": "RS", "all-gather": "AG", "all-to-all": "A2A",
          "collective-permute": "CP", "to-device": "in", "to-host": "out"}


def collective_cell(c: Mapping[str, OpCount] | Mapping[str, Mapping[str, int]] | None) -> str:
  """Collectives (or host transfers: ``{op: {"count", "bytes"}}``, as the benchmarks keep them) as one table
  cell, count x MiB per op.

  Example::

    >>> collective_cell({"all-reduce": {"count": 2, "bytes": 2**20}, "all-gather": {"count": 0, "bytes": 0}})
    'AR 2x 1.000'
  """
  counts = op_counts(c) or {}
  parts = [f"{_SHORT[k]} {v.count}x {v.bytes / 2**20:.3f}" for k, v in counts.items() if v.count]
  return ", ".join(parts) or "-"


_SHORT_DTYPE = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "float64": "f64"}


def dtype_cell(by_dtype: Mapping[str, int] | None) -> str:
  """The dtypes the optimizer state is stored in, the largest first (``-``: not known, a refused row).

  Example::

    >>> dtype_cell({"bfloat16": 8, "float32": 64}), dtype_cell(None)
    ('f32+bf16', '-')
  """
  if not by_dtype:
    return "-"
  order = sorted(by_dtype, key=lambda d: -by_dtype[d])
  return "+".join(_SHORT_DTYPE.get(d, d) for d in order)


def time_cells(step_s: float | None, tokens_per_s: float | None, mfu: float | None,
               mark: str = "") -> tuple[str, str, str]:
  """A predicted step's cells: its milliseconds, the tokens one device trains on per second, its MFU.

  Example::

    >>> time_cells(0.4375, 74898.3, 0.21)
    ('437.5', '74,898', '21%')
  """
  return ("-" if step_s is None else mark + ms(step_s),
          "-" if tokens_per_s is None else mark + tokens(tokens_per_s), "-" if mfu is None else f"{mfu:.0%}")


def split_words(lever: str, split: StateSplit | None) -> str | None:
  """What a Zero-1 lever's layout splits (``split``: its row's ``state_split``), where it is not the whole
  state over every axis the lever names (None where it is, and for the baseline): the share of the state's
  bytes over each set of axes.

  Example::

    >>> split_words("zero1-pod", StateSplit(["replica", "data"], {"data": 0.998, "none": 0.002}))
    'splits 0% of the state over replica,data, 99.8% over data only'
    >>> split_words("zero1", StateSplit(["data"], {"data": 0.999, "none": 0.001})) is None
    True
  """
  if split is None or lever == "baseline":
    return None
  share, every = split.share, ",".join(split.axes)
  if share.get(every, 0) >= 0.99:
    return None
  words = [f"splits {share.get(every, 0):.0%} of the state over {every}"]
  words += [f"{v:.1%} over {k} only" for k, v in share.items() if k not in (every, "none") and v]
  return ", ".join(words)


def _note(r: Row, rows: Sequence[Row] = ()) -> str:
  notes = (split_words(r.lever, r.figures.state_split), _verdict_note(r), accumulation_note(r, rows),
           network_note(r.figures.step_time))
  return "; ".join(n for n in notes if n)


def accumulation_note(r: Row, rows: Sequence[Row]) -> str | None:
  """Where a lever of this library's accumulation (``-accum``) holds more than its one-program twin (the
  same layout, gradients from ``nnx.value_and_grad``) at the same micro-batch, how much and why, in the
  compiler's figures; None where it holds no more (1%), or the twin was not compiled.

  Example::

    >>> from nnx_zero1_plan.row import Figures, Made
    >>> def row(lever, peak, temp):
    ...   f = Figures(peak_bytes_per_device=peak * 2**30, temp_bytes_per_device=temp * 2**30)
    ...   return Row(lever, "one", "v5e:2x4", "TPU", {"data": 8}, "m", 16, f, Made(depth=2), 1, 1, True)
    >>> rows = [row("zero1", 14.75, 4.5), row("zero1-accum", 19.0, 8.75)]
    >>> print(accumulation_note(rows[1], rows).replace(": ", ":\\n"))
    needs 4.25 GiB more than zero1 at this micro-batch:
    its temporaries +4.25 GiB (the gradients it reduces once per step, held across the micro-batch loop:
    with one micro-batch, plan zero1)
  """
  lever = LEVERS.get(r.lever)
  if lever is None or not lever.deferred:
    return None
  twin_name = next((name for name, other in LEVERS.items() if other.zero1 and not other.deferred
                    and not other.accumulate_options and other.optimizer_options == lever.optimizer_options),
                   None)
  same = lambda t: t.lever == twin_name and (t.step, t.remat, t.batch) == (r.step, r.remat, r.batch)
  twin = next((t for t in rows if same(t)), None)
  mine, theirs = r.figures.peak_bytes_per_device, None if twin is None else twin.figures.peak_bytes_per_device
  if twin is None or mine is None or theirs is None or mine <= 1.01 * theirs:
    return None
  temp = (r.figures.temp_bytes_per_device or 0) - (twin.figures.temp_bytes_per_device or 0)
  return (f"needs {(mine - theirs) / 2**30:.2f} GiB more than {twin.lever} at this micro-batch: its "
          f"temporaries {temp / 2**30:+.2f} GiB (the gradients it reduces once per step, held across the "
          f"micro-batch loop: with one micro-batch, plan {twin.lever})")


def _verdict_note(r: Row) -> str:
  f, made = r.figures, r.made
  if f.error:
    return f"refused: {f.error}"
  if r.searched is not None and r.searched.search_unfinished:
    return f"edge not confirmed: {r.searched.search_unfinished}"
  if r.offloaded is not None and r.offloaded.offload_refused_because:
    return f"no fraction fits: {r.offloaded.offload_refused_because}"
  if made.compiled_whole_because:
    extrapolated = gib(made.extrapolated_peak_bytes_per_device)
    return f"compiled whole (estimate: {extrapolated} GiB; {made.compiled_whole_because})"
  if made.estimate:
    up_to = made.estimate.whole_peak_over_estimate_up_to
    return (f"~ ESTIMATE, {made.estimate.method}: decides nothing (whole programs have peaked up to "
            f"{up_to}x the estimate)")
  return ""


def _max_micro_batch(r: Row) -> str:
  if r.searched is None:
    return "-"
  return "none" if r.searched.max_micro_batch is None else str(r.searched.max_micro_batch)


def _lever(r: Row) -> str:
  """The lever, with the share it offloads (``offload-fraction``) and the state's bytes in host memory."""
  host = r.figures.host_state_bytes
  picked = "" if r.offloaded is None else f" {r.offloaded.offload_fraction:.2f}"
  return r.lever + picked + (f" (+{gib(host)} GiB host)" if host else "")


def network_cell(network: Network | None) -> str:
  """One network's bytes per step (MiB) and the time they take at its public bandwidth, an estimate.

  Example::

    >>> network_cell(Network("DCN", 1102404096, 176.4))
    'DCN 1,051.3 (~176.4 ms)'
  """
  if network is None:
    return "-"
  ms = "" if network.estimate_ms is None else f" (~{network.estimate_ms:,.1f} ms)"
  return f"{network.network} {network.bytes / 2**20:,.1f}{ms}"


def _is_pod(rows: Sequence[Row]) -> bool:
  return any(r.made.network_per_step is not None for r in rows)


def header(rows: Sequence[Row]) -> tuple[str, ...]:
  """:data:`HEADER`, with :data:`POD_HEADER` before the note where the rows are a pod's."""
  return HEADER[:-1] + POD_HEADER + HEADER[-1:] if _is_pod(rows) else HEADER


def cells(rows: Sequence[Row]) -> list[tuple[str, ...]]:
  """One tuple of strings per row, in :func:`header`'s order."""
  pod = _is_pod(rows)
  out: list[tuple[str, ...]] = []
  for r in rows:
    f = r.figures
    fits = "-" if r.verdict is None else "yes" if r.verdict else "NO"
    flops = f.update_flops_per_device
    network = r.made.network_per_step
    nets = (network.fast, network.slow) if network else (None, None)
    ex = "~" if r.estimated else ""  # an estimate's figures, each marked
    compile_s = f.compile_s if r.searched is None else r.searched.search_compile_s
    out.append((
        _lever(r), r.step + (f", remat {r.remat}" if r.remat else ""), r.compiled_for, spelled_mesh(r.mesh),
        gib(f.opt_state_bytes_per_device), dtype_cell(f.opt_state_bytes_by_dtype),
        ex + gib(f.argument_bytes_per_device),
        ex + gib(f.temp_bytes_per_device), ex + gib(f.peak_bytes_per_device),
        ex + gib(f.formula_peak_bytes_per_device), gib(r.usable_bytes),
        ex + fits, _max_micro_batch(r), *time_cells(f.predicted_step_s, f.tokens_per_s_per_device, f.mfu, ex),
        f"{compile_s:.0f}",
        ex + collective_cell(f.collectives.per_step if f.collectives else None),
        ex + collective_cell(f.collectives.per_micro_batch if f.collectives else None),
        "-" if flops is None else f"{ex}{flops / 1e9:.2f}", ex + gib(f.update_bytes_accessed_per_device),
        *((ex + network_cell(n) for n in nets) if pod else ()),
        _note(r, rows),
    ))
  return out


EDGE_HEADER = ("lever", "step", "max micro-batch", "peak GiB", "headroom GiB", "temp GiB", "TFLOP",
               "step ms (pred.)", "tok/s/device", "one step up", "its peak GiB / refusal", "compiles", "note")


def edge_cells(rows: Sequence[Row]) -> list[tuple[str, ...]]:
  """A searched row's figures at its largest micro-batch and one step above it (:data:`EDGE_HEADER`)."""
  out: list[tuple[str, ...]] = []
  for r in rows:
    found = r.searched
    if found is None:
      continue
    at, above = found.at_max or Point(0, False), found.at_above or Point(0, False)
    flops = at.flops_per_device
    refusal = (gib(above.peak_bytes_per_device) if above.peak_bytes_per_device is not None
               else (above.error or "-")[:60])
    note = found.search_unfinished or (f"fits again above: {', '.join(map(str, found.fits_above))} "
                                       "(not monotonic)" if found.fits_above else "")
    out.append((r.lever, r.step, _max_micro_batch(r), gib(at.peak_bytes_per_device),
                gib(at.headroom_bytes_per_device), gib(at.temp_bytes_per_device),
                "-" if flops is None else f"{flops / 1e12:.2f}",
                ms(at.predicted_step_s), tokens(at.tokens_per_s_per_device), str(found.above or "-"),
                refusal, str(len(found.search)), note))
  return out


MEASURED_HEADER = ("lever", "step", "micro-batch", "step ms (pred.)", "step ms (measured)",
                   "pred. vs measured", "peak GiB (compiler)", "peak GiB (allocator)", "note")
_MEASURED_TITLE = ("Run on this machine's devices (--measure): the median of the steady steps, and the "
                   "allocator's peak_bytes_in_use after them (the state and what the runtime kept)")


def measured_cells(rows: Sequence[Row]) -> list[tuple[str, ...]]:
  """Each run of ``--measure`` beside the plan's prediction at its micro-batch (:data:`MEASURED_HEADER`).

  Example::

    >>> from nnx_zero1_plan.row import Figures, Made, Measured
    >>> f = Figures(peak_bytes_per_device=15 * 2**30, predicted_step_s=0.2348)
    >>> row = Row("zero1", "one", "v5e:1x1", "TPU", {"data": 1}, "m", 8, f, Made(depth=2), 1, 1, True,
    ...           measured=(Measured(8, 0.191, 3 * 2**30),))
    >>> measured_cells([row])
    [('zero1', 'one', '8', '234.8', '191.0', '+23%', '15.00', '3.00', '')]
  """
  out: list[tuple[str, ...]] = []
  for r in rows:
    for run in r.measured or ():
      at = (r.searched.at_max if r.searched is not None and r.searched.at_max is not None
            and run.batch != r.batch else r.figures)
      predicted, measured = at.predicted_step_s, run.step_s
      error = "-" if not (predicted and measured) else f"{predicted / measured - 1:+.0%}"
      out.append((r.lever, r.step, str(run.batch), ms(predicted), ms(measured), error,
                  gib(at.peak_bytes_per_device), gib(run.peak_bytes), (run.error or "")[:100]))
  return out


def _aligned(header: Sequence[str], body: Sequence[Sequence[str]], left: Sequence[int]) -> str:
  widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
  line = lambda row: "  ".join(c.ljust(w) if i in left else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths))).rstrip()
  return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, body)])


# The terminal's table: what a user decides by, in a width that fits a terminal; plan.md has every column.
COMPACT = ("lever", "step", "opt GiB", "state dtype", "args GiB", "temp GiB", "peak GiB", "usable GiB",
           "fits", "max micro-batch", "step ms (pred.)", "tok/s/device", "sent GiB per step", *POD_HEADER,
           "compile s", "note")


def _compact(rows: Sequence[Row]) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
  """:data:`COMPACT`'s columns of :func:`cells` (a search's column only with a search, the pod's only on a
  pod), with the collective bytes each device sends per step on every network together."""
  full = header(rows)
  keep = [c for c in COMPACT if c in full or c == "sent GiB per step"]
  if not any(r.searched is not None for r in rows):
    keep.remove("max micro-batch")
  body = []
  for r, row_cells in zip(rows, cells(rows), strict=True):
    by_name = dict(zip(full, row_cells, strict=True))
    by_name["sent GiB per step"] = ("~" if r.estimated else "") + gib(row_sent_bytes(r) or None)
    body.append(tuple(by_name[c] for c in keep))
  short = dict(zip(POD_HEADER, ("inside, MiB (est.)", "across, MiB (est.)"), strict=True))
  return tuple(short.get(c, c) for c in keep), body


def table(rows: Sequence[Row], wide: bool = True) -> str:
  """The rows as an aligned text table (GiB per device): every column (plan.md's), or ``wide=False`` the
  terminal's (:data:`COMPACT`, under a line naming the target and the mesh)."""
  head, body = (header(rows), cells(rows)) if wide else _compact(rows)
  text = _aligned(head, body, (*(range(4) if wide else range(2)), len(head) - 1))
  if not wide and rows:
    mesh = spelled_mesh(rows[0].mesh)
    title = f"compiled for {rows[0].compiled_for}, mesh {mesh}; GiB per device (every column: plan.md)"
    text = title + "\n" + text
  edges = edge_cells(rows)
  if edges:
    text += "\n\nAt each lever's largest micro-batch (the compiler's figures):\n" + _aligned(
        EDGE_HEADER, edges, (0, 1, len(EDGE_HEADER) - 1))
  runs = measured_cells(rows)
  if runs:
    text += f"\n\n{_MEASURED_TITLE}:\n" + _aligned(MEASURED_HEADER, runs, (0, 1, len(MEASURED_HEADER) - 1))
  return text


def limit_words(margin: float | None, hbm_bytes: int, usable_bytes: int) -> str:
  """How the usable memory was set, in words: the user's margin, or the backend's reserve.

  Example::

    >>> limit_words(None, 2**34, 2**34 - 2**28), limit_words(0.05, 2**34, 2**34)
    ("the backend's 0.25 GiB reserve", 'a 5% margin')
  """
  if margin is not None:
    return f"a {margin:.0%} margin"
  reserve = hbm_bytes - usable_bytes
  return f"the backend's {reserve / 2**30:.2f} GiB reserve" if reserve else "the compiler's own check"


def recommendation_lines(rec: Recommendation | None, limit: str, *, search: bool = False,
                         estimate: bool = False) -> list[str]:
  """The recommendation under the table: the configuration, its code, its command, why it beat the levers
  that fit as far, and where the baseline beats a Zero-1 lever, why.

  Args:
    rec: the plan's recommendation (None: nothing fits, or the plan is an estimate).
    limit: how the usable memory was set (:func:`limit_words`).
    search: whether the plan searched for each lever's largest micro-batch.
    estimate: whether the plan is an estimate (which recommends nothing).

  Returns:
    The lines, the first one blank (none where nothing fits and the plan is no estimate).

  Example::

    >>> rec = Recommendation("zero1", "one", 84, None, "mesh = ...\\noptimizer = Zero1Optimizer(...)",
    ...                      "python -m nnx_zero1.plan ...", (), (), ("at micro-batch 84 zero1 leaves ...",),
    ...                      ())
    >>> print("\\n".join(recommendation_lines(rec, "a 5% margin", search=True)))
    <BLANKLINE>
    Recommended: zero1 at micro-batch 84 (one program), the largest that fits with a 5% margin
      code:
        mesh = ...
        optimizer = Zero1Optimizer(...)
      reproduce: python -m nnx_zero1.plan ...
      why: at micro-batch 84 zero1 leaves ...
  """
  if rec is None:
    if estimate:
      return ["", "Nothing is recommended from an estimate: the same command without --estimate compiles the "
              "whole programs and decides."]
    return []
  shape = {"one": "one program", "split": "two programs"}.get(rec.step, rec.step)
  remat = f", remat {rec.remat}" if rec.remat not in (None, "none") else ""
  which = "the largest that fits" if search else "fits"
  if rec.order == BY_THROUGHPUT:
    which = "the most predicted tokens per second of what fits"
  code = [f"    {line}".rstrip() for line in rec.code.splitlines()]
  lines = ["", f"Recommended: {rec.lever} at micro-batch {rec.micro_batch} ({shape}{remat}), {which} "
           f"with {limit}", "  code:", *code, f"  reproduce: {rec.cli}"]
  lines += [f"  why: {line}" for line in rec.why]
  return lines + [f"  note: {line}" for line in (*rec.baseline_beats, *rec.notes)]


_NOTE = (
    "Compiled ahead of time on a machine without the chips; nothing ran. Per device: `opt` is the "
    "optimizer state in device memory, `args` / `temp` the compiled step's argument and temporary bytes "
    "(`memory_analysis()`), `peak` the compiler's own figure for what the program holds at once "
    "(`total_allocation_bytes`; the TPU compiler's temporaries overlap the arguments near the limit), "
    "`args+temp` = args + output - donated + temp, for comparison; `usable` is the memory a program may "
    "use on the chip (TPU: the compiler's available HBM; GPU: jax's memory pool, which the compiler is told "
    "to plan for) less the reserve or margin; `fits`: the compiler accepted the program and peak <= usable. "
    "Step `one` is one program (gradients, then update); `split` is two (gradients, then update): its args "
    "add the optimizer state the gradient program leaves resident, its peak is the larger program's, its "
    "collectives both programs'. The update program's flops and bytes accessed are the compiler's cost "
    "analysis for one device (none on GPU; there a step's flops are its matmuls counted from the compiled "
    "HLO). Collectives are read from the compiled HLO; those in the "
    "micro-batch loop count once per trip (`per micro-batch`)."
)

_POD_NOTE = (
    " On a pod, what one device sends per step inside its slice or node (ICI, NVLink) and over the slow "
    "network between them (DCN, InfiniBand): a TPU program's collectives and its megascale transfers; a GPU "
    "program's node-spanning collectives split by NCCL's hierarchical algorithm (an estimate). The times are "
    "estimates: the bytes at the chip's public per-direction bandwidth, no latency, no overlap."
)


def way_out_lines(way_out: WayOut | None) -> list[str]:
  """When nothing fits, what was compiled to make room: the first change that fits, with its code and its
  command, and the changes before it that did not.

  Example::

    >>> from nnx_zero1_plan.way_out import Tried
    >>> found = Tried("remat block", "python -m nnx_zero1.plan ...", True, 2**33, None,
    ...               "optimizer = Zero1Optimizer(...)")
    >>> out = WayOut((Tried("half the micro-batch", "...", False, None, "RESOURCE_EXHAUSTED"), found), found)
    >>> print("\\n".join(way_out_lines(out)))
    <BLANKLINE>
    Nothing fits as asked; compiled, the first change that fits: remat block (peak 8.00 GiB)
      code:
        optimizer = Zero1Optimizer(...)
      reproduce: python -m nnx_zero1.plan ...
      tried first: half the micro-batch: RESOURCE_EXHAUSTED
  """
  if not way_out:
    return []
  found = way_out.found
  tried = [f"  tried first: {t.what}: {t.error or gib(t.peak_bytes_per_device) + ' GiB'}"[:200]
           for t in way_out.tried if not t.fits]
  if found is None:
    return ["", "Nothing fits as asked, and no change compiled fits either:", *tried]
  code = ["  code:", *(f"    {line}".rstrip() for line in (found.code or "").splitlines())]
  code = code if len(code) > 1 else []
  return ["", f"Nothing fits as asked; compiled, the first change that fits: {found.what} (peak "
          f"{gib(found.peak_bytes_per_device)} GiB)", *code, f"  reproduce: {found.command}", *tried]


def markdown(settings: Mapping[str, Any], rows: Sequence[Row], steps: Sequence[str],
             closing: Sequence[str] = ()) -> str:
  """plan.md: the settings, the table, the lines under it and what to try next.

  Args:
    settings: plan.json's ``meta``, listed key by key.
    rows: the plan's rows.
    steps: what to try next when nothing fits (empty otherwise).
    closing: the lines under the tables (:func:`recommendation_lines`, :func:`way_out_lines`).

  Example::

    >>> markdown({"model": "m"}, [], []).splitlines()[:3]
    ['# Will it fit? nnx-zero1 plan, compiled ahead of time', '', '- model: m']
  """
  lines = ["# Will it fit? nnx-zero1 plan, compiled ahead of time", ""]
  lines += [f"- {k}: {json.dumps(v) if isinstance(v, dict | list) else v}" for k, v in settings.items()]
  if rows:
    lines += markdown_table(header(rows), cells(rows)) + ["", _NOTE + (_POD_NOTE if _is_pod(rows) else "")]
    edges = edge_cells(rows)
    if edges:
      lines += ["", "## At each lever's largest micro-batch", ""] + markdown_table(EDGE_HEADER, edges)
    runs = measured_cells(rows)
    if runs:
      lines += ["", "## Measured", "", _MEASURED_TITLE + "."] + markdown_table(MEASURED_HEADER, runs)
    lines += time_lines(rows) + search_lines(rows)
  lines += closing
  if steps:
    numbered = (f"{i}. {s}" for i, s in enumerate(steps, 1))
    lines += ["", "## Nothing fits: what to try next, in order", "", *numbered]
  return "\n".join(lines) + "\n"
