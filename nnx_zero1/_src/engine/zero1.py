"""``Zero1EngineMixin``: the two hooks that make an ``Engine`` Zero-1.

``Engine`` builds its optimizer in ``_make_optimizer(model, tx)`` and reduces
its accumulated gradients onto ``_gradient_targets()``; the mixin answers with
a ``Zero1Optimizer`` and its Zero-1 layout, so the one reduction per step is a
reduce-scatter. (MaxText's own engine has its own hook, answered by
``Zero1MaxTextTrainingEngine`` in ``nnx_zero1.adapters.maxtext``.)
"""

from __future__ import annotations

from typing import Protocol

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
  def strict(self) -> bool: ...
  @property
  def optimizer(self) -> nnx.Optimizer: ...
  OFFLOAD_STATE_TO_HOST: bool


class Zero1EngineMixin:
  """Zero-1 for an engine of ``Engine``'s shape: moments split over the data axis.

  Put it first in the bases: ``class MyZero1Engine(Zero1EngineMixin, Engine)``.
  ``_make_optimizer(model, tx)`` builds a ``Zero1Optimizer`` (``self.mesh``,
  ``self.wrt``, ``self.data_axis``, ``self.strict``) with its moments on the
  Zero-1 layout from the start, and ``_gradient_targets()`` is that layout, so
  the update kernel reduce-scatters the accumulated gradients straight onto it.
  Kernel signatures and the checkpoint tree are unchanged, so checkpoints cross
  both ways. The mixin takes no arguments of its own: the engine's constructor
  is unchanged. ``OFFLOAD_STATE_TO_HOST = True`` on a subclass keeps the state
  shards in host memory between steps (``Zero1Optimizer(offload_state_to_host=True)``).

  Raises:
    Zero1Error: (from the engine's constructor) the optimizer cannot be made
      Zero-1 on ``self.mesh``, e.g. the mesh lacks ``self.data_axis``.

  Example::

    >>> from nnx_zero1.adapters.maxtext import Engine, Zero1EngineMixin
    >>> class MyZero1Engine(Zero1EngineMixin, Engine):
    ...   pass
  """

  OFFLOAD_STATE_TO_HOST = False

  def _make_optimizer(
      self: _EngineHost, model: nnx.Module, tx: optax.GradientTransformation
  ) -> Zero1Optimizer:
    return Zero1Optimizer(
        model, tx, self.mesh, wrt=self.wrt, data_axis=self.data_axis, strict=self.strict,
        offload_state_to_host=self.OFFLOAD_STATE_TO_HOST,
    )

  def _gradient_targets(self: _EngineHost) -> tuple[NamedSharding, ...]:
    optimizer = self.optimizer
    assert isinstance(optimizer, Zero1Optimizer)  # built by _make_optimizer
    return optimizer.zero1_plan.zero1_param_shardings
