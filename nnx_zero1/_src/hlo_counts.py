"""Collectives and host transfers counted per call of a compiled program, from its record
(:class:`~nnx_zero1._src.hlo_record.HloRecord`): what the bench reports and the tests assert (public as
``nnx_zero1.testing``), each computation weighted by how often it runs; and what each device sends by a ring
(:func:`sent_bytes`: counting a collective by its result reads a reduce-scatter as 1/n of the all-reduce that
moves the same data).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TypeVar

from nnx_zero1._src.hlo import COLLECTIVES
from nnx_zero1._src.hlo_record import HloRecord, Instruction

__all__ = ["TRANSFERS", "Counts", "by_op", "per_step", "per_trip", "sent_per_step", "collectives",
           "loop_collectives", "host_transfers", "loop_host_transfers", "sent_bytes"]

TRANSFERS = ("to-device", "to-host")
Counts = dict[str, dict[str, int]]
T = TypeVar("T")


def by_op(computations: Mapping[str, Iterable[T]], weights: Mapping[str, int],
          figures: Callable[[T], tuple[str, Mapping[str, int]] | None], ops: tuple[str, ...] = COLLECTIVES
          ) -> Counts:
  """Each item's ``figures`` (its op and what one run of it adds, ``bytes`` among them; None: not counted),
  counted and summed by op, each computation's items ``weights[name]`` times (not at all where absent).

  Args:
    computations: each computation's items (a record's instructions), in the program's order.
    weights: how often each computation counts (a record's ``runs``, or its ``loop_bodies()``: one trip's).
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


def _result(i: Instruction) -> tuple[str, dict[str, int]] | None:
  return (i.collective.op, {"bytes": i.collective.result_bytes}) if i.collective else None


def _transfer(i: Instruction) -> tuple[str, dict[str, int]] | None:
  return (i.host, {"bytes": i.host_bytes}) if i.host else None


def per_step(record: HloRecord) -> Counts:
  """Each collective's results on one device per call of a program (:func:`collectives`), from its record."""
  return by_op(record.computations, record.runs, _result)


def per_trip(record: HloRecord) -> Counts:
  """Each collective's results on one device in one trip of each loop (:func:`loop_collectives`)."""
  return by_op(record.computations, record.loop_bodies(), _result)


def sent_per_step(record: HloRecord, devices: int | None = None) -> Counts:
  """The bytes one device sends by a ring per call of a program, per collective (:func:`sent_bytes`), in a
  program of ``devices`` (default: the record's)."""
  devices = devices or record.devices

  def sent(i: Instruction) -> tuple[str, dict[str, int]] | None:
    return (i.collective.op, {"bytes": i.collective.sent(devices)}) if i.collective else None

  return by_op(record.computations, record.runs, sent)


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
  return per_step(HloRecord.read(hlo))


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
  return per_trip(HloRecord.read(hlo))


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
  record = HloRecord.read(hlo)
  return by_op(record.computations, record.runs, _transfer, TRANSFERS)


def loop_host_transfers(hlo: str) -> Counts:
  """Host transfers inside while-loop bodies, each counted once: one trip's (see :func:`host_transfers`).

  Example::

    >>> hlo = '''ENTRY %main (p: f32[8]) -> f32[8] {
    ...   ROOT %n = f32[8]{0} negate(%p)
    ... }'''
    >>> loop_host_transfers(hlo)
    {'to-device': {'count': 0, 'bytes': 0}, 'to-host': {'count': 0, 'bytes': 0}}
  """
  record = HloRecord.read(hlo)
  return by_op(record.computations, record.loop_bodies(), _transfer, TRANSFERS)


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
  return sent_per_step(HloRecord.read(hlo), devices)

