"""A plan's result: what each lever needs, printed as a table and kept as plan.json and plan.md."""

from __future__ import annotations

import dataclasses
import json
import os

from nnx_zero1_plan.calibration import CROSSING, Calibration, built_otherwise
from nnx_zero1_plan.cells import gib, ms
from nnx_zero1_plan.closing_lines import limit_words, recommendation_lines, way_out_lines
from nnx_zero1_plan.plan_md import markdown
from nnx_zero1_plan.recommend import Recommendation
from nnx_zero1_plan.row import GPU_SOURCE, Record, Row, _when_set
from nnx_zero1_plan.search_plot import draw_search
from nnx_zero1_plan.settings import PlanSettings
from nnx_zero1_plan.table import table
from nnx_zero1_plan.way_out import WayOut


@dataclasses.dataclass(frozen=True)
class Plan(Record):
  """What each lever needs per device on the target, as plan.json holds it; ``str()`` is the printed table.
  A row per lever, step and remat policy; the recommendation, or when no row fits the way out and what to try
  next; the chip's ``calibration`` each row is also timed by (``--measure``'s runs or ``--calibration``, all
  combined; None: the cost model's time alone), and its runs' ``calibrations`` each apart
  (:func:`~nnx_zero1_plan.calibration.for_step`; None where a plan kept only the combined one)."""

  meta: PlanSettings
  rows: list[Row]
  recommendation: Recommendation | None
  way_out: WayOut | None
  next_steps: list[str]
  calibration: Calibration | None = _when_set()
  calibrations: tuple[Calibration, ...] | None = _when_set()

  def __str__(self) -> str:
    stated = [f"\n{self.meta.batch_default}"] if self.meta.batch_default else []
    lines = [table(self.rows, wide=False), *stated, *self._lines_under()]
    if self.next_steps:
      steps = (f"  {i}. {s}" for i, s in enumerate(self.next_steps, 1))
      lines += ["", "Nothing fits. Try next, in order:", *steps]
    return "\n".join(lines)

  def _calibration_lines(self) -> list[str]:
    """Where the calibrated times come from, and what they leave to the cost model."""
    if self.calibration is None:
      return []
    m = self.meta
    libtpu = m.compiler.split()[-1] if m.compiler.startswith("libtpu") else None
    timed = self.calibration.collectives_on(m.request.topology)
    networks = ("each kind of collective at this slice's own ratio, the slow network priced as the cost "
                "model prices it" if timed else "the networks (which one chip never ran) priced as the cost "
                "model prices them")
    lines = ["", f"step ms (calib.): {self.calibration.said(m.jax, libtpu)}; each kind of work at the "
             f"chip's own ratio to the cost model, {networks}"]
    kinds = self.calibrations or (self.calibration,)
    apart = sorted({(r.lever, r.ga or m.request.ga) for r in self.rows if r.figures.calibrated_step_s
                    and all(built_otherwise(c, r.lever, r.ga or m.request.ga) for c in kinds)})
    if apart:
      steps = ", ".join(f"{lever} at GA {ga}" for lever, ga in apart)
      lines.append("  built otherwise than every run (another lever's update, or the accumulation loop where "
                   f"the runs had none or the reverse), so priced by all of them: {steps}; {CROSSING}")
    return lines

  def _gpu_time_lines(self) -> list[str]:
    """What a GPU row's predicted time rests on."""
    if not any(r.figures.step_time and r.figures.step_time.source == GPU_SOURCE for r in self.rows):
      return []
    return ["", "step ms (pred.) on NVIDIA GPUs: XLA's GPU cost model on the compiled program, its matmuls "
            "priced from tables XLA measured on the GPU; never checked on a GPU (docs/accuracy.md)"]

  def _split_lines(self) -> list[str]:
    """Each ``--global-batch`` row's splits compiled: each one's peak and time, which kind of time that is,
    and what chose the row's."""
    lines = []
    for r in self.rows:
      if not r.splits:
        continue
      each = [f"{s.batch} x {s.ga}: peak {gib(s.peak_bytes_per_device)} GiB"
              + ("" if s.fits else " (does not fit)") + (f", {ms(s.step_s)} ms {s.time}" if s.step_s else "")
              + (f" (calibrated {ms(s.calibrated_s)})" if s.calibrated_s else "") for s in r.splits]
      by = next((s.time for s in r.splits if (s.batch, s.ga) == (r.batch, r.ga)), None)
      lines += ["", f"{r.lever} ({r.step}): the global batch of {r.batch * (r.ga or 1)} sequences split as "
                f"micro-batch x GA, each split compiled: {'; '.join(each)}; chosen: {r.batch} x {r.ga}"
                + (f", by its {by} time" if by else "")]
    return lines

  def _lines_under(self) -> list[str]:
    """The lines under the tables, printed and in plan.md: the calibration's, the global batch's splits, the
    recommendation's, then the way out's."""
    m = self.meta
    limit = limit_words(m.request.margin, m.hbm_bytes, m.usable_bytes)
    return [*self._gpu_time_lines(), *self._calibration_lines(), *self._split_lines(),
            *recommendation_lines(self.recommendation, limit, search=m.request.search,
                                  estimate=m.request.estimate), *way_out_lines(self.way_out)]

  def write(self, out_dir: str) -> list[str]:
    """Writes plan.json and plan.md into ``out_dir``, and with a search ``search.png``
    (:func:`~nnx_zero1_plan.search_plot.draw_search`); returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, "plan.json"), os.path.join(out_dir, "plan.md")]
    with open(paths[0], "w") as f:
      json.dump(self.to_json(), f, indent=1)
    with open(paths[1], "w") as f:
      f.write(markdown(self.meta.to_json(), self.rows, self.next_steps, self._lines_under()))
    drawn = draw_search(self.rows, os.path.join(out_dir, "search.png"))
    return paths + ([drawn] if drawn else [])
