"""The optimizer's private names its companion distribution, the planner (``nnx_zero1_plan``), uses, in
one place (named apart from the planner: the optimizer's wheel carries no module named for it,
``tests/test_packaging.py``).

The planner is released with this version of the optimizer and pinned to it (its pyproject.toml), so it may
read what the optimizer does not promise users: how a program's HLO is read, line by line, into the planner's
one record of it (the same reading the optimizer's counts use) and what each device sends by a ring, how a
parameter's layout and memory kind are read, and the mark that says gradients are already on Zero-1's layout
(a program boundary drops it; the planner's split step puts it back). A name the planner needs from the
optimizer's private modules is added here, and the planner imports it from here only
(``tests/planner/test_kinds.py``), so changing one of them shows which planner module it reaches.

Example::

  >>> from nnx_zero1._src.companion import mark_zero1_grads, ring_sent
"""

from nnx_zero1._src.hlo import (
  COLLECTIVES,
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
from nnx_zero1._src.hlo_counts import Counts, by_op, in_loops
from nnx_zero1._src.optimizer import mark_zero1_grads
from nnx_zero1._src.report import memory_kind_of
from nnx_zero1._src.specs import spec_axes
from nnx_zero1._src.traffic import replica_groups, ring_sent

__all__ = ["COLLECTIVES", "INSTRUCTION", "Counts", "by_op", "calls", "collective_of", "computations",
           "estimated_cycles", "executions", "host_copy", "in_loops", "mark_zero1_grads", "memory_kind_of",
           "partitions", "replica_groups", "ring_sent", "shape_bytes", "spec_axes"]
