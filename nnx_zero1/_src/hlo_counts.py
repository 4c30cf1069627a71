"""Collectives and host transfers counted per call of a compiled program: what the bench reports and the
tests assert (public as ``nnx_zero1.testing``), each computation weighted by how often it runs
(:func:`nnx_zero1._src.hlo.executions`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TypeVar

from nnx_zero1._src.hlo import (
  COLLECTIVES,
  INSTRUCTION,
  call_graph,
  calls,
  collective_ops,
  computations,
  executions,
  host_copy,
  shape_bytes,
)

__all__ = ["TRANSFERS", "Counts", "per_call", "in_loops", "by_op", "collectives", "loop_collectives",
           "host_transfers", "loop_host_transfers"]

TRANSFERS = ("to-device", "to-host")
Counts = dict[str, dict[str, int]]
T = TypeVar("T")


def _count(lines: list[str], times: int, out: Counts) -> None:
  for op, nbytes, _ in collective_ops(lines) if times else ():
    entry = out.setdefault(op, {"count": 0, "bytes": 0})
    entry["count"] += times
    entry["bytes"] += times * nbytes


def _count_transfers(lines: list[str], times: int, out: Counts) -> None:
  for m in map(INSTRUCTION.match, lines if times else ()):
    way = host_copy(m["shape"]) if m and m["op"] == "copy-start" else None
    if m and way:
      out[way]["count"] += times
      out[way]["bytes"] += times * shape_bytes(m["shape"].split(", ")[0])


def per_call(hlo: str, count: Callable[[list[str], int, Counts], None], ops: tuple[str, ...]) -> Counts:
  """``count`` over every computation, each weighted by how often it runs per call of the entry."""
  bodies, entry = computations(hlo)
  runs = executions(call_graph(bodies), entry)
  out = {op: {"count": 0, "bytes": 0} for op in ops}
  for name, lines in bodies.items():
    count(lines, runs.get(name, 0), out)
  return out


def in_loops(graph: Mapping[str, Iterable[tuple[str, str]]], entry: str | None) -> dict[str, int]:
  """The computations inside while loops' bodies (and what they run), each once (weight 1: one trip's), from
  each computation's calls (``graph``: (kind, callee), :func:`nnx_zero1._src.hlo.calls`' kinds).

  Example::

    >>> in_loops({"main": [("body", "b"), ("calls", "f")], "b": [("calls", "g")]}, "main")
    {'b': 1, 'g': 1}
  """
  inside: dict[str, int] = {}

  def visit(name: str, in_loop: bool) -> None:
    if in_loop:
      if name in inside:
        return
      inside[name] = 1
    for kind, callee in graph.get(name, ()):
      visit(callee, in_loop or kind == "body")

  if entry is not None:
    visit(entry, False)
  return inside


def by_op(computations: Mapping[str, Iterable[T]], weights: Mapping[str, int],
          figures: Callable[[T], tuple[str, Mapping[str, int]] | None], ops: tuple[str, ...] = COLLECTIVES
          ) -> Counts:
  """Each item's ``figures`` (its op and what one run of it adds, ``bytes`` among them; None: not counted),
  counted and summed by op, each computation's items ``weights[name]`` times (not at all where absent).

  Args:
    computations: each computation's items (a record's instructions), in the program's order.
    weights: how often each computation counts (:func:`nnx_zero1._src.hlo.executions`, or :func:`in_loops`).
    figures: what one run of an item adds to its op's figures, or None.
    ops: the ops counted even where none runs.

  Returns:
    ``{op: {"count", "bytes", ...}}``, the ops in ``computations``' order after ``ops``.

  Example::

    >>> by_op({"main": [("all-reduce", 8), ("negate", 0)]}, {"main": 2},
    ...       lambda i: (i[0], {"bytes": i[1]}) if i[1] else None, ())
    {'all-reduce': {'count': 2, 'bytes': 16}}
  """
  out: Counts = {op: {"count": 0, "bytes": 0} for op in ops}
  for name, items in computations.items():
    times = weights.get(name, 0)
    for op, adds in (found for item in (items if times else ()) if (found := figures(item))):
      entry = out.setdefault(op, {"count": 0, "bytes": 0})
      entry["count"] += times
      for key, value in adds.items():
        entry[key] = entry.get(key, 0) + times * value
  return out


def _per_trip(hlo: str, count: Callable[[list[str], int, Counts], None], ops: tuple[str, ...]) -> Counts:
  """``count`` over the computations inside while-loop bodies (and what they call), each once."""
  bodies, entry = computations(hlo)
  inside = in_loops({name: [(kind, callee) for line in lines for kind, callee, _ in calls(line, bodies)]
                     for name, lines in bodies.items()}, entry)
  out = {op: {"count": 0, "bytes": 0} for op in ops}
  for name in inside:
    count(bodies[name], 1, out)
  return out


def collectives(hlo: str) -> Counts:
  """Count and bytes of all-reduce, reduce-scatter and all-gather per call of a compiled kernel.

  Parses ``compiled.as_text()``. Async forms (``all-gather-start``) count once
  (their ``-done`` halves are skipped), and so does the TPU compiler's fused
  reduce-scatter (a fusion calling ``all-reduce-scatter``: an all-reduce and a
  slice in one collective); combined collectives have tuple shapes,
  whose arrays are summed; bytes are the results' bytes on one device. An op
  inside a while loop with a known trip count (XLA's annotation, or a
  ``counter < N`` condition, as in the TPU compiler's HLO) counts once per trip.

  Args:
    hlo: the text of a compiled kernel, ``jitted.lower(...).compile().as_text()``.

  Returns:
    ``{op: {"count": int, "bytes": int}}`` for each op of :data:`COLLECTIVES`, per call of
    the kernel; bytes are one device's.

  Example::

    >>> hlo = '''ENTRY %main (p: f32[8]) -> f32[8] {
    ...   ROOT %all-reduce = f32[8]{0} all-reduce(%p), to_apply=%add
    ... }'''
    >>> collectives(hlo)["all-reduce"]
    {'count': 1, 'bytes': 32}
  """
  return per_call(hlo, _count, COLLECTIVES)


def loop_collectives(hlo: str) -> Counts:
  """Collectives inside while-loop bodies (and what they call), each counted once: one trip's.

  A micro-batch loop (``lax.scan``) that defers its gradient reduction has
  none of gradient size here.

  Args:
    hlo: the text of a compiled kernel, ``jitted.lower(...).compile().as_text()``.

  Returns:
    ``{op: {"count": int, "bytes": int}}`` for each op of :data:`COLLECTIVES`, one trip
    of each loop; bytes are one device's.

  Example::

    >>> hlo = '''%body (p: f32[8]) -> f32[8] {
    ...   ROOT %ar = f32[8]{0} all-reduce(%p), to_apply=%add
    ... }
    ...
    ... ENTRY %main (a: f32[8]) -> f32[8] {
    ...   %w = f32[8]{0} while(%a), condition=%cond, body=%body
    ...   ROOT %ag = f32[16]{0} all-gather(%w), dimensions={0}
    ... }'''
    >>> loop_collectives(hlo)["all-reduce"], loop_collectives(hlo)["all-gather"]
    ({'count': 1, 'bytes': 32}, {'count': 0, 'bytes': 0})
  """
  return _per_trip(hlo, _count, COLLECTIVES)


def host_transfers(hlo: str) -> Counts:
  """Copies between host and device memory per call of a kernel compiled by the TPU compiler.

  Counts the async copies (``copy-start``) whose destination or source, not
  both, is in host memory (memory space 5 in the TPU compiler's layouts), each
  once per run, as :func:`collectives` counts collectives. XLA's CPU backend
  keeps host memory kinds in ordinary memory and shows no such copies.

  Args:
    hlo: the text of a compiled kernel, ``jitted.lower(...).compile().as_text()``.

  Returns:
    ``{"to-device": {"count", "bytes"}, "to-host": {"count", "bytes"}}``; bytes are one device's.

  Example::

    >>> hlo = '''ENTRY %main (p: f32[8]) -> f32[8] {
    ...   %c = (f32[8]{0}, f32[8]{0:S(5)}, u32[]{:S(2)}) copy-start(%p)
    ...   ROOT %d = f32[8]{0} copy-done(%c)
    ... }'''
    >>> host_transfers(hlo)["to-device"]
    {'count': 1, 'bytes': 32}
  """
  return per_call(hlo, _count_transfers, TRANSFERS)


def loop_host_transfers(hlo: str) -> Counts:
  """Host transfers inside while-loop bodies, each counted once: one trip's (see :func:`host_transfers`).

  Example::

    >>> hlo = '''ENTRY %main (p: f32[8]) -> f32[8] {
    ...   ROOT %n = f32[8]{0} negate(%p)
    ... }'''
    >>> loop_host_transfers(hlo)
    {'to-device': {'count': 0, 'bytes': 0}, 'to-host': {'count': 0, 'bytes': 0}}
  """
  return _per_trip(hlo, _count_transfers, TRANSFERS)
