"""The optimizer's private names its companion distribution, the planner (``nnx_zero1_plan``), uses, in
one place (named apart from the planner: the optimizer's wheel carries no module named for it,
``tests/test_packaging.py``).

The planner is released with this version of the optimizer and pinned to it (its pyproject.toml), so it may
read what the optimizer does not promise users: a program's HLO read once into one record (the record the
optimizer's own counts are functions of), those counts, and what each device sends by a ring, how a
parameter's layout and memory kind are read, and the mark that says gradients are already on Zero-1's layout
(a program boundary drops it; the planner's split step puts it back). A name the planner needs from the
optimizer's private modules is added here, and the planner imports it from here only
(``tests/planner/test_kinds.py``), so changing one of them shows which planner module it reaches.

Example::

  >>> from nnx_zero1._src.companion import mark_zero1_grads, ring_sent
"""

from nnx_zero1._src.hlo import COLLECTIVES, shape_bytes
from nnx_zero1._src.hlo_counts import Counts, by_op, per_step, per_trip, sent_per_step
from nnx_zero1._src.hlo_record import Collective, HloRecord, Instruction
from nnx_zero1._src.optimizer import mark_zero1_grads
from nnx_zero1._src.report import memory_kind_of
from nnx_zero1._src.specs import spec_axes
from nnx_zero1._src.traffic import ring_sent

__all__ = ["COLLECTIVES", "Collective", "Counts", "HloRecord", "Instruction", "by_op", "mark_zero1_grads",
           "memory_kind_of", "per_step", "per_trip", "ring_sent", "sent_per_step", "shape_bytes", "spec_axes"]
