"""nnx-zero1: ZeRO stage 1 (optimizer state sharded over data parallelism) for Flax NNX."""

from nnx_zero1.accumulate import value_and_grad_accumulated
from nnx_zero1.checkpoint import abstract_state, restore_into
from nnx_zero1.errors import Zero1Error
from nnx_zero1.layout import zero1_sharding
from nnx_zero1.mixin import ShardedOptimizerMixin
from nnx_zero1.optimizer import Zero1Optimizer
from nnx_zero1.report import Zero1Report, report
from nnx_zero1.scope import zero1_optimizers

__all__ = [
    "ShardedOptimizerMixin",
    "Zero1Error",
    "Zero1Optimizer",
    "Zero1Report",
    "abstract_state",
    "report",
    "restore_into",
    "value_and_grad_accumulated",
    "zero1_optimizers",
    "zero1_sharding",
]
__version__ = "0.1.0"
