"""What one device sends for a collective: its device groups, read off its HLO line in any of HLO's spellings
(:func:`replica_groups`), and a ring's bytes over a group (:func:`ring_sent`): an all-reduce 2(n-1)/n of its
data, a reduce-scatter and an all-gather (n-1)/n. Summed per program by
:func:`nnx_zero1._src.hlo_counts.sent_bytes`; what of it crosses a pod's slow network is the planner's
accounting (``nnx_zero1_plan.slow_network_bytes``), on the same :func:`ring_sent`.
"""

from __future__ import annotations

import math
import re

import numpy as np

__all__ = ["replica_groups", "ring_sent"]

_GROUP_LIST = re.compile(r"replica_groups=\{((?:\{[0-9, ]*\},?\s*)*)\}")
_GROUP_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
# Over mesh axes, the mesh's positions optionally numbered by an iota of device ids
# (``device_ids=([2,4]T(1,0))``: position p is device ``iota(2,4).T.flat[p]``) or by a list of them.
_MESH_GROUP = re.compile(r"replica_groups=mesh\[([^\]]*)\]"
                         r"(?:,\s*device_ids=(?:\(\[([0-9,]+)\](?:T\(([0-9,]+)\))?\)|\[([0-9,]+)\]))?"
                         r"\s*\{([^}]*)\}")


def _mesh_groups(line: str) -> list[tuple[int, ...]] | None:
  """The groups of a collective spelt over mesh axes (``replica_groups=mesh['replica'=2,'data'=4]
  {'data'}``, Shardy's form), devices numbered in the mesh's row-major order unless ``device_ids`` numbers
  them (jax 0.10.2's CPU compiler: ``mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}``);
  None in another spelling.

  A listed sub-axis ``'data':(p)s`` is the size-s part of the axis after its major p.
  """
  m = _MESH_GROUP.search(line)
  if m is None:
    return None
  axes = [(name, int(size)) for name, size in re.findall(r"'([^']+)'=(\d+)", m[1])]
  listed = re.findall(r"'([^']+)'(?::\((\d+)\)(\d+))?", m[5])
  ids = np.arange(math.prod(size for _, size in axes))
  if m[2]:
    ids = np.arange(ids.size).reshape([int(d) for d in m[2].split(",")])
    ids = (ids.transpose([int(d) for d in m[3].split(",")]) if m[3] else ids).reshape(-1)
  elif m[4]:
    ids = np.array([int(d) for d in m[4].split(",")])
  groups: dict[tuple[int, ...], list[int]] = {}
  for device, coords in enumerate(np.ndindex(*(size for _, size in axes))):
    key = []
    for (name, size), c in zip(axes, coords, strict=True):
      for axis, pre, part in listed:
        if axis == name:
          step = size // (int(pre) * int(part)) if part else 1
          c -= (c // step) % (int(part) if part else size) * step
      key.append(c)
    groups.setdefault(tuple(key), []).append(int(ids[device]))
  return [tuple(g) for g in groups.values()]


def replica_groups(line: str) -> list[tuple[int, ...]]:
  """The device groups of a collective's HLO line, in any of HLO's spellings (listed, iota, over mesh
  axes; none where it names none: all the program's devices).

  Example::

    >>> replica_groups("all-reduce(%p), replica_groups={{0,1},{2,3}}, to_apply=%add")
    [(0, 1), (2, 3)]
    >>> replica_groups("all-gather(%p), replica_groups=[2,2]<=[2,2]T(1,0), dimensions={0}")
    [(0, 2), (1, 3)]
    >>> replica_groups("all-reduce(%p), replica_groups={}, to_apply=%add")
    []
    >>> replica_groups("all-reduce(%p), replica_groups=mesh['replica'=2,'data'=4] {'data':(1)2}")
    [(0, 2), (1, 3), (4, 6), (5, 7)]
    >>> replica_groups("all-gather(%p), replica_groups=mesh['a'=4,'b'=2], device_ids=([2,4]T(1,0)) {'a'}")
    [(0, 1, 2, 3), (4, 5, 6, 7)]
  """
  over_axes = _mesh_groups(line)
  if over_axes is not None:
    return over_axes
  iota = _GROUP_IOTA.search(line)
  if iota:
    count, size = int(iota[1]), int(iota[2])
    dims = [int(d) for d in iota[3].split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if iota[4]:
      ids = ids.transpose([int(d) for d in iota[4].split(",")])
    return [tuple(int(i) for i in row) for row in ids.reshape(count, size)]
  listed = _GROUP_LIST.search(line)
  groups = re.findall(r"\{([0-9, ]*)\}", listed[1]) if listed else []
  parsed = [tuple(int(d) for d in g.split(",") if d.strip()) for g in groups]
  return [g for g in parsed if g]


def ring_sent(op: str, result: int, n: int) -> int:
  """Bytes one device sends by a ring for a collective whose result on it is ``result`` bytes, in groups
  of ``n`` (the data is n results for a reduce-scatter, one for an all-gather and an all-reduce).

  Example::

    >>> ring_sent("all-reduce", 8, 4), ring_sent("reduce-scatter", 2, 4), ring_sent("all-gather", 8, 4)
    (12, 6, 6)
    >>> ring_sent("all-to-all", 8, 4)
    6
  """
  if op == "reduce-scatter":
    return result * (n - 1)
  if op == "collective-permute":  # its buffer, to one peer
    return result
  # An all-gather's or an all-to-all's result is the data: each device sends all but its own n-th of it.
  return result * (n - 1) * (2 if op == "all-reduce" else 1) // n
