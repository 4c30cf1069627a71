"""A plan's rows as cells, as the printed table and plan.md both show them: a value's format (bytes, ms,
tokens), a collective's, a network's, the notes, and each table's header and cells."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from nnx_zero1_plan.inputs import spelled_mesh
from nnx_zero1_plan.levers import LEVERS
from nnx_zero1_plan.networks import network_note
from nnx_zero1_plan.row import Figures, Network, OpCount, Point, Row, StateSplit, op_counts

HEADER = ("lever", "step", "compiled for", "mesh", "opt GiB", "state dtype", "args GiB", "temp GiB",
          "peak GiB", "args+temp GiB", "usable GiB", "fits", "max micro-batch", "step ms (pred.)",
          "tok/s/device", "MFU", "compile s", "collectives per step (count x MiB)", "per micro-batch",
          "update GFLOP", "update GiB accessed", "note")
# A plan timed by a calibration (--measure, --calibration) has its time beside the cost model's.
CALIBRATED = "step ms (calib.)"
# A pod's plan has two more columns, before the note: what one device sends per step over each network.
POD_HEADER = ("inside slice/node per step, MiB (est.)", "over the slow network per step, MiB (est.)")
_SHORT = {"all-reduce": "AR", "reduce-scatter": "RS", "all-gather": "AG", "all-to-all": "A2A",
          "collective-permute": "CP", "to-device": "in", "to-host": "out"}
_SHORT_DTYPE = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "float64": "f64"}
EDGE_HEADER = ("lever", "step", "max micro-batch", "peak GiB", "headroom GiB", "temp GiB", "TFLOP",
               "step ms (pred.)", "tok/s/device", "one step up", "its peak GiB / refusal", "compiles", "note")
MEASURED_HEADER = ("lever", "step", "micro-batch", "step ms (pred.)", "step ms (measured)",
                   "pred. vs measured", "peak GiB (compiler)", "held GiB (allocator)", "note")
MEASURED_TITLE = ("Run on this machine's devices (--measure), the very program compiled: the median of the "
                  "steady steps; the program's peak is the compiler's (the chip refuses a program over it), "
                  "and the allocator's bytes_in_use after the steps is what it held: the state and what the "
                  "runtime kept, not the program's temporaries")


def ms(seconds: float | None) -> str:
  """Seconds as every table of the plan prints them: milliseconds (``-``: none)."""
  return "-" if seconds is None else f"{seconds * 1e3:,.1f}"


def gib(n: float | None, none: str = "-") -> str:
  """Bytes as every table and sentence of the plan prints them: GiB (``none`` where there are none)."""
  return none if n is None else f"{n / 2**30:.2f}"


def tokens(per_s: float | None) -> str:
  """Tokens per second as every table of the plan prints them (``-``: none)."""
  return "-" if per_s is None else f"{per_s:,.0f}"


def collective_cell(c: Mapping[str, OpCount] | Mapping[str, Mapping[str, int]] | None) -> str:
  """Collectives or host transfers (also as the benchmarks keep them) as one cell, count x MiB per op."""
  counts = op_counts(c) or {}
  parts = [f"{_SHORT[k]} {v.count}x {v.bytes / 2**20:.3f}" for k, v in counts.items() if v.count]
  return ", ".join(parts) or "-"


def dtype_cell(by_dtype: Mapping[str, int] | None) -> str:
  """The dtypes the optimizer state is stored in, the largest first (``-``: not known, a refused row)."""
  if not by_dtype:
    return "-"
  return "+".join(_SHORT_DTYPE.get(d, d) for d in sorted(by_dtype, key=by_dtype.__getitem__, reverse=True))


def split_words(lever: str, split: StateSplit | None) -> str | None:
  """The share of the state's bytes a Zero-1 lever's layout splits over each set of axes (``split``: its
  row's ``state_split``); None where it splits the whole state over every axis it names, and for the baseline.
  """
  if split is None or lever == "baseline":
    return None
  share, every = split.share, ",".join(split.axes)
  if share.get(every, 0) >= 0.99:
    return None
  words = [f"splits {share.get(every, 0):.0%} of the state over {every}"]
  words += [f"{v:.1%} over {k} only" for k, v in share.items() if k not in (every, "none") and v]
  return ", ".join(words)


def _note(r: Row, rows: Sequence[Row]) -> str:
  split = None if r.ga is None else f"micro-batch {r.batch} x GA {r.ga}"  # --global-batch's split
  notes = (split, split_words(r.lever, r.figures.state_split), _verdict_note(r), accumulation_note(r, rows),
           network_note(r.figures.step_time))
  return "; ".join(n for n in notes if n)


def accumulation_note(r: Row, rows: Sequence[Row]) -> str | None:
  """How much more a ``-accum`` lever holds than its twin (the same layout, gradients from
  ``nnx.value_and_grad``) at the same micro-batch, and why; None where it holds no more (1%), or no twin."""
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
  return (f"needs {gib(mine - theirs)} GiB more than {twin.lever} at this micro-batch: its "
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
  return "-" if r.searched is None else str(r.searched.max_micro_batch or "none")


def _lever(r: Row) -> str:
  """The lever, with the share it offloads (``offload-fraction``) and the state's bytes in host memory."""
  host = r.figures.host_state_bytes
  picked = "" if r.offloaded is None else f" {r.offloaded.offload_fraction:.2f}"
  return r.lever + picked + (f" (+{gib(host)} GiB host)" if host else "")


def network_cell(network: Network | None) -> str:
  """One network's bytes per step (MiB) and the time they take at its public bandwidth, an estimate."""
  if network is None:
    return "-"
  ms = "" if network.estimate_ms is None else f" (~{network.estimate_ms:,.1f} ms)"
  return f"{network.network} {network.bytes / 2**20:,.1f}{ms}"


def is_pod(rows: Sequence[Row]) -> bool:
  return any(r.made.network_per_step is not None for r in rows)


def is_calibrated(rows: Sequence[Row]) -> bool:
  return any(r.figures.calibrated_step_s is not None for r in rows)


def row_cells(rows: Sequence[Row]) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
  """The rows' table: :data:`HEADER` (with :data:`CALIBRATED` after the predicted time's cells where a row has
  a calibrated time, and :data:`POD_HEADER` before the note where the rows are a pod's), and one tuple of
  strings per row."""
  pod, calibrated = is_pod(rows), is_calibrated(rows)
  at = HEADER.index("compile s")
  head = HEADER[:at] + (CALIBRATED,) * calibrated + HEADER[at:]
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
        ex + gib(f.argument_bytes_per_device), ex + gib(f.temp_bytes_per_device),
        ex + gib(f.peak_bytes_per_device), ex + gib(f.formula_peak_bytes_per_device), gib(r.usable_bytes),
        ex + fits, _max_micro_batch(r), "-" if f.predicted_step_s is None else ex + ms(f.predicted_step_s),
        "-" if f.tokens_per_s_per_device is None else ex + tokens(f.tokens_per_s_per_device),
        "-" if f.mfu is None else f"{f.mfu:.0%}",
        *((ms(f.calibrated_step_s),) if calibrated else ()), f"{compile_s:.0f}",
        ex + collective_cell(f.collectives.per_step if f.collectives else None),
        ex + collective_cell(f.collectives.per_micro_batch if f.collectives else None),
        "-" if flops is None else f"{ex}{flops / 1e9:.2f}", ex + gib(f.update_bytes_accessed_per_device),
        *((ex + network_cell(n) for n in nets) if pod else ()),
        _note(r, rows),
    ))
  return (head[:-1] + POD_HEADER + head[-1:] if pod else head), out


