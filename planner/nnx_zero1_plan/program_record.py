"""A compiled program read once (:class:`ProgramRecord`): the optimizer's own record of its HLO
(``nnx_zero1._src.hlo_record``, on which the optimizer's counts are read too), each instruction with cycles
graded for the walk. What the planner says of a program is a small pure function of the record: the walk
(:mod:`~nnx_zero1_plan.step_time`), the calibration (:mod:`~nnx_zero1_plan.calibrated_time`), the FLOPs
(:mod:`~nnx_zero1_plan.hlo_flops`), the bytes on each network (:mod:`~nnx_zero1_plan.compiled`,
:mod:`~nnx_zero1_plan.slow_network_bytes`)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping

from nnx_zero1._src.companion import HloRecord, Instruction

# The classes of work the walk times apart, each at the clock its own microbenchmark measured on the chip
# (Compute.cycle_clocks): the TPU compiler's cycles are one cost model for the matrix units in either
# precision and the vector unit, and on a v5e the three run at different rates against it.
CYCLE_CLASSES = ("matmul-bf16", "matmul-f32", "vector")
_MATMUL = re.compile(r"=\s*(?P<dtype>[a-z]+\d*)\[[^=]*\s(?:convolution|dot)\(")


@dataclasses.dataclass(frozen=True)
class ProgramRecord(HloRecord):
  """A compiled program's text read once (its attributes :class:`~nnx_zero1._src.hlo_record.HloRecord`'s),
  each instruction with cycles given its class of work (:data:`CYCLE_CLASSES`, the walk's clock) and kind
  (the calibration's)."""

  @classmethod
  def read(cls, text: str) -> ProgramRecord:
    """``text`` read once (:meth:`HloRecord.read`), each instruction with cycles graded."""
    record = super().read(text)
    read = record.computations
    work = _work_of(read)
    graded = {name: tuple(i if i.cycles is None else i._replace(work=(w := work(i)), kind=_kind(i, w, read))
                          for i in body) for name, body in read.items()}
    return dataclasses.replace(record, computations=graded)

  @classmethod
  def of(cls, program: ProgramRecord | str) -> ProgramRecord:
    """``program`` itself, or its text read (:meth:`read`): what each reader takes."""
    return program if isinstance(program, ProgramRecord) else cls.read(program)


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
