"""The optimizer's private names its companion distribution, the planner (``nnx_zero1_plan``), uses, in
one place (named apart from the planner: the optimizer's wheel carries no module named for it,
``tests/test_packaging.py``).

The planner is released with this version of the optimizer and pinned to it (its pyproject.toml), so it may
read what the optimizer does not promise users: how a program's HLO is read and what each device sends
(the same counting the optimizer's tests use), how a parameter's layout and memory kind are read, and the
mark that says gradients are already on Zero-1's layout (a program boundary drops it; the planner's split
step puts it back). A name the planner needs from the optimizer's private modules is added here, and the
planner imports it from here only (``tests/planner/test_kinds.py``), so changing one of them shows which
planner module it reaches.

Example::

  >>> from nnx_zero1._src.companion import mark_zero1_grads, ring_sent
"""

from nnx_zero1._src.hlo import (
  COLLECTIVES,
  INSTRUCTION,
  callees,
  collective_of,
  computations,
  condition_trip_count,
  estimated_cycles,
  executions,
  host_copy,
  partitions,
  result_bytes,
  shape_bytes,
  trip_count,
)
from nnx_zero1._src.hlo_counts import Counts, host_transfers, per_call
from nnx_zero1._src.optimizer import mark_zero1_grads
from nnx_zero1._src.report import memory_kind_of
from nnx_zero1._src.specs import spec_axes
from nnx_zero1._src.traffic import group_size, replica_groups, ring_sent, sent_counter, with_fused_groups

__all__ = ["COLLECTIVES", "INSTRUCTION", "Counts", "callees", "collective_of", "computations", "executions",
           "estimated_cycles", "host_copy", "host_transfers", "condition_trip_count", "group_size",
           "mark_zero1_grads", "memory_kind_of", "partitions", "per_call", "replica_groups", "result_bytes",
           "ring_sent", "sent_counter", "shape_bytes", "spec_axes", "trip_count", "with_fused_groups"]
