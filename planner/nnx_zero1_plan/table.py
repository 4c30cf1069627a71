"""A plan's rows as text: the printed table and plan.md (with what to try next when nothing fits)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from nnx_zero1_plan.inputs import spelled_mesh
from nnx_zero1_plan.recommend import sent_bytes_of

__all__ = ["HEADER", "POD_HEADER", "EDGE_HEADER", "COMPACT", "collective_cell", "network_cell", "header",
           "cells", "edge_cells", "split_words", "way_out_lines", "table", "recommendation_lines", "markdown"]

HEADER = ("lever", "step", "compiled for", "mesh", "opt GiB", "args GiB", "temp GiB", "peak GiB",
          "args+temp GiB", "usable GiB", "fits", "max micro-batch", "compile s",
          "collectives per step (count x MiB)", "per micro-batch", "update GFLOP", "update GiB accessed",
          "note")
_LEFT = (0, 1, 2, 3)  # the columns of words, aligned left, and the note (the last)
# A pod's plan has two more columns, before the note: what one device sends per step over each network.
POD_HEADER = ("inside slice/node per step, MiB (est.)", "over the slow network per step, MiB (est.)")

_SHORT = {"all-reduce": "AR", "reduce-scatter": "RS", "all-gather": "AG", "to-device": "in", "to-host": "out"}


def collective_cell(c: dict[str, dict[str, int]]) -> str:
  """Collectives (or host transfers) as one table cell, count x MiB per op.

  Example::

    >>> collective_cell({"all-reduce": {"count": 2, "bytes": 2**20}, "all-gather": {"count": 0, "bytes": 0}})
    'AR 2x 1.000'
  """
  parts = [f"{_SHORT[k]} {v['count']}x {v['bytes'] / 2**20:.3f}" for k, v in c.items() if v["count"]]
  return ", ".join(parts) or "-"


def _gib(n: float | None) -> str:
  return "-" if n is None else f"{n / 2**30:.2f}"


def split_words(r: Mapping[str, Any]) -> str | None:
  """What a Zero-1 row's layout splits, where it is not the whole state over every axis the lever names
  (None where it is, and for the baseline): the share of the state's bytes over each set of axes.

  Example::

    >>> r = {"lever": "zero1-pod", "state_split": {"axes": ["replica", "data"],
    ...      "share": {"data": 0.998, "none": 0.002}}}
    >>> split_words(r)
    'splits 0% of the state over replica,data, 99.8% over data only'
    >>> split_words({"lever": "zero1", "state_split": {"axes": ["data"], "share": {"data": 0.999,
    ...              "none": 0.001}}}) is None
    True
  """
  split = r.get("state_split")
  if not split or r["lever"] == "baseline":
    return None
  share, every = split["share"], ",".join(split["axes"])
  if share.get(every, 0) >= 0.99:
    return None
  words = [f"splits {share.get(every, 0):.0%} of the state over {every}"]
  words += [f"{v:.1%} over {k} only" for k, v in share.items() if k not in (every, "none") and v]
  return ", ".join(words)


def _note(r: Mapping[str, Any]) -> str:
  notes = [n for n in (split_words(r), _verdict_note(r)) if n]
  return "; ".join(notes)


def _verdict_note(r: Mapping[str, Any]) -> str:
  if r.get("error"):
    return f"refused: {r['error']}"
  if r.get("search_unfinished"):
    return f"edge not confirmed: {r['search_unfinished']}"
  if r.get("offload_refused_because"):
    return f"no fraction fits: {r['offload_refused_because']}"
  if r.get("compiled_whole_because"):
    extrapolated = _gib(r.get("extrapolated_peak_bytes_per_device"))
    return f"compiled whole (estimate: {extrapolated} GiB; {r['compiled_whole_because']})"
  if r.get("estimate"):
    up_to = r["estimate"]["whole_peak_over_estimate_up_to"]
    return (f"~ ESTIMATE, {r['estimate']['method']}: decides nothing (whole programs have peaked up to "
            f"{up_to}x the estimate)")
  return ""


def _max_micro_batch(r: Mapping[str, Any]) -> str:
  if "max_micro_batch" not in r:
    return "-"
  return "none" if r["max_micro_batch"] is None else str(r["max_micro_batch"])


def _lever(r: Mapping[str, Any]) -> str:
  """The lever, with the share it offloads (``offload-fraction``) and the state's bytes in host memory."""
  host = (r.get("opt_state_bytes_by_memory_kind") or {}).get("pinned_host")
  picked = f" {r['offload_fraction']:.2f}" if "offload_fraction" in r else ""
  return r["lever"] + picked + (f" (+{_gib(host)} GiB host)" if host else "")


