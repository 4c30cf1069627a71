"""The ahead-of-time rows as a table, bench.md and memory.png, kept apart from measured CPU rows.

Rows that carry ``"compiled_for"`` are the TPU compiler's plan for a chip
nobody ran; everything here says so in its titles.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from benchmarks.output import collective_cell as _collective_cell
from benchmarks.output import save_figure, write_files

__all__ = ["HEADER", "cells", "table", "markdown", "plot", "write_all", "saving"]

HEADER = ("compiled for", "arm", "dp", "ga", "opt GiB", "args GiB", "temp GiB", "peak GiB", "saved GiB",
          "HBM GiB", "fits", "host GiB", "compile s", "collectives per step (count x MiB)",
          "in the loop, per trip", "host transfers per step (count x MiB)")


def _gib(n: float | None) -> str:
  return "-" if n is None else f"{n / 2**30:.2f}"


def saving(rows: Sequence[dict], row: dict) -> int | None:
  """Peak bytes per device this row saves against the baseline compiled alongside it (None: no baseline).

  Example::

    >>> base = {"arm": "baseline", "dp": 4, "ga": 8, "compiled_for": "v6e:2x2", "peak_bytes_per_device": 10}
    >>> saving([base], {**base, "arm": "zero1", "peak_bytes_per_device": 7})
    3
  """
  key = lambda r: (r["compiled_for"], r["model"] if "model" in r else None, r["dp"], r["ga"])
  base = next((r for r in rows if r["arm"] == "baseline" and key(r) == key(row)), None)
  if base is None or base["peak_bytes_per_device"] is None or row["peak_bytes_per_device"] is None:
    return None
  return base["peak_bytes_per_device"] - row["peak_bytes_per_device"]


def cells(rows: Sequence[dict]) -> list[tuple[str, ...]]:
  """One tuple of strings per row, in :data:`HEADER`'s order."""
  out: list[tuple[str, ...]] = []
  for r in rows:
    fits = "-" if r.get("fits") is None else "yes" if r["fits"] else "NO"
    oom = r.get("hbm_oom")
    if oom:  # the compiler refused: its figure for what it needed
      fits = f"NO (needs {_gib(oom['required_bytes'])} GiB {oom['required_for']})"
    out.append((
        r["compiled_for"], r["arm"], str(r["dp"]), str(r["ga"]), _gib(r["opt_state_bytes_per_device"]),
        _gib(r["argument_bytes_per_device"]), _gib(r["temp_bytes_per_device"]),
        _gib(r["peak_bytes_per_device"]), _gib(saving(rows, r)), _gib(r.get("hbm_bytes")), fits,
        _gib(r.get("host_argument_bytes_per_device")), f"{r['compile_s']:.0f}",
        _collective_cell(r["collectives"] or {}), _collective_cell(r["loop_collectives"] or {}),
        _collective_cell(r.get("host_transfers") or {}),
    ))
  return out


def table(rows: Sequence[dict]) -> str:
  """The rows as an aligned text table (GiB per device).

  Example::

    >>> row = {"compiled_for": "v6e:2x2", "arm": "baseline", "dp": 4, "ga": 8, "model": "m",
    ...        "opt_state_bytes_per_device": 2**30, "argument_bytes_per_device": 2**31,
    ...        "temp_bytes_per_device": 0, "peak_bytes_per_device": 2**31, "hbm_bytes": 2**35, "fits": True,
    ...        "compile_s": 1.0, "collectives": {}, "loop_collectives": {}}
    >>> table([row]).splitlines()[2].split()[:6]
    ['v6e:2x2', 'baseline', '4', '8', '1.00', '2.00']
  """
  body = cells(rows)
  widths = [max(len(row[i]) for row in [HEADER, *body]) for i in range(len(HEADER))]
  line = lambda row: "  ".join(c.ljust(w) if i in (0, 1) else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths)))
  return "\n".join([line(HEADER), line(["-" * w for w in widths]), *map(line, body)])


