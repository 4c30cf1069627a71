"""A compiled program read once (:class:`ProgramRecord`), by the optimizer's own reading of HLO
(``nnx_zero1._src.hlo``). What the planner says of a program is a small pure function of the record: the walk
(:mod:`~nnx_zero1_plan.step_time`), the calibration (:mod:`~nnx_zero1_plan.calibrated_time`), the FLOPs
(:mod:`~nnx_zero1_plan.hlo_flops`), the bytes on each network (:mod:`~nnx_zero1_plan.compiled`,
:mod:`~nnx_zero1_plan.slow_network_bytes`: summed by op as the optimizer's own counts are)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import NamedTuple

from nnx_zero1._src.companion import (
  COLLECTIVES,
  INSTRUCTION,
  calls,
  collective_of,
  computations,
  estimated_cycles,
  executions,
  host_copy,
  partitions,
  replica_groups,
  ring_sent,
)

# The classes of work the walk times apart, each at the clock its own microbenchmark measured on the chip
# (Compute.cycle_clocks): the TPU compiler's cycles are one cost model for the matrix units in either
# precision and the vector unit, and on a v5e the three run at different rates against it.
CYCLE_CLASSES = ("matmul-bf16", "matmul-f32", "vector")
_MATMUL = re.compile(r"=\s*(?P<dtype>[a-z]+\d*)\[[^=]*\s(?:convolution|dot)\(")
_MODULE = re.compile(r"^HloModule (?P<name>[\w.\-]+)", re.M)
# What a collective's line holds, at least: its op's name, or a generic async start (collective_of).
_COLLECTIVE_WORDS = (*COLLECTIVES, "collective-permute", "async-start(")
# The TPU compiler's fused reduce-scatter calls a computation whose all-reduce names its groups.
_FUSED = re.compile(r"\bcalls=%?(all-reduce-scatter[\w.\-]*)")


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
  and, with cycles, its class of work (:data:`CYCLE_CLASSES`, the walk's clock) and kind (the calibration's).
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


@dataclasses.dataclass(frozen=True)
class ProgramRecord:
  """A compiled program's text read once.

  Attributes:
    text: ``compiled.as_text()``.
    module: the HLO module's name (None: none named).
    devices: the devices it runs on (its ``num_partitions``; 1 where it names none).
    entry: the entry computation's name.
    computations: each computation's instructions, in the text's order.
    runs: how many times each computation runs per call of the entry (``hlo.executions`` of its calls).

  Example::

    >>> record = ProgramRecord.read('''HloModule m, num_partitions=2
    ... %g (p: f32[8,8]) -> f32[8,8] {
    ...   ROOT %d = f32[8,8]{1,0} dot(%p, %p), lhs_contracting_dims={1}, rhs_contracting_dims={0}
    ... }
    ... ENTRY %main (p: f32[8,8]) -> f32[8,8] {
    ...   %f = f32[8,8]{1,0} fusion(%p), calls=%g, backend_config={"estimated_cycles":"12"}
    ...   ROOT %ar = f32[8,8]{1,0} all-reduce(%f), replica_groups={}, to_apply=%add
    ... }''')
    >>> f, ar = record.computations["main"]
    >>> record.runs, f.work, f.kind, ar.collective.groups(record.devices)
    ({'main': 1, 'g': 1}, 'matmul-f32', 'matmul', ((0, 1),))
  """

  text: str
  module: str | None
  devices: int
  entry: str | None
  computations: Mapping[str, tuple[Instruction, ...]]
  runs: Mapping[str, int]

  @classmethod
  def read(cls, text: str) -> ProgramRecord:
    """``text`` split into computations once, each line read once (a line that is no instruction left out)."""
    bodies, entry = computations(text)
    read = {name: tuple(i for i in (_instruction(line, bodies) for line in lines) if i)
            for name, lines in bodies.items()}
    runs = executions({name: [(c.computation, c.times) for i in body for c in i.calls]
                       for name, body in read.items()}, entry)
    work = _work_of(read)
    graded = {name: tuple(i if i.cycles is None else i._replace(work=(w := work(i)), kind=_kind(i, w, read))
                          for i in body) for name, body in read.items()}
    module = _MODULE.search(text)
    return cls(text, module["name"] if module else None, partitions(text), entry, graded, runs)

  @classmethod
  def of(cls, program: ProgramRecord | str) -> ProgramRecord:
    """``program`` itself, or its text read (:meth:`read`): what each reader takes."""
    return program if isinstance(program, ProgramRecord) else cls.read(program)


def _instruction(line: str, bodies: dict[str, list[str]]) -> Instruction | None:
  """One line read: what every reader of the program asks of it, each asked once."""
  m = INSTRUCTION.match(line)
  if m is None:
    return None
  found = collective_of(line) if any(word in line for word in _COLLECTIVE_WORDS) else None
  collective = None if found is None else Collective(*found, _groups(line, bodies))
  return Instruction(m["name"], m["op"], m["shape"], m["args"], line, estimated_cycles(line),
                     tuple(Call(*c) for c in calls(line, bodies)), collective,
                     host_copy(m["shape"]) if m["op"] == "copy-start" else None)


def _groups(line: str, bodies: dict[str, list[str]]) -> tuple[tuple[int, ...], ...]:
  """A collective's groups as its line spells them, or for the TPU compiler's fused reduce-scatter (whose
  line names none) as the all-reduce inside it does; none where neither names any."""
  fused = _FUSED.search(line) if "replica_groups=" not in line else None
  spelling = next((s for s in bodies.get(fused[1], ()) if "replica_groups=" in s), line) if fused else line
  spelled = replica_groups(spelling, 0)  # of no devices: a line naming no groups reads as one empty group
  return () if spelled == [()] else tuple(spelled)


def _work_of(read: Mapping[str, tuple[Instruction, ...]]) -> Callable[[Instruction], str]:
  """An instruction's class of work: a matmul where it, or a computation it fuses (four deep at most), holds a
  convolution or dot (float32 where its result is: the TPU writes and accumulates in the result's type); else
  ``vector``. Each fused computation is graded once at each depth."""
  graded: dict[tuple[str, int], str] = {}

  def work(instruction: Instruction, depth: int = 0) -> str:
    line = instruction.line
    matmul = _MATMUL.search(line) if "dot(" in line or "convolution(" in line else None
    if matmul:
      return "matmul-f32" if matmul["dtype"] == "f32" else "matmul-bf16"
    for call in (c for c in instruction.calls if c.kind == "calls") if depth < 4 else ():
      key = (call.computation, depth + 1)
      if key not in graded:
        inner = (work(i, depth + 1) for i in read[call.computation])
        graded[key] = next((w for w in inner if w != "vector"), "vector")
      if graded[key] != "vector":
        return graded[key]
    return "vector"

  return work


def _kind(instruction: Instruction, work: str, read: Mapping[str, tuple[Instruction, ...]]) -> str:
  """What the compiler fused into one instruction: the vector unit's work, or a matmul, batched (attention's
  base-dilated convolution) or not, with a reduction fused in (a layer norm's backward) or not."""
  if work == "vector":
    return "vector"
  inner = "\n".join(i.line for c in instruction.calls if c.kind == "calls" for i in read[c.computation])
  return "matmul" + " batched" * ("lhs_dilate" in inner) + " + reduce" * (" reduce(" in inner)