def network_cell(network: Mapping[str, Any] | None) -> str:
  """One network's bytes per step (MiB) and the time they take at its public bandwidth, an estimate.

  Example::

    >>> network_cell({"network": "DCN", "bytes": 1102404096, "estimate_ms": 176.4})
    'DCN 1,051.3 (~176.4 ms)'
  """
  if not network:
    return "-"
  ms = "" if network["estimate_ms"] is None else f" (~{network['estimate_ms']:,.1f} ms)"
  return f"{network['network']} {network['bytes'] / 2**20:,.1f}{ms}"


def _is_pod(rows: Sequence[Mapping[str, Any]]) -> bool:
  return any("network_per_step" in r for r in rows)


def header(rows: Sequence[Mapping[str, Any]]) -> tuple[str, ...]:
  """:data:`HEADER`, with :data:`POD_HEADER` before the note where the rows are a pod's."""
  return HEADER[:-1] + POD_HEADER + HEADER[-1:] if _is_pod(rows) else HEADER


def cells(rows: Sequence[Mapping[str, Any]]) -> list[tuple[str, ...]]:
  """One tuple of strings per row, in :func:`header`'s order."""
  pod = _is_pod(rows)
  out: list[tuple[str, ...]] = []
  for r in rows:
    verdict = r.get("fits_estimate") if r.get("estimate") else r["fits"]
    fits = "-" if verdict is None else "yes" if verdict else "NO"
    collectives = r.get("collectives") or {}
    flops, accessed = r.get("update_flops_per_device"), r.get("update_bytes_accessed_per_device")
    mesh = spelled_mesh(r["mesh"])
    ex = "~" if r.get("estimate") else ""  # an estimate's figures, each marked
    out.append((
        _lever(r), r.get("step", "one") + (f", remat {r['remat']}" if r.get("remat") else ""),
        r["compiled_for"], mesh,
        _gib(r["opt_state_bytes_per_device"]), ex + _gib(r["argument_bytes_per_device"]),
        ex + _gib(r["temp_bytes_per_device"]), ex + _gib(r["peak_bytes_per_device"]),
        ex + _gib(r.get("formula_peak_bytes_per_device")), _gib(r.get("usable_bytes", r["hbm_bytes"])),
        ex + fits, _max_micro_batch(r), f"{r.get('search_compile_s', r['compile_s']):.0f}",
        ex + collective_cell(collectives.get("per_step", {})),
        ex + collective_cell(collectives.get("per_micro_batch", {})),
        "-" if flops is None else f"{ex}{flops / 1e9:.2f}", ex + _gib(accessed),
        *((ex + network_cell(r.get("network_per_step", {}).get("fast")),
           ex + network_cell(r.get("network_per_step", {}).get("slow"))) if pod else ()),
        _note(r),
    ))
  return out


EDGE_HEADER = ("lever", "step", "max micro-batch", "peak GiB", "headroom GiB", "temp GiB", "TFLOP",
               "one step up", "its peak GiB / refusal", "compiles", "note")


def edge_cells(rows: Sequence[Mapping[str, Any]]) -> list[tuple[str, ...]]:
  """A searched row's figures at its largest micro-batch and one step above it (:data:`EDGE_HEADER`).

  Example::

    >>> row = {"lever": "zero1", "max_micro_batch": 52, "above": 56, "search": [1, 2],
    ...        "at_max": {"peak_bytes_per_device": 2**34, "headroom_bytes_per_device": 2**29,
    ...                   "temp_bytes_per_device": 2**33, "flops_per_device": 2.2e13},
    ...        "at_above": {"peak_bytes_per_device": None, "error": "refused"}}
    >>> edge_cells([row])[0][:9]
    ('zero1', 'one', '52', '16.00', '0.50', '8.00', '22.00', '56', 'refused')
  """
  out: list[tuple[str, ...]] = []
  for r in rows:
    if "max_micro_batch" not in r:
      continue
    at, above = r.get("at_max") or {}, r.get("at_above") or {}
    flops = at.get("flops_per_device")
    above_peak = above.get("peak_bytes_per_device")
    refusal = _gib(above_peak) if above_peak is not None else (above.get("error") or "-")[:60]
    note = r.get("search_unfinished") or (f"fits again above: {', '.join(map(str, r['fits_above']))} "
                                          "(not monotonic)" if r.get("fits_above") else "")
    out.append((r["lever"], r.get("step", "one"), _max_micro_batch(r), _gib(at.get("peak_bytes_per_device")),
                _gib(at.get("headroom_bytes_per_device")), _gib(at.get("temp_bytes_per_device")),
                "-" if flops is None else f"{flops / 1e12:.2f}", str(r.get("above") or "-"), refusal,
                str(len(r.get("search", ()))), note))
  return out


