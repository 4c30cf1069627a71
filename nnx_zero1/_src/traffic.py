"""What each device sends for a compiled program's collectives.

Counting a collective by its result (``hlo.collectives``) reads a reduce-scatter as 1/n of the all-reduce
that moves the same data. Here each op counts what a ring sends from one device: an all-reduce 2(n-1)/n
of its data, a reduce-scatter and an all-gather (n-1)/n, n the devices in its replica group (read off the
collective's line in any of HLO's spellings: :func:`replica_groups`, :func:`group_size`). What of those
bytes crosses a pod's slow network is the planner's accounting
(``nnx_zero1_plan.slow_network_bytes``), on the same :func:`ring_sent`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import numpy as np

from nnx_zero1._src.hlo import COLLECTIVES, collective_ops, computations, partitions
from nnx_zero1._src.hlo_counts import Counts, per_call

__all__ = ["replica_groups", "group_size", "ring_sent", "with_fused_groups", "sent_counter", "sent_bytes"]

_GROUP_LIST = re.compile(r"replica_groups=\{((?:\{[0-9, ]*\},?\s*)*)\}")
_GROUP_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
_FIRST_GROUP = re.compile(r"replica_groups=\{\{([0-9, ]*)\}")
# Over mesh axes, the mesh's positions optionally numbered by an iota of device ids
# (``device_ids=([2,4]T(1,0))``: position p is device ``iota(2,4).T.flat[p]``) or by a list of them.
_MESH_GROUP = re.compile(r"replica_groups=mesh\[([^\]]*)\]"
                         r"(?:,\s*device_ids=(?:\(\[([0-9,]+)\](?:T\(([0-9,]+)\))?\)|\[([0-9,]+)\]))?"
                         r"\s*\{([^}]*)\}")
# A collective's groups in any of the three spellings, whole.
_GROUPS = re.compile("|".join(p.pattern for p in (_MESH_GROUP, _GROUP_IOTA, _GROUP_LIST)))
_FUSED_CALL = re.compile(r"\bcalls=%?(all-reduce-scatter[\w.\-]*)")


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


def replica_groups(line: str, devices: int) -> list[tuple[int, ...]]:
  """The device groups of a collective's HLO line, in any of HLO's spellings (listed, iota, over mesh
  axes; all ``devices``, one group, where it names none).

  Example::

    >>> replica_groups("all-reduce(%p), replica_groups={{0,1},{2,3}}, to_apply=%add", 4)
    [(0, 1), (2, 3)]
    >>> replica_groups("all-gather(%p), replica_groups=[2,2]<=[2,2]T(1,0), dimensions={0}", 4)
    [(0, 2), (1, 3)]
    >>> replica_groups("all-reduce(%p), replica_groups={}, to_apply=%add", 2)
    [(0, 1)]
    >>> replica_groups("all-reduce(%p), replica_groups=mesh['replica'=2,'data'=4] {'data':(1)2}", 8)
    [(0, 2), (1, 3), (4, 6), (5, 7)]
    >>> replica_groups("all-gather(%p), replica_groups=mesh['a'=4,'b'=2], device_ids=([2,4]T(1,0)) {'a'}", 8)
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
  return [g for g in parsed if g] or [tuple(range(devices))]


def group_size(line: str, devices: int) -> int:
  """The devices in each group of a collective's HLO line (``devices`` where its groups are all of them).

  Example::

    >>> group_size("all-gather(%p), replica_groups=[2,4]<=[8], dimensions={0}", 8)
    4
    >>> group_size("all-reduce(%p), replica_groups=mesh['replica'=2,'data'=4] {'data'}", 8)
    4
  """
  over_axes = _mesh_groups(line)
  if over_axes is not None:
    return len(over_axes[0])
  iota = _GROUP_IOTA.search(line)
  if iota:
    return int(iota[2])
  first = _FIRST_GROUP.search(line)
  size = len([d for d in first[1].split(",") if d.strip()]) if first else 0
  return size or devices


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


def with_fused_groups(hlo: str) -> str:
  """``hlo`` with each of the TPU compiler's fused reduce-scatters given its groups.

  The fusion's line (``fusion(...), calls=%all-reduce-scatter``) names none: they are on the all-reduce
  inside the computation it calls. Read off the fusion's line alone, a reduce-scatter over a slice's 16
  chips would count as one over all of the program's devices.

  Example::

    >>> hlo = '''%all-reduce-scatter (p: f32[8]) -> f32[4] {
    ...   %ar = f32[8]{0} all-reduce(%p), replica_groups={{0,1},{2,3}}, to_apply=%add
    ... }
    ... ENTRY %main (q: f32[8]) -> f32[4] {
    ...   ROOT %rs = f32[4]{0} fusion(%q), kind=kCustom, calls=%all-reduce-scatter
    ... }'''
    >>> with_fused_groups(hlo).splitlines()[-2].split(", ", 2)[2]
    'calls=%all-reduce-scatter, replica_groups={{0,1},{2,3}}'
  """
  inner = {name: next((m[0] for m in map(_GROUPS.search, lines) if m), None)
           for name, lines in computations(hlo)[0].items() if name.startswith("all-reduce-scatter")}
  return _FUSED_CALL.sub(lambda m: m[0] + (f", {inner[m[1]]}" if inner.get(m[1]) else ""), hlo)


def sent_counter(devices: int) -> Callable[[list[str], int, Counts], None]:
  """A counter for ``hlo.per_call``: each collective's count and the bytes one device sends for it
  (:func:`ring_sent`), summed per op, every loop trip counted.

  Args:
    devices: the devices of the program, the group size of a collective over all of them.

  Returns:
    ``count(lines, times, out)``, adding to ``out`` in place.
  """
  def count(lines: list[str], times: int, out: Counts) -> None:
    for op, result, line in collective_ops(lines) if times else ():
      entry = out.setdefault(op, {"count": 0, "bytes": 0})
      entry["count"] += times
      entry["bytes"] += times * ring_sent(op, result, group_size(line, devices))

  return count


def sent_bytes(hlo: str, devices: int | None = None) -> Counts:
  """The bytes one device sends per call of a compiled kernel, per collective, on one basis for all three.

  An all-reduce of some gradients sends what their reduce-scatter plus the all-gather of the results
  sends.

  Args:
    hlo: the text of a compiled kernel, ``jitted.lower(...).compile().as_text()``.
    devices: the devices of the program, the group size of a collective over all of them (default: the
      module's ``num_partitions``, else 1).

  Returns:
    ``{op: {"count": int, "bytes": int}}`` for each op of :data:`~nnx_zero1.testing.COLLECTIVES`; bytes are
    those one device sends, every loop trip counted.

  Example::

    >>> hlo = '''ENTRY %main (p: f32[8]) -> f32[2] {
    ...   %ar = f32[8]{0} all-reduce(%p), replica_groups={}, to_apply=%add
    ...   ROOT %rs = f32[2]{0} reduce-scatter(%p), replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%add
    ... }'''
    >>> sent = sent_bytes(hlo, 4)
    >>> sent["all-reduce"]["bytes"], sent["reduce-scatter"]["bytes"]
    (48, 24)
  """
  return per_call(with_fused_groups(hlo), sent_counter(devices or partitions(hlo)), COLLECTIVES)

