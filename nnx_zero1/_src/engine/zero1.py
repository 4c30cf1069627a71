"""``Zero1EngineMixin``: Zero-1 for engines of the MaxText ``fwd_bwd``/``update`` shape.

Kept apart from ``maxtext.py`` (which re-exports it) because it needs nothing
of either engine but the hook that builds the optimizer. One mixin serves both
engines this package ships: the reference ``Engine`` builds its optimizer in
``_make_optimizer(model, tx)``, MaxText's ``MaxTextTrainingEngine`` in
``_build_optimizer(tx)``; the mixin answers both with a ``Zero1Optimizer``.
"""

from __future__ import annotations

from typing import Any, Protocol

import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from nnx_zero1._src.compat import Filter
from nnx_zero1._src.optimizer import Zero1Optimizer
from nnx_zero1._src.specs import DataAxis

__all__ = ["Zero1EngineMixin"]


class _EngineHost(Protocol):
  """What ``Zero1EngineMixin`` reads off an ``Engine``."""

  @property
  def mesh(self) -> Mesh: ...
  @property
  def wrt(self) -> Filter: ...
  @property
  def data_axis(self) -> DataAxis: ...
  @property
  def optimizer(self) -> nnx.Optimizer: ...


class _MaxTextHost(Protocol):
  """What ``Zero1EngineMixin`` reads off MaxText's ``MaxTextTrainingEngine`` in ``_build_optimizer``."""

  @property
  def _model(self) -> Any: ...
  @property
  def _mesh(self) -> Mesh: ...


def _zero1_optimizer(
    model: Any, tx: optax.GradientTransformation, mesh: Mesh, wrt: Filter, data_axis: DataAxis,
    *, reduce_scattered: bool,
) -> Zero1Optimizer:
  # reduce_scattered: the engine's update kernel puts the gradients on the Zero-1 layout itself.
  return Zero1Optimizer(model, tx, mesh, wrt=wrt, data_axis=data_axis, pin_gradients=not reduce_scattered)


class Zero1EngineMixin:
  """Zero-1 for an engine of ``Engine``'s shape: moments split over the data axis.

  Put it first in the bases: ``class MyZero1Engine(Zero1EngineMixin, MyEngine)``.
  It needs the engine to build its optimizer through one of two hooks before
  any kernel reads shardings off the live arrays: ``_make_optimizer(model, tx)``
  (``Engine``: ``self.mesh``, ``self.wrt``, ``self.data_axis``) or
  ``_build_optimizer(tx)`` (MaxText's engine: ``self._model``, ``self._mesh``,
  ``nnx.Param`` over the ``"data"`` axis). Either way the optimizer is a
  ``Zero1Optimizer`` with its moments on the Zero-1 layout from the start.
  ``Engine`` also reduces its accumulated gradient rows (``nnx_zero1._src.engine.rows``)
  onto ``_gradient_targets()`` (the Zero-1 layout), so the one reduction per step
  is a reduce-scatter. Kernel signatures and the checkpoint tree are unchanged, so
  checkpoints cross both ways.

  Example::

    >>> from nnx_zero1.adapters.maxtext import Engine, Zero1EngineMixin
    >>> class MyZero1Engine(Zero1EngineMixin, Engine):
    ...   pass
  """

  def _make_optimizer(
      self: _EngineHost, model: nnx.Module, tx: optax.GradientTransformation
  ) -> Zero1Optimizer:
    return _zero1_optimizer(model, tx, self.mesh, self.wrt, self.data_axis, reduce_scattered=True)

  def _build_optimizer(self: _MaxTextHost, tx: optax.GradientTransformation) -> Zero1Optimizer:
    return _zero1_optimizer(self._model, tx, self._mesh, nnx.Param, "data", reduce_scattered=False)

  def _gradient_targets(self: _EngineHost) -> tuple[NamedSharding, ...]:
    optimizer = self.optimizer
    assert isinstance(optimizer, Zero1Optimizer)  # built by _make_optimizer
    return optimizer.zero1_plan.zero1_param_shardings