def _aligned(header: Sequence[str], body: Sequence[Sequence[str]], left: Sequence[int]) -> str:
  widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
  line = lambda row: "  ".join(c.ljust(w) if i in left else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths))).rstrip()
  return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, body)])


# The terminal's table: what a user decides by, in a width that fits a terminal; plan.md has every column.
COMPACT = ("lever", "step", "opt GiB", "args GiB", "temp GiB", "peak GiB", "usable GiB", "fits",
           "max micro-batch", "sent GiB per step", *POD_HEADER, "compile s", "note")


def _compact(rows: Sequence[Mapping[str, Any]]) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
  """:data:`COMPACT`'s columns of :func:`cells` (a search's column only with a search, the pod's only on a
  pod), with the collective bytes each device sends per step on every network together."""
  full = header(rows)
  keep = [c for c in COMPACT if c in full or c == "sent GiB per step"]
  if not any("max_micro_batch" in r for r in rows):
    keep.remove("max micro-batch")
  body = []
  for r, row_cells in zip(rows, cells(rows), strict=True):
    by_name = dict(zip(full, row_cells, strict=True))
    sent = sent_bytes_of(r)
    marked = "~" if r.get("estimate") else ""
    by_name["sent GiB per step"] = marked + (f"{sent / 2**30:.2f}" if sent else "-")
    body.append(tuple(by_name[c] for c in keep))
  short = dict(zip(POD_HEADER, ("inside, MiB (est.)", "across, MiB (est.)"), strict=True))
  return tuple(short.get(c, c) for c in keep), body


def table(rows: Sequence[Mapping[str, Any]], wide: bool = True) -> str:
  """The rows as an aligned text table (GiB per device): every column (plan.md's), or ``wide=False`` the
  terminal's (:data:`COMPACT`, under a line naming the target and the mesh).

  Example::

    >>> row = {"lever": "zero1", "compiled_for": "v6e:2x2", "mesh": {"data": 4}, "hbm_bytes": 2**35,
    ...        "opt_state_bytes_per_device": 2**30, "argument_bytes_per_device": 2**31, "fits": True,
    ...        "temp_bytes_per_device": 0, "peak_bytes_per_device": 2**31, "compile_s": 1.0}
    >>> table([row]).splitlines()[2].split()[:7]
    ['zero1', 'one', 'v6e:2x2', 'data=4', '1.00', '2.00', '0.00']
    >>> table([row], wide=False).splitlines()[0]
    'compiled for v6e:2x2, mesh data=4; GiB per device (every column: plan.md)'
  """
  if wide:
    head, body = header(rows), cells(rows)
  else:
    head, body = _compact(rows)
  text = _aligned(head, body, (*(range(4) if wide else range(2)), len(head) - 1))
  if not wide and rows:
    mesh = spelled_mesh(rows[0]["mesh"])
    title = f"compiled for {rows[0]['compiled_for']}, mesh {mesh}; GiB per device (every column: plan.md)"
    text = title + "\n" + text
  edges = edge_cells(rows)
  if edges:
    text += "\n\nAt each lever's largest micro-batch (the compiler's figures):\n" + _aligned(
        EDGE_HEADER, edges, (0, 1, 10))
  return text


def _limit_words(meta: Mapping[str, Any]) -> str:
  """How the usable memory was set: the user's margin, or the backend's reserve."""
  if meta.get("margin") is not None:
    return f"a {meta['margin']:.0%} margin"
  reserve = (meta.get("hbm_bytes") or 0) - (meta.get("usable_bytes") or meta.get("hbm_bytes") or 0)
  return f"the backend's {reserve / 2**30:.2f} GiB reserve" if reserve else "the compiler's own check"


