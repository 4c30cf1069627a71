"""The mesh's arithmetic: every axis and its size, ``replica``'s place on a pod, the axes a batch splits over
and the micro-batch they take, each refusal in one line."""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping

from nnx_zero1_plan.inputs import PlanError, spelled_mesh

SMALLEST_MICRO_BATCH = 8  # --batch's default: the fewest sequences a default micro-batch holds

# The axes a batch or the parameters split over without the model naming them (Zero-1's data axis,
# fsdp for the batch and the layout rule, tp for a model that names it); any other axis must be the model's.
PLANNER_AXES = ("replica", "data", "fsdp", "tp")


def mesh_axes(sizes: Mapping[str, int], model_axes: Iterable[str], devices: int, domains: int = 1,
              where: str = "slices or nodes") -> dict[str, int]:
  """Every mesh axis and its size: ``sizes``, then the model's axes it omits at size 1. With no sizes,
  ``data`` takes every device; on a pod of ``domains`` slices or nodes, ``replica`` crosses them and ``data``
  takes each one's devices."""
  whole = {"replica": domains, "data": devices // domains} if domains > 1 else {"data": devices}
  axes = dict(sizes) if sizes else whole
  for name in ("data", *model_axes):
    axes.setdefault(name, 1)
  if math.prod(axes.values()) != devices:
    shape = spelled_mesh(axes)
    raise PlanError(f"--mesh {shape} has {math.prod(axes.values())} devices; the topology has {devices}")
  check_replica(axes, domains, where)
  return axes


def check_replica(axes: Mapping[str, int], domains: int, where: str = "slices or nodes") -> None:
  """Refuses a mesh whose ``replica`` axis does not run across the ``domains`` slices or nodes, one each.

  The devices are laid out slice (or node) by slice in the mesh's order, so only an outermost ``replica``
  crosses them; another axis there would split the batch and the state across the slow network unsaid."""
  replica = axes.get("replica", 1)
  if domains < 2:
    if replica > 1:
      raise PlanError(f"--mesh {spelled_mesh(axes)}: replica runs across TPU slices or GPU nodes, and "
                      f"this target is one; name the axis data, or plan a pod (--slices N on a TPU "
                      "slice, CHIP:NODESxGPUS for GPU nodes)")
    return
  if next(iter(axes)) == "replica" and replica == domains:
    return
  rest = {k: v for k, v in axes.items() if k != "replica"}
  rest["data"] = rest.get("data", 1) * replica
  inside = math.prod(rest.values())
  others = inside // rest["data"]
  suggestion = ""
  if inside % domains == 0 and (inside // domains) % others == 0:
    rest["data"] = inside // domains // others
    suggestion = f": --mesh {spelled_mesh({'replica': domains, **rest})}"
  raise PlanError(f"--mesh {spelled_mesh(axes)}: on {domains} {where}, replica must be the outermost axis, "
                  f"its size the number of {where}; the devices are laid out in the mesh's order, so only "
                  f"then does it cross them{suggestion}")


def batch_axes(axis_names: Collection[str]) -> tuple[str, ...]:
  """The mesh axes a batch's rows are split over (``replica``, ``data``, ``fsdp``, those the mesh has): their
  sizes' product is a micro-batch's unit."""
  return tuple(a for a in ("replica", "data", "fsdp") if a in axis_names)


def micro_batch(batch: int | None, unit: int, over: str) -> int:
  """The plan's global micro-batch: ``--batch``, checked to split over the batch axes (``unit`` devices), or
  by default (None) the smallest multiple of ``unit`` of at least :data:`SMALLEST_MICRO_BATCH` (8) sequences.
  """
  if batch is None:
    return -(-SMALLEST_MICRO_BATCH // unit) * unit
  if batch % unit:
    raise PlanError(f"--batch {batch} does not split over the batch axes ({over} = {unit} devices): give a "
                    f"multiple of {unit}, or leave --batch out for {micro_batch(None, unit, over)}")
  return batch


def check_axis_names(sizes: Mapping[str, int], model_axes: Iterable[str]) -> None:
  """Refuses a ``--mesh`` axis the model does not name and the planner does not know (a misspelling)."""
  known = tuple(dict.fromkeys([*PLANNER_AXES, *model_axes]))
  unknown = [a for a in sizes if a not in known]
  if unknown:
    raise PlanError(f"unknown --mesh axis {', '.join(unknown)}; axes the model names or the planner "
                    f"splits over: {', '.join(known)}")