_NOTE = (
    "Compiled ahead of time by the TPU compiler (libtpu) on a machine without a TPU; nothing ran. "
    "Per device: `opt` is the optimizer state, `args` / `temp` the compiled step's argument and "
    "temporary bytes (`memory_analysis()`), `peak` the compiler's own figure for what the chip holds at "
    "once (`total_allocation_bytes`; args + output - donated + temp where it reports none); `saved` is "
    "the baseline's peak minus this arm's; `fits`: peak <= the chip's HBM. "
    "`host` is the optimizer state the step reads from host memory (`zero1-offload`), and host "
    "transfers are the TPU HLO's copies between host and device memory (`in`: to the device). "
    "Collectives are read from the TPU HLO; those in the micro-batch loop count once per trip. With "
    "`--split-step` (the default) each step is two programs (gradients, then update): `args` is the "
    "gradient program's plus the optimizer state resident meanwhile, `peak` the larger program's."
)


def markdown(result: dict[str, Any]) -> str:
  """bench.md for an ahead-of-time run: the settings and the compiled rows, titled as such.

  Example::

    >>> markdown({"meta": {"model": "tiny"}, "rows": []}).splitlines()[0]
    '# nnx-zero1 bench, compiled ahead of time (no timing)'
  """
  lines = ["# nnx-zero1 bench, compiled ahead of time (no timing)", ""]
  lines += [f"- {k}: {json.dumps(v) if isinstance(v, dict | list) else v}" for k, v in result["meta"].items()]
  if result["rows"]:
    body = cells(result["rows"])
    lines += ["", "## Per-device memory and collectives, TPU compiler", "",
              "| " + " | ".join(HEADER) + " |", "|" + "|".join("---" for _ in HEADER) + "|",
              *("| " + " | ".join(row) + " |" for row in body), "", _NOTE]
  return "\n".join(lines) + "\n"


def plot(rows: Sequence[dict], path: str) -> None:
  """memory.png: per arm, the compiled step's argument and temp bytes per device, stacked, with HBM.

  Example::

    >>> plot([], "/tmp/memory_aot.png")  # doctest: +SKIP
  """
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  refused = [r for r in rows if r["peak_bytes_per_device"] is None]
  rows = [r for r in rows if r["peak_bytes_per_device"] is not None]  # the compiler's refusals have no plan
  fig, ax = plt.subplots(figsize=(6, 4))
  labels = [f"{r['arm']}\ndp={r['dp']} ga={r['ga']}" for r in rows]
  args = [r["argument_bytes_per_device"] / 2**30 for r in rows]
  rest = [(r["peak_bytes_per_device"] - r["argument_bytes_per_device"]) / 2**30 for r in rows]
  ax.bar(labels, args, label="arguments (params, optimizer state, batch)")
  ax.bar(labels, rest, bottom=args, label="temp + undonated output")
  hbm = {r["hbm_bytes"] for r in rows if r.get("hbm_bytes")}
  for h in hbm:
    ax.axhline(h / 2**30, color="k", linestyle="--", label=f"HBM {h / 2**30:.0f} GiB")
  topologies = sorted({r["compiled_for"] for r in rows + refused})
  ax.set_ylabel("GiB per device (compiled, not run)")
  refusals = f"; {len(refused)} arm(s) do not fit" if refused else ""
  ax.set_title(f"Compiled for {', '.join(topologies)} (TPU compiler, no timing){refusals}", fontsize=9)
  save_figure(fig, ax, path, legend_size=7)


def write_all(result: dict[str, Any], out_dir: str) -> list[str]:
  """Writes bench.json, bench.md and memory.png for an ahead-of-time run; returns their paths.

  Example::

    >>> write_all({"meta": {}, "rows": []}, "/tmp/bench-aot-doc")  # doctest: +SKIP
  """
  return write_files(result, out_dir, markdown, plot)