def recommendation_lines(rec: Mapping[str, Any] | None, meta: Mapping[str, Any]) -> list[str]:
  """The recommendation under the table: the configuration, its code, its command, why it beat the levers
  that fit as far, and where the baseline beats a Zero-1 lever, why.

  Example::

    >>> rec = {"lever": "zero1", "step": "one", "micro_batch": 84, "remat": None,
    ...        "code": "mesh = ...\\noptimizer = Zero1Optimizer(...)", "cli": "python -m nnx_zero1.plan ...",
    ...        "baseline_beats": [], "why": ["at micro-batch 84 zero1 leaves ..."]}
    >>> print("\\n".join(recommendation_lines(rec, {"margin": 0.05, "search": True})))
    <BLANKLINE>
    Recommended: zero1 at micro-batch 84 (one program), the largest that fits with a 5% margin
      code:
        mesh = ...
        optimizer = Zero1Optimizer(...)
      reproduce: python -m nnx_zero1.plan ...
      why: at micro-batch 84 zero1 leaves ...
  """
  if rec is None:
    if meta.get("estimate"):
      return ["", "Nothing is recommended from an estimate: the same command without --estimate compiles the "
              "whole programs and decides."]
    return []
  shape = {"one": "one program", "split": "two programs"}.get(rec["step"], rec["step"])
  remat = f", remat {rec['remat']}" if rec["remat"] not in (None, "none") else ""
  which = "the largest that fits" if meta.get("search") else "fits"
  code = [f"    {line}".rstrip() for line in rec["code"].splitlines()]
  lines = ["", f"Recommended: {rec['lever']} at micro-batch {rec['micro_batch']} ({shape}{remat}), {which} "
           f"with {_limit_words(meta)}", "  code:", *code, f"  reproduce: {rec['cli']}"]
  lines += [f"  why: {line}" for line in rec.get("why", ())]
  return lines + [f"  note: {line}" for line in (*rec["baseline_beats"], *rec.get("notes", ()))]


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


def way_out_lines(way_out: Mapping[str, Any] | None) -> list[str]:
  """When nothing fits, what was compiled to make room: the first change that fits, with its code and its
  command, and the changes before it that did not.

  Example::

    >>> out = {"found": {"what": "remat block", "command": "python -m nnx_zero1.plan ...",
    ...                  "peak_bytes_per_device": 2**33, "code": "optimizer = Zero1Optimizer(...)"},
    ...        "tried": [{"what": "half the micro-batch", "fits": False, "peak_bytes_per_device": None,
    ...                   "error": "RESOURCE_EXHAUSTED"}, {"what": "remat block", "fits": True}]}
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
  found = way_out["found"]
  before = [t for t in way_out["tried"] if not t["fits"]]
  tried = [f"  tried first: {t['what']}: {t['error'] or _gib(t['peak_bytes_per_device']) + ' GiB'}"[:200]
           for t in before]
  if found is None:
    return ["", "Nothing fits as asked, and no change compiled fits either:", *tried]
  code = ["  code:", *(f"    {line}".rstrip() for line in found.get("code", "").splitlines())]
  code = code if len(code) > 1 else []
  return ["", f"Nothing fits as asked; compiled, the first change that fits: {found['what']} (peak "
          f"{_gib(found['peak_bytes_per_device'])} GiB)", *code, f"  reproduce: {found['command']}", *tried]


def _markdown_table(header: Sequence[str], body: Sequence[Sequence[str]]) -> list[str]:
  return ["", "| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|",
          *("| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in body)]


def markdown(meta: dict[str, Any], rows: Sequence[Mapping[str, Any]], steps: Sequence[str],
             recommendation: Mapping[str, Any] | None = None,
             way_out: Mapping[str, Any] | None = None) -> str:
  """plan.md: the settings, the table and what to try next.

  Example::

    >>> markdown({"model": "m"}, [], []).splitlines()[0]
    '# Will it fit? nnx-zero1 plan, compiled ahead of time'
  """
  lines = ["# Will it fit? nnx-zero1 plan, compiled ahead of time", ""]
  lines += [f"- {k}: {json.dumps(v) if isinstance(v, dict | list) else v}" for k, v in meta.items()]
  if rows:
    lines += _markdown_table(header(rows), cells(rows)) + ["", _NOTE + (_POD_NOTE if _is_pod(rows) else "")]
    edges = edge_cells(rows)
    if edges:
      lines += ["", "## At each lever's largest micro-batch", ""] + _markdown_table(EDGE_HEADER, edges)
  lines += recommendation_lines(recommendation, meta) + way_out_lines(way_out)
  if steps:
    numbered = (f"{i}. {s}" for i, s in enumerate(steps, 1))
    lines += ["", "## Nothing fits: what to try next, in order", "", *numbered]
  return "\n".join(lines) + "\n"
