"""When nothing fits: the changes that may make room, lightest first, said as what to try next and compiled
until one fits (a refused compile has no peak to reason from)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence

from nnx_zero1_plan.cells import gib
from nnx_zero1_plan.inputs import PlanError, spelled_mesh
from nnx_zero1_plan.levers import adds_memory, memory_twin, splits_nothing
from nnx_zero1_plan.request import ResolvedRequest, command_line, remats
from nnx_zero1_plan.row import Record, Row


@dataclasses.dataclass(frozen=True)
class Change:
  """One change that may make room: in words, the resolved request with it made, and its kind."""

  what: str
  request: ResolvedRequest
  kind: str


@dataclasses.dataclass(frozen=True)
class Tried(Record):
  """One change compiled: what, its command, whether it fits, its peak or refusal, and the code that fits."""

  what: str
  command: str
  fits: bool
  peak_bytes_per_device: int | None
  error: str | None
  code: str | None = None


@dataclasses.dataclass(frozen=True)
class WayOut(Record):
  """When nothing fits, the changes compiled (plan.json's ``way_out``) and the first that fits (or None)."""

  tried: tuple[Tried, ...]
  found: Tried | None


def changes_to_try(request: ResolvedRequest, *, lever: str, batch_unit: int, remat: str | None,
                   named_axes: Sequence[str] = (), host_memory: bool = True) -> list[Change]:
  """The changes to compile when nothing fits, lightest first, each the resolved request with one change made
  on ``lever``: a smaller micro-batch (a multiple of ``batch_unit``), the model's ``remat`` policy, more fsdp
  (where the model names it), the state in host memory (where the target's compiler offers it)."""
  batch, mesh = request.batch, request.mesh_sizes
  on = functools.partial(dataclasses.replace, request, levers=(lever,))
  out = []
  for times in (2, 4, 8):  # a smaller micro-batch, halved while it still splits over the batch axes
    smaller = batch // times // batch_unit * batch_unit
    if smaller >= batch_unit and smaller * times == batch:
      out.append(Change(f"micro-batch {smaller}, {times}x the accumulation (the same tokens per step)",
                        on(batch=smaller, ga=times * request.ga), "micro-batch"))
  if remat is not None and not remats(request.remat):
    out.append(Change(f"remat {remat}", on(remat=remat), "remat"))
  if "fsdp" in named_axes and "fsdp" in mesh and mesh.get("data", 1) % 2 == 0:
    # The same chips with data halved and fsdp doubled: parameters and gradients over twice the devices.
    wider = {**mesh, "data": mesh.get("data", 1) // 2, "fsdp": 2 * mesh["fsdp"]}
    out.append(Change(f"fsdp={wider['fsdp']} (data={wider['data']}): parameters and gradients split too",
                      on(mesh=spelled_mesh(wider)), "fsdp"))
  if host_memory:
    out.append(Change("the optimizer state in host memory", on(levers=("offload",)), "host memory"))
  return out


def find_way_out(changes: Sequence[Change], compile_changed: Callable[[Change], Row],
                 command: Callable[[Change], str], code: Callable[[Change], str]) -> WayOut:
  """Compiles each change in order until one fits (``compile_changed`` gives its row, or raises ``PlanError``
  where it cannot be planned): every change tried, with its ``command``, and the first that fits with its
  ``code``."""
  tried = []
  for change in changes:
    try:
      row = compile_changed(change)
      fits, peak, error = bool(row.fits), row.figures.peak_bytes_per_device, row.figures.error
    except PlanError as e:
      fits, peak, error = False, None, str(e)
    tried.append(Tried(change.what, command(change), fits, peak, error, code(change) if fits else None))
    if fits:
      break
  return WayOut(tuple(tried), tried[-1] if tried and tried[-1].fits else None)


def next_steps(rows: Sequence[Row], request: ResolvedRequest, levers: Sequence[str], *,
               blocked: Mapping[str, str], remat: str | None, batch_unit: int,
               named_axes: Sequence[str] = ()) -> list[str]:
  """What to try next, in order, when no row fits (empty when one does), each ending with its command: the
  ``levers`` that may make room (not those ``blocked`` for this model), then of :func:`changes_to_try`'s the
  first of each kind but the host memory's (a lever above), on the row that comes closest."""
  if not rows or any(r.verdict for r in rows):
    return []
  steps = []
  tried = {r.lever for r in rows}
  base = next((r for r in rows if r.lever == "baseline" and r.figures.opt_state_bytes_per_device), None)
  idle: list[str] = []
  for name in levers:
    # Only what may make room: not a lever that adds memory, nor one that holds what a refused one held,
    # nor one whose split covers one device here.
    if memory_twin(name) in tried or name in blocked or adds_memory(name):
      continue
    if splits_nothing(name, request.mesh_sizes):
      idle += [name] if memory_twin(name) == name else []  # a narrowing twin is its plain lever's, said once
      continue
    saving = ""
    if name == "zero1" and base is not None:
      saved = (base.figures.opt_state_bytes_per_device or 0) * (1 - 1 / base.mesh.get("data", 1))
      saving = f": saves {gib(saved)} GiB of optimizer state per device (the layout rule)"
    steps.append(f"the lever {name}{saving}: {command_line(request, levers=[name])}")
  if idle:
    steps.append(f"not offered: {', '.join(idle)} (each splits the optimizer state only over axes of size 1 "
                 "on this mesh: they save nothing here)")
  peak = lambda r: r.figures.peak_bytes_per_device or 0
  best = min((r for r in rows if peak(r)), key=peak, default=None)
  temp = 0 if best is None else best.figures.temp_bytes_per_device or 0
  changes: dict[str, str] = {}  # each kind's first change (the micro-batch halved), as its command
  for change in changes_to_try(request, lever=best.lever if best is not None else rows[-1].lever,
                               batch_unit=batch_unit, remat=remat, named_axes=named_axes, host_memory=False):
    changes.setdefault(change.kind, command_line(change.request))
  if best is not None:
    if "fsdp" in changes:
      steps.append(f"{best.lever} comes closest, {gib(peak(best) - best.hbm_bytes)} GiB over; more fsdp "
                   f"splits parameters and gradients too: {changes['fsdp']}")
    if "remat" in changes:
      steps.append(f"remat (recomputes activations; the temp is {gib(temp)} GiB): {changes['remat']}")
  if "micro-batch" in changes:
    why = (f"activations shrink, up to ~{gib(temp / 2)} GiB" if best is not None
           else "the compiler refused every program at this micro-batch")
    steps.append(f"half the micro-batch, twice the accumulation (the same tokens per step; {why}): "
                 f"{changes['micro-batch']}")
  return steps
