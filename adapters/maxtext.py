"""Zero-1 for training engines of MaxText's shape: ``fwd_bwd`` per micro-batch, ``update`` per step.

- ``Zero1EngineMixin``: Zero-1 for your own engine, through two hooks it calls
  (``_make_optimizer(model, tx)`` and ``_gradient_targets()``).
- ``Zero1MaxTextTrainingEngine`` (and its ahead-of-time twin ``Zero1AbstractMaxTextEngine``):
  MaxText's own ``MaxTextTrainingEngine`` with Zero-1 (Python >= 3.12, loaded on first use).
"""
from __future__ import annotations

from typing import Any, Protocol

import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from nnx_zero1._src.compat import Filter
from nnx_zero1._src.optimizer import Zero1Optimizer
from nnx_zero1._src.options import Zero1Options, levers_of
from nnx_zero1._src.specs import DataAxis

__all__ = ["Zero1EngineMixin", "Zero1MaxTextTrainingEngine", "Zero1AbstractMaxTextEngine"]  # noqa: F822 (lazy)

_LAZY = ("Zero1MaxTextTrainingEngine", "Zero1AbstractMaxTextEngine")


def __getattr__(name: str) -> Any:
  """``Zero1MaxTextTrainingEngine`` (and its ahead-of-time twin ``Zero1AbstractMaxTextEngine``) load
  MaxText (Python >= 3.12) on first use, not on import."""
  if name not in _LAZY:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  try:
    from . import _maxtext_engine
  except ImportError as e:
    raise ImportError(
        f"{name} needs MaxText's engine (maxtext.training_engine, Python >= 3.12; "
        f"tested with maxtext==0.2.5): {e}"
    ) from e
  return getattr(_maxtext_engine, name)


class _EngineHost(Protocol):
  """What ``Zero1EngineMixin`` reads off the engine it is mixed into."""

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
  OFFLOAD_STATE_TO_HOST: bool | float
  STATE_DTYPE: Any
  STATE_ROUNDING: str
  MASTER_DTYPE: Any
  PARAMS_ACROSS_DTYPE: Any


class Zero1EngineMixin:
  """Zero-1 for any ``fwd_bwd`` / ``update`` engine: optimizer moments split over the data axis.

  Put it first in the bases: ``class MyZero1Engine(Zero1EngineMixin, MyEngine)``. The engine
  calls two hooks, the public override points (your engine defines them for its plain case;
  the mixin answers them with Zero-1):

  - ``_make_optimizer(model, tx)``: the engine's optimizer. The mixin builds a
    ``Zero1Optimizer(model, tx, self.mesh, wrt=self.wrt, data_axis=self.data_axis,
    strict=self.strict)``, its moments on the Zero-1 layout from the start.
  - ``_gradient_targets()``: where ``update`` puts the reduced gradients, one ``NamedSharding``
    per trained parameter (``jax.tree.leaves`` order). The mixin answers the Zero-1 layout, so
    an engine that constrains its summed gradients onto these targets inside its update kernel
    gets one reduce-scatter instead of an all-reduce.

  The engine provides ``mesh``, ``wrt`` (an ``nnx`` filter), ``data_axis`` (a mesh axis or a
  tuple of axes), ``strict`` and, once ``_make_optimizer`` returned, ``optimizer``. The mixin
  takes no arguments of its own: the engine's constructor is unchanged, and so are its kernel
  signatures and checkpoint tree (``nnx.state(optimizer)`` has the same paths and shapes), so
  checkpoints cross between the plain and the Zero-1 engine. ``OFFLOAD_STATE_TO_HOST = True``
  on a subclass keeps the state shards in host memory between steps
  (``Zero1Optimizer(offload_state_to_host=True)``; a fraction such as ``0.25`` keeps that share of
  their bytes there); ``STATE_DTYPE = jnp.bfloat16`` stores the
  state in bfloat16 between steps (``Zero1Optimizer(state_dtype=...)``, rounded as
  ``STATE_ROUNDING`` says); ``MASTER_DTYPE = jnp.float32`` keeps float32 master copies of a
  bfloat16 model's parameters split over data (``Zero1Optimizer(master_dtype=...)``);
  ``PARAMS_ACROSS_DTYPE = jnp.int8`` with it and a ``data_axis`` of ``("replica", "data")`` sends
  the new parameters between slices or nodes in int8 blocks
  (``Zero1Optimizer(params_across_dtype=...)``).

  Raises:
    Zero1Error: (from the engine's constructor) the optimizer cannot be made
      Zero-1 on ``self.mesh``, e.g. the mesh lacks ``self.data_axis``.

  Example::

    >>> import jax, optax
    >>> from flax import nnx
    >>> class MyEngine:  # a stand-in for your engine: it builds its optimizer through the hook
    ...   def __init__(self, model, tx, mesh):
    ...     self.mesh, self.wrt, self.data_axis, self.strict = mesh, nnx.Param, "data", False
    ...     self.optimizer = self._make_optimizer(model, tx)
    ...   def _make_optimizer(self, model, tx):
    ...     return nnx.Optimizer(model, tx, wrt=self.wrt)
    >>> class MyZero1Engine(Zero1EngineMixin, MyEngine):
    ...   pass
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> engine = MyZero1Engine(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), optax.adam(1e-3), mesh)
    >>> type(engine.optimizer).__name__, len(engine._gradient_targets())
    ('Zero1Optimizer', 2)
  """

  # The memory levers, each at the record's default.
  OFFLOAD_STATE_TO_HOST: bool | float = Zero1Options.offload_state_to_host
  STATE_DTYPE: Any = Zero1Options.state_dtype
  STATE_ROUNDING: str = Zero1Options.state_rounding
  MASTER_DTYPE: Any = Zero1Options.master_dtype
  PARAMS_ACROSS_DTYPE: Any = Zero1Options.params_across_dtype

  def _make_optimizer(
      self: _EngineHost, model: nnx.Module, tx: optax.GradientTransformation
  ) -> Zero1Optimizer:
    options = Zero1Options(data_axis=self.data_axis, strict=self.strict, **levers_of(self, str.upper))
    return Zero1Optimizer(model, tx, self.mesh, wrt=self.wrt, options=options)

  def _gradient_targets(self: _EngineHost) -> tuple[NamedSharding, ...]:
    optimizer = self.optimizer
    assert isinstance(optimizer, Zero1Optimizer)  # built by _make_optimizer
    return optimizer.zero1_plan.zero1_param_shardings
