"""nnx-zero1: ZeRO stage 1 (optimizer state sharded over data parallelism) for Flax NNX."""

import pathlib as _pathlib

from nnx_zero1._src.accumulate import value_and_grad_accumulated
from nnx_zero1._src.checkpoint import abstract_state, restore_into
from nnx_zero1._src.errors import Zero1Error, Zero1Warning
from nnx_zero1._src.layout import zero1_sharding
from nnx_zero1._src.mixin import ShardedOptimizerMixin
from nnx_zero1._src.model_and_optimizer import Zero1ModelAndOptimizer
from nnx_zero1._src.optimizer import Zero1Optimizer
from nnx_zero1._src.options import Zero1Options
from nnx_zero1._src.report import Zero1Report, bytes_per_device, report
from nnx_zero1._src.scope import zero1_optimizers

__all__ = [
    "ShardedOptimizerMixin",
    "Zero1Error",
    "Zero1ModelAndOptimizer",
    "Zero1Optimizer",
    "Zero1Options",
    "Zero1Report",
    "Zero1Warning",
    "abstract_state",
    "bytes_per_device",
    "report",
    "restore_into",
    "value_and_grad_accumulated",
    "zero1_optimizers",
    "zero1_sharding",
]
__version__ = "0.1.0"

from nnx_zero1._src.source_checkout import register_source_adapters as _register_source_adapters  # noqa: E402

_register_source_adapters(_pathlib.Path(__file__).resolve().parent)
