"""A compiled program's HLO read once, into one record (:class:`HloRecord`): its computations, how often each
runs, and what each instruction is. What is counted (:mod:`nnx_zero1._src.hlo_counts`) and the planner's
figures (``nnx_zero1_plan.program_record``, which grades each instruction's work) are functions of it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import NamedTuple, Self

from nnx_zero1._src.hlo import (
  FUSED_REDUCE_SCATTER_CALL,
  INSTRUCTION,
  calls,
  collective_of,
  computations,
  estimated_cycles,
  executions,
  host_copy,
  partitions,
  shape_bytes,
)
from nnx_zero1._src.traffic import replica_groups, ring_sent

_MODULE = re.compile(r"^HloModule (?P<name>[\w.\-]+)", re.M)


class Call(NamedTuple):
  """A computation an instruction runs: how, which, and its runs per run of it (``hlo.calls``' one rule)."""

  kind: str
  computation: str
  times: int


class Collective(NamedTuple):
  """A collective: its op, its result's bytes on one device, whether it is an async start (its ``-done`` waits
  for it), and its device groups as spelled (none: all the program's devices; a fused reduce-scatter's, the
  all-reduce's inside it)."""

  op: str
  result_bytes: int
  start: bool
  spelled_groups: tuple[tuple[int, ...], ...]

  def groups(self, devices: int) -> tuple[tuple[int, ...], ...]:
    """Its device groups in a program of ``devices``."""
    return self.spelled_groups or (tuple(range(devices)),)

  def sent(self, devices: int) -> int:
    """The bytes one device sends for it by a ring over its group, in a program of ``devices``."""
    return ring_sent(self.op, self.result_bytes, len(self.groups(devices)[0]))


class Instruction(NamedTuple):
  """One instruction, read once: its name, op, result shape, operands, line, the TPU compiler's cycles (None:
  none), the computations it runs, its collective, its copy's way between host and device memory (None: none)
  and, where a reader grades it (the planner's record, for instructions with cycles), its class and kind of
  work (None as read here).
  """

  name: str
  op: str
  shape: str
  args: str
  line: str
  cycles: int | None
  calls: tuple[Call, ...]
  collective: Collective | None
  host: str | None
  work: str | None = None
  kind: str | None = None

  @property
  def host_bytes(self) -> int:
    """A copy's bytes at its destination (its result's first array), one device's."""
    return shape_bytes(self.shape.split(", ")[0])


@dataclasses.dataclass(frozen=True)
class HloRecord:
  """A compiled program's text read once.

  Attributes:
    text: ``compiled.as_text()``.
    module: the HLO module's name (None: none named).
    devices: the devices it runs on (its ``num_partitions``; 1 where it names none).
    entry: the entry computation's name.
    computations: each computation's instructions, in the text's order.
    runs: how many times each computation runs per call of the entry (``hlo.executions`` of its calls).

  Example::

    >>> record = HloRecord.read('''HloModule m, num_partitions=2
    ... %body (p: f32[8]) -> f32[8] {
    ...   ROOT %ar = f32[8]{0} all-reduce(%p), replica_groups={}, to_apply=%add
    ... }
    ... ENTRY %main (a: f32[8]) -> f32[8] {
    ...   ROOT %w = f32[8]{0} while(%a), body=%body, backend_config={"known_trip_count":{"n":"3"}}
    ... }''')
    >>> (ar,) = record.computations["body"]
    >>> record.runs, ar.collective.groups(record.devices), ar.collective.sent(record.devices)
    ({'main': 1, 'body': 3}, ((0, 1),), 32)
  """

  text: str
  module: str | None
  devices: int
  entry: str | None
  computations: Mapping[str, tuple[Instruction, ...]]
  runs: Mapping[str, int]

  @classmethod
  def read(cls, text: str) -> Self:
    """``text`` split into computations once, each line read once (a line that is no instruction left out)."""
    bodies, entry = computations(text)
    read = {name: tuple(i for i in (_instruction(line, bodies) for line in lines) if i)
            for name, lines in bodies.items()}
    runs = executions({name: [(c.computation, c.times) for i in body for c in i.calls]
                       for name, body in read.items()}, entry)
    module = _MODULE.search(text)
    return cls(text, module["name"] if module else None, partitions(text), entry, read, runs)

  def loop_bodies(self) -> dict[str, int]:
    """The computations inside while loops' bodies (and what they run), each once: one trip's, as weights.

    Example::

      >>> HloRecord.read('''%b (p: f32[8]) -> f32[8] {
      ...   ROOT %n = f32[8]{0} negate(%p)
      ... }
      ... ENTRY %main (a: f32[8]) -> f32[8] {
      ...   ROOT %w = f32[8]{0} while(%a), condition=%c, body=%b
      ... }''').loop_bodies()
      {'b': 1}
    """
    inside: dict[str, int] = {}

    def visit(name: str, in_loop: bool) -> None:
      if in_loop:
        if name in inside:
          return
        inside[name] = 1
      for call in (c for i in self.computations.get(name, ()) for c in i.calls):
        visit(call.computation, in_loop or call.kind == "body")

    if self.entry is not None:
      visit(self.entry, False)
    return inside


def _instruction(line: str, bodies: dict[str, list[str]]) -> Instruction | None:
  """One line read: what every reader of the program asks of it, each asked once."""
  m = INSTRUCTION.match(line)
  if m is None:
    return None
  found = collective_of(line)
  collective = None if found is None else Collective(*found, _groups(line, bodies))
  return Instruction(m["name"], m["op"], m["shape"], m["args"], line, estimated_cycles(line),
                     tuple(Call(*c) for c in calls(line, bodies)), collective,
                     host_copy(m["shape"]) if m["op"] == "copy-start" else None)


def _groups(line: str, bodies: dict[str, list[str]]) -> tuple[tuple[int, ...], ...]:
  """A collective's groups as its line spells them, or for the TPU compiler's fused reduce-scatter (whose
  line names none) as the all-reduce inside it does; none where neither names any."""
  # The TPU compiler's fused reduce-scatter calls a computation whose all-reduce names its groups.
  fused = FUSED_REDUCE_SCATTER_CALL.search(line) if "replica_groups=" not in line else None
  spelling = next((s for s in bodies.get(fused[1], ()) if "replica_groups=" in s), line) if fused else line
  return tuple(replica_groups(spelling))
