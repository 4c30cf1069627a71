"""The bench's results as an aligned table, bench.json, bench.md and memory.png."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from benchmarks.legend import legend, loss_diff_cell
from benchmarks.verdict import INCONCLUSIVE, estimate_ratio, judge, judge_all, overall
from nnx_zero1_plan import collective_cell

__all__ = [
    "collective_cell", "table", "legend", "shapes_table", "targets", "goals_text", "markdown", "write_all",
    "plot_series", "plot_memory", "save_figure", "write_files",
]

# The goals the bench reports. The timed one is judged from paired per-step ratios and only on a
# machine that was ours meanwhile (BUSY_SHARE), so noise reads "inconclusive", never "missed";
# the tests do not assert it.
OPT_BYTES_SLACK = 1.02
STEP_RATIO_GOAL = 1.05
STEP_RATIO_GA = 8
# Above this share of the machine's CPU time used by other processes while the arms were timed,
# step times are not judged: one arm's steps may have met the load and another's not.
BUSY_SHARE = 0.10


def _mib(n: float) -> str:
  return f"{n / 2**20:.3f}"


def _baseline(rows: Sequence[dict], row: dict) -> dict:
  return next(r for r in rows if r["arm"] == "baseline" and r["dp"] == row["dp"] and r["ga"] == row["ga"])


_HEADER = ("arm", "dp", "ga", "opt MiB/dev", "x ideal", "peak MiB/dev", "step ms", "x plain", "min ms",
           "compile s", "collectives per step (count x MiB)", "loss diff")


def _cells(rows: Sequence[dict]) -> list[tuple[str, ...]]:
  out: list[tuple[str, ...]] = []
  for r in rows:
    base = _baseline(rows, r)
    ideal = base["opt_state_bytes_per_device"] / r["dp"]
    out.append((
        r["arm"], str(r["dp"]), str(r["ga"]), _mib(r["opt_state_bytes_per_device"]),
        f"{r['opt_state_bytes_per_device'] / ideal:.3f}", _mib(r["peak_bytes_per_device"]),
        f"{r['step_ms']:.1f}", f"{r['step_ms'] / base['step_ms']:.3f}", f"{r.get('step_ms_min', 0):.1f}",
        f"{r['compile_s']:.1f}",
        collective_cell(r["collectives"]), loss_diff_cell(r),
    ))
  return out


def _aligned(header: Sequence[str], body: Sequence[Sequence[str]]) -> str:
  widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
  line = lambda row: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
  return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, body)])


def table(rows: Sequence[dict]) -> str:
  """The main results as an aligned text table; ``x ideal`` is opt bytes / (plain / dp).

  Example::

    >>> row = {"arm": "baseline", "dp": 2, "ga": 1, "opt_state_bytes_per_device": 2**20,
    ...        "peak_bytes_per_device": 2**21, "step_ms": 10.0, "compile_s": 1.0, "loss_diff": 0.0,
    ...        "collectives": {"all-reduce": {"count": 1, "bytes": 2**20}}}
    >>> table([row]).splitlines()[2].split()[:5]
    ['baseline', '2', '1', '1.000', '2.000']
  """
  return _aligned(_HEADER, _cells(rows))


def _markdown_table(header: Sequence[str], body: Sequence[Sequence[str]]) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
  return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in body])


_SHAPES_HEADER = ("model", "dp", "optimizer state", "replicated", "replicated %", "per device x ideal",
                  "unsplit leaves")


def _shape_cells(rows: Sequence[dict]) -> list[tuple[str, ...]]:
  return [
      (r["model"], str(r["dp"]), f"{r['total_bytes'] / 2**30:.2f} GiB", f"{r['replicated_bytes']:,} B",
       f"{100 * r['replicated_fraction']:.2e}", f"{r['per_device_vs_ideal']:.6f}",
       str(r["replicated_leaves"]))
      for r in rows
  ]


def shapes_table(rows: Sequence[dict]) -> str:
  """The replicated-fraction table for real LLM shapes (adamw, float32 moments).

  Example::

    >>> row = {"model": "m", "dp": 2, "total_bytes": 2**30, "replicated_bytes": 4,
    ...        "replicated_fraction": 4 / 2**30, "per_device_vs_ideal": 1.0, "replicated_leaves": 0}
    >>> "m" in shapes_table([row])
    True
  """
  return _aligned(_SHAPES_HEADER, _shape_cells(rows))


def targets(rows: Sequence[dict]) -> list[str]:
  """The issue's goals, each with the measured figure and whether it was met.

  Example::

    >>> targets([])[0].startswith("Zero-1 optimizer bytes")
    True
  """
  zero1 = [r for r in rows if r["arm"] == "zero1"]
  opt = [r["opt_state_bytes_per_device"] / (_baseline(rows, r)["opt_state_bytes_per_device"] / r["dp"])
         for r in zero1]
  diff = [r["loss_diff"] for r in zero1]
  return [
      f"Zero-1 optimizer bytes/device <= {OPT_BYTES_SLACK} x plain/dp: "
      + _verdict(opt, bool(opt) and max(opt) <= OPT_BYTES_SLACK),
      _step_goal(rows, "zero1", "Zero-1/plain"),
      "final-loss difference == 0: " + _verdict(diff, bool(diff) and max(diff) == 0, "g"),
  ] + _accum_lines(rows) + _engine_line(rows) + _lever_lines(rows)


def goals_text(rows: Sequence[dict]) -> list[str]:
  """The goals as printed: a heading, each goal, what "inconclusive" means where one is, the verdict.

  Example::

    >>> goals_text([])[-1]
    'verdict: 3 of 3 goals not met: Zero-1 optimizer bytes/device <= 1.02 x plain/dp (not measured); \
step time Zero-1/plain <= 1.05 at GA=8 (not measured); final-loss difference == 0 (not measured)'
  """
  goals = targets(rows)
  lines = ["goals (measured -> met, missed or inconclusive; '(no goal)' lines are figures):", *goals]
  if any("inconclusive (noise" in g for g in goals):
    lines.append(INCONCLUSIVE)
  return lines + [overall(goals)]


ALL_REDUCE_SCALARS = 1024  # bytes: what "only scalars" allows per step


def _verdict(values: list, good: bool, fmt: str = ".3f") -> str:
  if not values:
    return "not measured"
  return ", ".join(f"{v:{fmt}}" for v in values) + (" -> met" if good else " -> missed")


def _step_goal(rows: Sequence[dict], arm: str, label: str) -> str:
  """The step-time goal for ``arm`` against ``baseline`` at GA=8, judged per dp from paired steps."""
  at_ga = [r for r in rows if r["arm"] == arm and r["ga"] == STEP_RATIO_GA and "step_times_ms" in r]
  estimates = [
      (r["dp"], estimate_ratio(r["step_times_ms"], _baseline(rows, r)["step_times_ms"])) for r in at_ga
  ]
  measured = ", ".join(f"dp={dp} {e}" for dp, e in estimates) or "not measured"
  verdict = judge_all([judge(e, STEP_RATIO_GOAL) for _, e in estimates])
  busy = max((r["other_cpu_share"] for r in at_ga if r.get("other_cpu_share") is not None), default=0.0)
  if estimates and busy > BUSY_SHARE:
    verdict = (f"inconclusive (machine busy: other processes used {busy:.0%} of its CPU time while the "
               "arms were timed)")
  return (f"step time {label} <= {STEP_RATIO_GOAL} at GA={STEP_RATIO_GA} (median per-step ratio "
          f"[95% bootstrap interval]): {measured} -> {verdict}")


def _accum_lines(rows: Sequence[dict]) -> list[str]:
  """The goals of ``zero1-accum`` (custom loop, ``value_and_grad_accumulated``, ``Zero1Optimizer``)."""
  accum = [r for r in rows if r["arm"] == "zero1-accum" and "param_bytes" in r]
  if not accum:
    return []
  at_ga = [r for r in accum if r["ga"] == STEP_RATIO_GA]
  c = lambda r, op: r["collectives"][op]["bytes"]
  scattered = [c(r, "reduce-scatter") * r["dp"] / r["param_bytes"] for r in at_ga]
  gathered = [c(r, "all-gather") / r["param_bytes"] for r in at_ga]
  reduced = [c(r, "all-reduce") for r in at_ga]
  opt = [r["opt_state_bytes_per_device"] / (_baseline(rows, r)["opt_state_bytes_per_device"] / r["dp"])
         for r in accum]
  lines = [
      f"zero1-accum at GA={STEP_RATIO_GA}, reduce-scatter bytes (results x dp) / gradient bytes == 1: "
      + _verdict(scattered, bool(scattered) and all(v == 1 for v in scattered)),
      f"zero1-accum at GA={STEP_RATIO_GA}, all-gather bytes / parameter bytes == 1: "
      + _verdict(gathered, bool(gathered) and all(v == 1 for v in gathered)),
      f"zero1-accum at GA={STEP_RATIO_GA}, all-reduce bytes < {ALL_REDUCE_SCALARS} (scalars only): "
      + _verdict(reduced, bool(reduced) and max(reduced) < ALL_REDUCE_SCALARS, "d"),
      f"zero1-accum optimizer bytes/device <= {OPT_BYTES_SLACK} x plain/dp: "
      + _verdict(opt, max(opt) <= OPT_BYTES_SLACK),
      _step_goal(rows, "zero1-accum", "zero1-accum/baseline"),
  ]
  # Zero-1 changes no arithmetic on top of the same deferral: bit-identical to accum (and to the
  # engine, which defers the same way). Against baseline (another summation order) only a number.
  for other in ("accum", "zero1-engine"):
    same = [other in r["params_equal_arms"] for r in accum if _has_arm(rows, other, r)]
    if same:
      lines.append(f"zero1-accum parameters bit-identical to {other}: "
                   + ", ".join(map(str, same)) + (" -> met" if all(same) else " -> missed"))
  diff = ", ".join(f"{r['params_max_diff']:.3g}" for r in accum)
  lines.append(f"(no goal) zero1-accum max |parameter - {rows[0]['arm']}'s| after the last step "
               f"(a different summation order): {diff}")
  plain = [r for r in rows if r["arm"] == "accum" and r["ga"] == STEP_RATIO_GA]
  if plain:
    ratios = ", ".join(f"{r['step_ms'] / _baseline(rows, r)['step_ms']:.3f}" for r in plain)
    lines.append(f"(no goal) step time accum/baseline (nnx.Optimizer, deferral alone) at GA={STEP_RATIO_GA}: "
                 + ratios)
  return lines


def _lever_lines(rows: Sequence[dict]) -> list[str]:
  """The memory levers against ``zero1-accum`` at the same (dp, ga): what each saves and costs."""
  lines = []
  pairs = lambda arm: [(r, e) for r in rows if r["arm"] == arm for e in rows
                       if e["arm"] == "zero1-accum" and (e["dp"], e["ga"]) == (r["dp"], r["ga"])]
  zero2 = pairs("zero2-accum")
  if zero2:
    ratio = [r["grad_accumulator_bytes_per_device"] * r["dp"] / e["grad_accumulator_bytes_per_device"]
             for r, e in zero2]
    lines.append("zero2-accum gradient accumulator bytes/device x dp / zero1-accum's == 1: "
                 + _verdict(ratio, all(abs(v - 1) <= 0.01 for v in ratio)))
  offload = pairs("zero1-offload")
  if offload:
    on_device = [r["opt_state_bytes_by_memory_kind"].get("device", 0) for r, _ in offload]
    lines.append("zero1-offload optimizer-state bytes/device in device memory between steps (<= 8: the "
                 "step counter): " + _verdict(on_device, max(on_device) <= 8, "d"))
    same = ["zero1-accum" in r["params_equal_arms"] for r, _ in offload]
    lines.append("zero1-offload parameters bit-identical to zero1-accum: "
                 + ", ".join(map(str, same)) + (" -> met" if all(same) else " -> missed"))
  fractions = []
  for arm, fraction in (("zero1-offload-0.25", 0.25), ("zero1-offload-0.5", 0.5)):
    for r, e in pairs(arm):
      kinds, total = r["opt_state_bytes_by_memory_kind"], sum(e["opt_state_bytes_by_memory_kind"].values())
      share = kinds.get("device", 0) / total
      bitwise = "zero1-accum" in r["params_equal_arms"]
      met = " -> met" if share <= 1 - fraction and bitwise else " -> missed"
      lines.append(f"{arm} optimizer state in device memory <= {1 - fraction:.2f} of zero1-accum's, "
                   f"bit-identical parameters; copied {2 * kinds.get('pinned_host', 0):,} B/device per step: "
                   f"{share:.3f}, {bitwise}{met}")
      fractions.append((r, e))
  for r, e in zero2 + offload + fractions:
    lines.append(f"(no goal) {r['arm']} dp={r['dp']} ga={r['ga']}: step time / zero1-accum's "
                 f"{r['step_ms'] / e['step_ms']:.3f}")
  return lines


def _has_arm(rows: Sequence[dict], arm: str, row: dict) -> bool:
  return any(e["arm"] == arm and (e["dp"], e["ga"]) == (row["dp"], row["ga"]) for e in rows)


def _engine_line(rows: Sequence[dict]) -> list[str]:
  pairs = [(r, e) for r in rows if r["arm"] == "zero1-engine" and r["ga"] == STEP_RATIO_GA
           for e in rows if e["arm"] == "engine" and (e["dp"], e["ga"]) == (r["dp"], r["ga"])]
  if not pairs:
    return []
  ratios = ", ".join(f"{z['step_ms'] / e['step_ms']:.3f}" for z, e in pairs)
  return [f"(no goal) step time Zero1Engine/Engine at GA={STEP_RATIO_GA}: {ratios}"]


_ARMS = (
    "Arms: `baseline` `nnx.Optimizer` and `zero1` `Zero1Optimizer`, each a `lax.scan` of "
    "`nnx.value_and_grad` over the micro-batches (XLA reduces every micro-batch); `accum` and "
    "`zero1-accum` the same optimizers with `nnx_zero1.value_and_grad_accumulated` (one gradient "
    "reduction per step: an all-reduce, or a reduce-scatter onto the Zero-1 layout); `engine` and "
    "`zero1-engine` the MaxText-style engines."
)

_COLUMNS = (
    "Per device: `opt` is the optimizer state held (from `addressable_shards`), `x ideal` that over "
    "(plain / dp); `peak` is the compiled step's argument + output - donated + temp bytes. `step ms` is "
    "the median over the timed steps, `x plain` its ratio to the baseline at the same (dp, ga), `min ms` "
    "the fastest step. Collectives are per optimizer step, read from the compiled HLO (ops in a loop "
    "count once per trip). `loss diff` is |final loss - the first arm's final loss|."
)


def markdown(result: dict[str, Any]) -> str:
  """bench.md: the settings, both tables and the goals, as Markdown.

  Example::

    >>> md = markdown({"meta": {"model": "tiny"}, "rows": [], "shapes": []})
    >>> md.startswith("# nnx-zero1 bench")
    True
  """
  meta = result["meta"]
  lines = ["# nnx-zero1 bench", ""]
  lines += [f"- {k}: {json.dumps(v) if isinstance(v, dict | list) else v}" for k, v in meta.items()] + [""]
  if result["rows"]:
    lines += ["## Plain `nnx.Optimizer` vs `Zero1Optimizer`", "", _ARMS, "",
              _markdown_table(_HEADER, _cells(result["rows"]))]
    lines += ["", _COLUMNS]
  goals = targets(result["rows"])
  lines += ["", "## Goals", ""] + [f"- {t}" for t in goals] + ["", overall(goals)]
  if result.get("shapes"):
    lines += ["", "## Optimizer bytes Zero-1 leaves replicated on real LLM shapes (adamw)", "",
              _markdown_table(_SHAPES_HEADER, _shape_cells(result["shapes"]))]
  return "\n".join(lines) + "\n"


_PLOT_STYLES = {"baseline": "o-", "zero1": "s-", "accum": "o--", "zero1-accum": "s--", "engine": "^:",
                "zero1-engine": "v:"}
_PLOT_LABELS = {"baseline": "nnx.Optimizer", "zero1": "Zero1Optimizer",
                "accum": "nnx.Optimizer + value_and_grad_accumulated",
                "zero1-accum": "Zero1Optimizer + value_and_grad_accumulated", "engine": "Engine",
                "zero1-engine": "Zero1Engine"}


def plot_series(rows: Sequence[dict]) -> tuple[str, list[tuple[str, str, list[int], list[float]]]]:
  """memory.png's title and its series ``(label, style, dps, MiB per device)``, at the smallest GA.

  Arms whose points coincide (``accum`` holds what ``baseline`` holds; Zero-1 arms sit on the
  ideal plain/dp line) are one series whose label names them all, so every listed series is seen.

  Example::

    >>> rows = [{"arm": a, "dp": 2, "ga": 1, "model": "tiny", "optimizer": "adamw",
    ...          "opt_state_bytes_per_device": b} for a, b in (("baseline", 2**21), ("zero1", 2**20))]
    >>> title, series = plot_series(rows)
    >>> title
    'Optimizer state per device, GA=1 (model tiny, adamw)'
    >>> [label for label, *_ in series]
    ['nnx.Optimizer', 'Zero1Optimizer, ideal: plain / dp']
  """
  ga = min((r["ga"] for r in rows), default=1)
  at_ga = [r for r in rows if r["ga"] == ga]
  points = {
      arm: tuple(sorted((r["dp"], r["opt_state_bytes_per_device"] / 2**20) for r in at_ga if r["arm"] == arm))
      for arm in _PLOT_STYLES
  }
  named = [(_PLOT_LABELS[arm], _PLOT_STYLES[arm], p) for arm, p in points.items() if p]
  if points["baseline"]:
    named.append(("ideal: plain / dp", "k--", tuple((dp, mib / dp) for dp, mib in points["baseline"])))
  merged: dict[tuple, tuple[list[str], str]] = {}
  for label, style, p in named:
    merged.setdefault(p, ([], style))[0].append(label)
  series = [(", ".join(labels), style, [dp for dp, _ in p], [mib for _, mib in p])
            for p, (labels, style) in merged.items()]
  first = at_ga[0] if at_ga else {}
  title = (f"Optimizer state per device, GA={ga} "
           f"(model {first.get('model', '?')}, {first.get('optimizer', '?')})")
  return title, series


def plot_memory(rows: Sequence[dict], path: str) -> None:
  """memory.png: optimizer bytes per device against dp, plain vs Zero-1, with the ideal 1/dp line.

  Example::

    >>> plot_memory([], "/tmp/memory.png")  # doctest: +SKIP
  """
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(7, 4.5))
  title, series = plot_series(rows)
  for label, style, dps, mib in series:
    ax.plot(dps, mib, style, label=label)
  dps = sorted({r["dp"] for r in rows})
  if dps:
    ax.set_xscale("log", base=2)
    ax.set_xticks(dps, [str(d) for d in dps])
  ax.set_xlabel("data-parallel size (dp)")
  ax.set_ylabel("optimizer state per device (MiB)")
  ax.set_title(title, fontsize=10)
  save_figure(fig, ax, path, legend_size=8)


def save_figure(fig: Any, ax: Any, path: str, *, legend_size: int) -> None:
  """The bench's plots end alike: legend, tight layout, a 120-dpi PNG, the figure closed."""
  import matplotlib.pyplot as plt

  ax.legend(fontsize=legend_size)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def write_all(result: dict[str, Any], out_dir: str) -> list[str]:
  """Writes bench.json, bench.md and memory.png into ``out_dir``; returns their paths.

  Example::

    >>> write_all({"meta": {}, "rows": [], "shapes": []}, "/tmp/bench-doc")  # doctest: +SKIP
  """
  return write_files(result, out_dir, markdown, plot_memory)


def write_files(result: dict[str, Any], out_dir: str, to_markdown: Any, plot: Any) -> list[str]:
  """bench.json (``result``), bench.md (``to_markdown(result)``) and memory.png (``plot(rows, path)``)."""
  os.makedirs(out_dir, exist_ok=True)
  paths = [os.path.join(out_dir, n) for n in ("bench.json", "bench.md", "memory.png")]
  with open(paths[0], "w") as f:
    json.dump(result, f, indent=1, default=str)
  with open(paths[1], "w") as f:
    f.write(to_markdown(result))
  plot(result["rows"], paths[2])
  return paths
