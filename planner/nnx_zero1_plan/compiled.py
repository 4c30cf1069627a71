"""What a compiled step says about itself: per-device memory, the TPU compiler's refusals, collectives, read
into a row's figures once for every kind of model (:func:`step_figures`)."""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Mapping, Sequence
from typing import Any

from nnx_zero1._src.companion import per_step, per_trip, sent_per_step
from nnx_zero1_plan.hlo_flops import dot_flops
from nnx_zero1_plan.inputs import Backend
from nnx_zero1_plan.program_record import ProgramRecord
from nnx_zero1_plan.row import Collectives, Figures, HbmOom, OpCount, op_counts
from nnx_zero1_plan.slow_network_bytes import across_bytes, dcn_bytes

# The compiler's own peak, in the order jax grew them: jax 0.10.2 (the TPU VM's) has only
# peak_memory_in_bytes, whose figure for a TPU program equals the newer total_allocation_bytes' within a few
# MiB where the sum counts an argument a temporary reuses twice.
PEAK_FIELDS = ("total_allocation_bytes", "peak_memory_in_bytes")


def memory(compiled: Any) -> dict[str, int]:
  """Per-device argument, output, temp and peak bytes of a compiled kernel (device memory).

  ``peak`` is the compiler's own figure for everything the program holds at once, the first of
  :data:`PEAK_FIELDS` the installed jax reports (the TPU compiler's temporaries overlap the arguments near the
  limit, so its figure is below the sum); ``formula_peak`` the sum, argument + output - aliased (donated) +
  temp; ``xla_peak`` ``peak_memory_in_bytes`` (0 where absent); ``host_argument`` the arguments in host memory
  (an offloaded optimizer state), which the device figures leave out.
  """
  stats = compiled.memory_analysis()
  sizes = {name: int(getattr(stats, f"{name}_size_in_bytes"))
           for name in ("argument", "output", "alias", "temp")}
  sizes["formula_peak"] = sizes["argument"] + sizes["output"] - sizes["alias"] + sizes["temp"]
  sizes["peak"] = next((v for v in (int(getattr(stats, f, 0) or 0) for f in PEAK_FIELDS) if v),
                       sizes["formula_peak"])
  sizes["xla_peak"] = int(getattr(stats, "peak_memory_in_bytes", 0) or 0)
  sizes["host_argument"] = int(getattr(stats, "host_argument_size_in_bytes", 0) or 0)
  return sizes


def peak_source() -> str:
  """Where a row's peak comes from with the installed jax (plan.json's ``meta.peak_source``): the first of
  :data:`PEAK_FIELDS` its memory analysis has, else the sum."""
  stats = _memory_stats()
  field = next((f for f in PEAK_FIELDS if hasattr(stats, f)), None)
  return (f"the compiler's {field}" if field else
          "arguments + outputs - donated + temp (the installed jax reports no peak of its own)")


@functools.cache
def _memory_stats() -> Any:
  """A trivial program's memory analysis: which figures the installed jax reports (alike on every backend)."""
  import jax
  import numpy as np

  return jax.jit(lambda x: x + 1).lower(np.zeros(1, np.float32)).compile().memory_analysis()


def split_memory(grads: dict[str, int], update: dict[str, int], resident: int) -> dict[str, int]:
  """Per-device bytes of a step compiled as two programs (:func:`memory` of each), as one step's: the
  optimizer state's device bytes (``resident``; 0 when offloaded) stay while the gradient program runs, and
  ``peak`` is the larger of the two programs'."""
  return {"argument": grads["argument"] + resident, "output": grads["output"], "alias": 0,
          "temp": grads["temp"], "peak": max(grads["peak"] + resident, update["peak"]),
          "formula_peak": max(grads["formula_peak"] + resident, update["formula_peak"]),
          "update_peak": update["peak"], "update_temp": update["temp"],
          "host_argument": max(grads.get("host_argument", 0), update.get("host_argument", 0))}


def cost(compiled: Any) -> dict[str, int | None]:
  """One device's ``flops`` and ``bytes_accessed`` by the compiler's cost analysis (None where it has none:
  XLA's GPU compiler). A loop's body counts once, so these describe programs without one (an update)."""
  analysis = compiled.cost_analysis()
  if isinstance(analysis, list | tuple):
    analysis = analysis[0] if analysis else None
  if not analysis:
    return {"flops": None, "bytes_accessed": None}
  value = lambda key: None if analysis.get(key) is None else int(analysis[key])
  return {"flops": value("flops"), "bytes_accessed": value("bytes accessed")}


def step_flops(compiled: Any, program: ProgramRecord) -> tuple[int | None, str]:
  """A step program's flops on one device and where they come from: ``"hlo_dots"``, its matmuls counted from
  its record (each loop's body times its trip count), or where it holds none ``"cost_analysis"``, the
  compiler's (a loop's body counted once)."""
  counted = dot_flops(program)
  if counted:
    return counted, "hlo_dots"
  return cost(compiled)["flops"], "cost_analysis"


