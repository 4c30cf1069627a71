"""``Zero1EngineMixin``: Zero-1 for engines of the MaxText ``fwd_bwd``/``update`` shape.

Kept apart from ``maxtext.py`` (which re-exports it) because it needs nothing
of ``Engine`` but its two hooks.
"""

from __future__ import annotations

import optax
from flax import nnx
from jax.sharding import NamedSharding

from nnx_zero1.optimizer import Zero1Optimizer

__all__ = ["Zero1EngineMixin"]


class Zero1EngineMixin:
  """Zero-1 for an engine of ``Engine``'s shape: moments split over the data axis.

  Put it first in the bases: ``class MyZero1Engine(Zero1EngineMixin, MyEngine)``.
  It needs the engine to (1) build its optimizer through
  ``_make_optimizer(model, tx)`` before any kernel reads shardings off the live
  arrays, and (2) reduce its accumulated gradient rows with
  ``nnx_zero1.deferred.reduce_rows`` onto ``_gradient_targets()`` inside the update
  kernel. The mixin returns a ``Zero1Optimizer`` from the first (moments on the
  Zero-1 layout from the start) and the Zero-1 layout from the second, so the
  one gradient reduction per step becomes a reduce-scatter; the optimizer
  slices the parameters locally and all-gathers them back. Kernel signatures
  and the checkpoint tree are unchanged, so checkpoints cross both ways.

  Example::

    >>> from nnx_zero1.adapters.maxtext import Engine, Zero1EngineMixin
    >>> class MyZero1Engine(Zero1EngineMixin, Engine):
    ...   pass
  """

  def _make_optimizer(self, model: nnx.Module, tx: optax.GradientTransformation) -> Zero1Optimizer:
    # The update kernel reduce-scatters the gradients onto the Zero-1 layout itself.
    return Zero1Optimizer(model, tx, self.mesh, wrt=self.wrt, data_axis=self.data_axis, pin_gradients=False)

  def _gradient_targets(self) -> tuple[NamedSharding, ...]:
    return self.optimizer.zero1_plan.zero1_param_shardings
