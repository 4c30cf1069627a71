"""XLA's GPU compiler puts no cycles in a compiled program (why the walk needs them: docs/planner.md's
"Compute, GPU"), but its latency-hiding scheduler writes the schedule it chose (:func:`dump_options`), each
instruction's start and end in cycles. Pure, but for reading those files."""

from __future__ import annotations

import contextlib
import glob
import os
import re
import tempfile
from collections.abc import Callable, Iterator

_MODULE = re.compile(r'^hlo_module \{\n  name: "(?P<name>[^"]+)"', re.M)
_INSTRUCTION = re.compile(r'^      name: "(?P<name>[^"]+)"$|^      id: (?P<id>\d+)$', re.M)
# A scheduled instruction; the text format leaves out a field that is zero (the first one's start).
_TIMED = re.compile(r"instructions \{\s*id: (?P<id>\d+)(?P<fields>[^}]*)\}")
_TIMESTAMP = re.compile(r"(?P<edge>start|end)_timestamp_cycles: (?P<t>[\d.e+\-]+)")
_PER_MICROSECOND = re.compile(r"cycles_per_microsecond: (?P<n>[\d.]+)")


def dump_options(directory: str) -> dict[str, str | bool]:
  """The compiler options that write a compile's schedule into ``directory``."""
  return {"xla_dump_to": directory, "xla_dump_latency_hiding_schedule": True}


@contextlib.contextmanager
def dumped_schedule() -> Iterator[tuple[dict[str, str | bool], Callable[[], dict[str, dict[str, float]]]]]:
  """The compiler options that dump a compile's schedule into a folder removed after, and its reader
  (:func:`scheduled_seconds`)."""
  with tempfile.TemporaryDirectory(prefix="nnx_zero1_plan_schedule_", ignore_cleanup_errors=True) as folder:
    yield dump_options(folder), lambda: scheduled_seconds(folder)


def parse_schedule(text: str) -> tuple[str | None, dict[str, float]]:
  """One ``*.schedule.txt``: its module's name, and each scheduled instruction's estimated seconds by name."""
  module = _MODULE.search(text)
  names: dict[str, str] = {}
  current = None
  split = text.find("\ncomputation_schedules")
  for m in _INSTRUCTION.finditer(text, 0, split if split >= 0 else len(text)):
    if m["name"] is not None:
      current = m["name"]
    elif current is not None:
      names[m["id"]], current = current, None
  rate = _PER_MICROSECOND.search(text)
  per_second = float(rate["n"]) * 1e6 if rate else 1e6
  seconds = {}
  for m in _TIMED.finditer(text, max(split, 0)):
    if m["id"] in names:
      at = {t["edge"]: float(t["t"]) for t in _TIMESTAMP.finditer(m["fields"])}
      seconds[names[m["id"]]] = round((at.get("end", 0.0) - at.get("start", 0.0)) / per_second, 12)
  return (module["name"] if module else None), seconds


def scheduled_seconds(directory: str) -> dict[str, dict[str, float]]:
  """Every schedule dumped into ``directory``: ``{module name: {instruction name: estimated seconds}}``."""
  out: dict[str, dict[str, float]] = {}
  for path in sorted(glob.glob(os.path.join(directory, "*.schedule.txt"))):
    with open(path) as f:
      name, seconds = parse_schedule(f.read())
    if name is not None:
      out.setdefault(name, {}).update(seconds)
  return out
