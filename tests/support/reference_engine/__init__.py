"""The reference MaxText-shaped engine (``fwd_bwd`` per micro-batch, ``update`` per step): test scaffolding.

``Engine`` (plain ``nnx.Optimizer``, one all-reduce per step) and ``Zero1Engine``
(``Zero1EngineMixin`` from ``nnx_zero1.adapters.maxtext``, one reduce-scatter per step): a
MaxText-shaped second caller of ``nnx_zero1._src.reduction`` that runs on Python 3.11, where
MaxText itself does not. Not part of the wheel; the tests and the benchmark's engine arms
(``python -m benchmarks.bench``) import it as ``tests.support.reference_engine`` from the repository root.

Example::

  engine = Zero1Engine(model, optax.adamw(3e-4), mesh, loss_fn=loss_fn)
  for micro_batch in micro_batches:
    loss = engine.fwd_bwd(micro_batch)
  step = engine.update()
"""

from tests.support.reference_engine.engine import Engine, LossFn
from tests.support.reference_engine.zero1 import Zero1Engine

__all__ = ["Engine", "LossFn", "Zero1Engine"]