def edge_cells(rows: Sequence[Row]) -> list[tuple[str, ...]]:
  """A searched row's figures at its largest micro-batch and one step above it (:data:`EDGE_HEADER`)."""
  out: list[tuple[str, ...]] = []
  for r in rows:
    found = r.searched
    if found is None:
      continue
    at, above = found.at_max or Point(0, False), found.at_above or Point(0, False)
    refusal = (gib(above.peak_bytes_per_device) if above.peak_bytes_per_device is not None
               else (above.error or "-")[:60])
    note = found.search_unfinished or (f"fits again above: {', '.join(map(str, found.fits_above))} "
                                       "(not monotonic)" if found.fits_above else "")
    out.append((r.lever, r.step, _max_micro_batch(r), gib(at.peak_bytes_per_device),
                gib(at.headroom_bytes_per_device), gib(at.temp_bytes_per_device),
                "-" if at.flops_per_device is None else f"{at.flops_per_device / 1e12:.2f}",
                ms(at.predicted_step_s), tokens(at.tokens_per_s_per_device), str(found.above or "-"),
                refusal, str(len(found.search)), note))
  return out


def measured_cells(rows: Sequence[Row]) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
  """Each run of ``--measure`` beside the plan's prediction at its micro-batch (its row's or search's compile
  there): :data:`MEASURED_HEADER` (with the calibrated time and its error where there is one), and the cells.
  """
  calibrated = is_calibrated(rows)
  error = lambda t, m, places: "-" if not (t and m) else f"{t / m - 1:+.{places}%}"  # noqa: E731
  out: list[tuple[str, ...]] = []
  for r in rows:
    for run in r.measured or ():
      points = r.searched.search if r.searched is not None and run.batch != r.batch else ()
      at: Point | Figures = next((p for p in points if p.batch == run.batch), r.figures)
      predicted, measured = at.predicted_step_s, run.step_s
      calib = (ms(at.calibrated_step_s), error(at.calibrated_step_s, measured, 1)) if calibrated else ()
      out.append((r.lever, r.step, str(run.batch), ms(predicted), ms(measured), error(predicted, measured, 0),
                  *calib, gib(at.peak_bytes_per_device), gib(run.held_bytes), (run.error or "")[:100]))
  peak = MEASURED_HEADER.index("peak GiB (compiler)")
  head = MEASURED_HEADER[:peak] + (CALIBRATED, "calib. vs measured") * calibrated + MEASURED_HEADER[peak:]
  return head, out
