"""The lines under a plan's tables, printed and in plan.md: the recommendation, and when nothing fits, the
changes compiled to make room."""

from __future__ import annotations

from nnx_zero1_plan.cells import gib
from nnx_zero1_plan.recommend import BY_CALIBRATED, BY_THROUGHPUT, Recommendation
from nnx_zero1_plan.request import remats
from nnx_zero1_plan.way_out import WayOut


def limit_words(margin: float | None, hbm_bytes: int, usable_bytes: int) -> str:
  """How the usable memory was set, in words: the user's margin, or the backend's reserve."""
  if margin is not None:
    return f"a {margin:.0%} margin"
  reserve = hbm_bytes - usable_bytes
  return f"the backend's {gib(reserve)} GiB reserve" if reserve else "the compiler's own check"


def recommendation_lines(rec: Recommendation | None, limit: str, *, search: bool = False,
                         estimate: bool = False) -> list[str]:
  """The recommendation under the table: the configuration, its code, its command, why it beat the levers
  that fit as far, and where the baseline beats a Zero-1 lever, why; the first line blank, none where
  nothing fits (``rec`` None) and the plan is no ``estimate`` (which recommends nothing). ``limit``: how the
  usable memory was set (:func:`limit_words`)."""
  if rec is None:
    if estimate:
      return ["", "Nothing is recommended from an estimate: the same command without --estimate compiles the "
              "whole programs and decides."]
    return []
  shape = {"one": "one program", "split": "two programs"}.get(rec.step, rec.step)
  remat = f", remat {rec.remat}" if remats(rec.remat) else ""
  # (the order's second word names what ranked: a kept plan's later words may be an older release's)
  which = {BY_THROUGHPUT[1]: "the most predicted tokens per second of what fits",
           BY_CALIBRATED[1]: "the most calibrated tokens per second of what fits"}.get(
      rec.order[1] if len(rec.order) > 1 else "", "the largest that fits" if search else "fits")
  lines = ["", f"Recommended: {rec.lever} at micro-batch {rec.micro_batch} ({shape}{remat}), {which} "
           f"with {limit}", *_code_and_command(rec.code, rec.cli)]
  lines += [f"  why: {line}" for line in rec.why]
  return lines + [f"  note: {line}" for line in (*rec.baseline_beats, *rec.notes)]


def way_out_lines(way_out: WayOut | None) -> list[str]:
  """When nothing fits, what was compiled to make room: the first change that fits, with its code and its
  command, and the changes before it that did not."""
  if not way_out:
    return []
  found = way_out.found
  tried = [f"  tried first: {t.what}: {t.error or gib(t.peak_bytes_per_device) + ' GiB'}"[:200]
           for t in way_out.tried if not t.fits]
  if found is None:
    return ["", "Nothing fits as asked, and no change compiled fits either:", *tried]
  return ["", f"Nothing fits as asked; compiled, the first change that fits: {found.what} (peak "
          f"{gib(found.peak_bytes_per_device)} GiB)", *_code_and_command(found.code, found.command), *tried]


def _code_and_command(code: str | None, command: str) -> list[str]:
  """A configuration's code, indented under ``code:`` (no such line without code), and its command."""
  lines = [f"    {line}".rstrip() for line in (code or "").splitlines()]
  return [*(["  code:"] if lines else []), *lines, f"  reproduce: {command}"]