# The TPU compiler's words for a program that does not fit, with or without its CompileTimeHbmOom code (jax
# 0.10.2's libtpu on a chip leaves it out), and an older libtpu's "Used ... of ... hbm".
_OOM = re.compile(r"required for (?P<what>.*?) \((?P<need>[\d.]+)(?P<u1>[KMGT])\) exceeds available HBM "
                  r"\((?P<have>[\d.]+)(?P<u2>[KMGT])\)"
                  r"|Used (?P<need_>[\d.]+)(?P<u1_>[KMGT]) of (?P<have_>[\d.]+)(?P<u2_>[KMGT]) hbm")
_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def hbm_oom(message: str) -> HbmOom | None:
  """The TPU compiler's "does not fit" refusal as numbers (in any of its wordings); None for other errors."""
  m = _OOM.search(message)
  if m is None:
    return HbmOom(None, None, message[:300]) if "CompileTimeHbmOom" in message else None
  need, u1, have, u2 = (m["need"], m["u1"], m["have"], m["u2"]) if m["need"] else (
      m["need_"], m["u1_"], m["have_"], m["u2_"])
  return HbmOom(int(float(need) * _UNITS[u1]), int(float(have) * _UNITS[u2]), m["what"] or "the program")


def collectives_of(program: ProgramRecord, domain_of: Sequence[int] | None = None,
                   backend: Backend | None = None) -> Collectives:
  """A compiled program's :class:`~nnx_zero1_plan.row.Collectives` on one device, read from its record: each
  collective's results per step and per trip of its loops, the bytes one device sends by a ring over its
  groups, and on a pod (``domain_of``: each device's slice or node, in the mesh's order, over more than one)
  what one device sends between them: a program spanning them (``backend.crosses_in_program``), its
  collectives' share across (:func:`~nnx_zero1_plan.slow_network_bytes.across_bytes`); a slice's, its sends to
  the megascale runtime (:func:`~nnx_zero1_plan.slow_network_bytes.dcn_bytes`)."""
  across = None
  if domain_of is not None and backend is not None and len(set(domain_of)) > 1:
    across = {op: OpCount(c["count"], c["across_bytes"]) for op, c in across_bytes(program, domain_of).items()
              if c["across_bytes"]} if backend.crosses_in_program else dcn_bytes(program, len(set(domain_of)))
  return Collectives.from_json({"per_step": per_step(program), "sent_per_step": sent_per_step(program),
                                "per_micro_batch": per_trip(program), "across_per_step": across})


def summed(counts: list[dict[str, dict[str, int]]]) -> dict[str, dict[str, int]]:
  """Several programs' ``{op: {"count", "bytes"}}`` (collectives or host transfers), added up.

  Example::

    >>> summed([{"all-gather": {"count": 1, "bytes": 8}}, {"all-gather": {"count": 2, "bytes": 4}}])
    {'all-gather': {'count': 3, 'bytes': 12}}
  """
  added = _step_counts([(op_counts(c) or {}, 1) for c in counts])
  return {op: dataclasses.asdict(c) for op, c in added.items()}


def _step_counts(programs: Sequence[tuple[Mapping[str, OpCount], int]]) -> dict[str, OpCount]:
  """Each program's counts times the runs one step makes of it, added up op by op (in the order ops first
  appear)."""
  ops = dict.fromkeys(op for counts, _ in programs for op in counts)
  return {op: OpCount(sum(times * c[op].count for c, times in programs if op in c),
                      sum(times * c[op].bytes for c, times in programs if op in c)) for op in ops}


def step_figures(programs: Sequence[tuple[Any, Collectives, int]], resident: int = 0) -> Figures:
  """The figures of one step's compiled programs, each ``(executable, its collectives, the runs one step
  makes of it)`` in order: one program's memory and collectives; a split step's (the update last) memory
  by :func:`split_memory` (the gradient programs' largest peak), its collectives added up over the runs, and
  the update's :func:`cost`. Each memory figure is a :class:`~nnx_zero1_plan.row.Figures` field named by
  :func:`memory`'s own name."""
  *grads, (update, _, _) = programs
  mem = memory(update) if not grads else split_memory(
      max((memory(compiled) for compiled, _, _ in grads), key=lambda m: m["peak"]), memory(update), resident)
  first = programs[0][1]
  collectives = first if not grads else Collectives.from_json({
      when: None if getattr(first, when) is None else _step_counts(
          [(getattr(c, when) or {}, times) for _, c, times in programs]) for when in _COUNTED})
  spent = cost(update) if grads else {}
  memory_fields = {f"{name}_bytes_per_device": v for name, v in mem.items() if name != "xla_peak"}
  return Figures.from_json({**memory_fields, "collectives": collectives,
                            "update_flops_per_device": spent.get("flops"),
                            "update_bytes_accessed_per_device": spent.get("bytes_accessed")})


_COUNTED = tuple(f.name for f in dataclasses.fields(Collectives))
