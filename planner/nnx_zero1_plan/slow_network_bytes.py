"""What of a compiled program's collective bytes crosses a pod's slow network: a GPU program's collectives
whose groups span nodes (:func:`across_bytes`), a TPU slice's megascale sends (:func:`dcn_bytes`)."""

from __future__ import annotations

import re
from collections.abc import Sequence

from nnx_zero1._src.companion import COLLECTIVES, Counts, by_op, ring_sent, shape_bytes
from nnx_zero1_plan.program_record import Instruction, ProgramRecord

# A send to the megascale runtime (:func:`dcn_bytes`): its operand, and its transfer type.
_MEGASCALE_SEND = re.compile(r'^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*\((?P<array>[a-z0-9]+\[[0-9,]*\])\S*, '
                             r'.*\bsend\(.*_xla_megascale_transfer_type="(?P<kind>\w+)"')


def across_bytes(program: ProgramRecord | str, domain_of: Sequence[int]) -> Counts:
  """``{op: {"count", "bytes", "across_bytes"}}`` per call, every loop trip counted: the bytes one device
  sends per collective (``nnx_zero1.testing.sent_bytes``), and of those the bytes that cross between domains
  (``domain_of``: each device's, in the program's partition order).

  A group within one domain sends nothing across; a group of n devices spanning k domains, reduced
  hierarchically (within each domain, then across domains among peers, then within again), sends
  (k-1)/(n-1) of its bytes across: an estimate of the algorithm, from the groups the compiler chose.
  """
  devices = len(domain_of)

  def sent(i: Instruction) -> tuple[str, dict[str, int]] | None:
    if i.collective is None:
      return None
    groups, op, bytes_sent = i.collective.groups(devices), i.collective.op, i.collective.sent(devices)
    if (n := len(groups[0])) < 2:
      return op, {"bytes": bytes_sent}
    k = max(len({domain_of[d] for d in group}) for group in groups)  # the most domains a group spans
    if " all-to-all" in i.line:  # each device sends its n-th to every other: those in other domains cross
      return op, {"bytes": bytes_sent, "across_bytes": bytes_sent * n * (k - 1) // (k * (n - 1))}
    return op, {"bytes": bytes_sent, "across_bytes": bytes_sent * (k - 1) // (n - 1)}

  record = ProgramRecord.of(program)
  return {op: {"count": c["count"], "bytes": c["bytes"], "across_bytes": c.get("across_bytes", 0)}
          for op, c in by_op(record.computations, record.runs, sent).items()}


def _dcn_sent(op: str, operand: int, slices: int) -> int:
  """Bytes one device sends among ``slices`` for a megascale transfer of ``operand`` bytes: a collective's by
  a ring (``ring_sent`` of its result: k operands for an all-gather, 1/k for a reduce-scatter), else once."""
  if op not in COLLECTIVES:
    return operand
  result = {"all-gather": operand * slices, "reduce-scatter": operand // slices}.get(op, operand)
  return ring_sent(op, result, slices)


def dcn_bytes(program: ProgramRecord | str, slices: int) -> Counts:
  """``{op: {"count", "bytes"}}`` by transfer type: the bytes one device sends between TPU slices per call of
  a program over ``slices``, by a ring among them.

  The TPU compiler compiles a multi-slice program as one slice's program; each collective over the
  slices becomes a send to the megascale runtime (after the within-slice part), its operand what one device
  hands over. Each is counted once (its ``recv`` is the same transfer), every loop trip too.
  """
  def sent(i: Instruction) -> tuple[str, dict[str, int]] | None:
    m = _MEGASCALE_SEND.match(i.line) if "_xla_megascale_transfer_type" in i.line else None
    if m is None:
      return None
    op = m["kind"].lower().replace("_", "-")  # ALL_REDUCE: all-reduce
    return op, {"bytes": _dcn_sent(op, shape_bytes(m["array"]), slices)}

  record = ProgramRecord.of(program)
  return {op: c for op, c in by_op(record.computations, record.runs, sent, ()).items() if c["count"]}
