"""``zero1_optimizers()``: every ``nnx.Optimizer(...)`` built inside the block is a ``Zero1Optimizer``.

For code you do not own (a trainer, a library's training loop) that builds its
own ``nnx.Optimizer``: wrap the construction and nothing else changes.

How: ``flax.nnx`` builds objects through its ``Pytree`` metaclass
(``type(nnx.Optimizer).__call__``). The first time a scope is entered,
``nnx.Optimizer`` gets a metaclass derived from that one whose ``__call__``
asks a ``ContextVar`` whether a scope is active in this thread (or asyncio
task); if not, it builds the plain optimizer as before (one extra lookup). It is
the same class object, so ``from flax.nnx import Optimizer`` names bound anywhere,
``isinstance`` and ``issubclass`` all behave as before. ``nnx.ModelAndOptimizer``
(flax's optimizer that holds its model) gets the same metaclass and builds a
``Zero1ModelAndOptimizer``. Only calls on exactly these two classes are routed:
other subclasses (including ``Zero1Optimizer``) and objects rebuilt by
``nnx.merge`` / ``nnx.jit`` are not.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import threading
from collections.abc import Iterator
from typing import Any

import jax
from flax import nnx

from nnx_zero1._src.compat import set_metaclass
from nnx_zero1._src.mesh import resolve_mesh
from nnx_zero1._src.model_and_optimizer import Zero1ModelAndOptimizer
from nnx_zero1._src.optimizer import Zero1Optimizer
from nnx_zero1._src.options import Zero1Options
from nnx_zero1._src.specs import DataAxis, check_data_axes_on_mesh

__all__ = ["options_scope", "zero1_optimizers"]

_OPTIMIZER = nnx.Optimizer
_MODEL_AND_OPTIMIZER = nnx.ModelAndOptimizer
# What the scope builds for a call on each routed class.
_COUNTERPARTS: dict[type, type[Zero1Optimizer]] = {
    _OPTIMIZER: Zero1Optimizer,
    _MODEL_AND_OPTIMIZER: Zero1ModelAndOptimizer,
}


@dataclasses.dataclass(frozen=True)
class _Scope:
  """What one ``zero1_optimizers`` block asked for, and the optimizers built in it."""

  mesh: jax.sharding.Mesh | None
  options: Zero1Options
  built: list[Zero1Optimizer]

  def build(self, routed: type, model, tx, *args, **kwargs) -> Zero1Optimizer:
    if args:
      raise TypeError(f"nnx.{routed.__name__} takes 2 positional arguments but {2 + len(args)} were given")
    counterpart = _COUNTERPARTS[routed]
    opt = counterpart(model, tx, self.mesh, options=self.options, **kwargs)
    self.built.append(opt)
    return opt


_SCOPE: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar("nnx_zero1_scope", default=None)


class _ScopedOptimizerMeta(type(_OPTIMIZER)):  # type: ignore[misc]  # flax's metaclass, read at import
  """``nnx.Optimizer``'s metaclass, asking the active scope (if any) to build it instead."""

  def __call__(cls, *args: Any, **kwargs: Any) -> Any:
    if cls is _OPTIMIZER or cls is _MODEL_AND_OPTIMIZER:
      scope = _SCOPE.get()
      if scope is not None:
        return scope.build(cls, *args, **kwargs)
    return super().__call__(*args, **kwargs)


_INSTALL = threading.Lock()


def _install() -> None:
  """Gives ``nnx.Optimizer`` and ``nnx.ModelAndOptimizer`` the scope-aware metaclass, once per process."""
  with _INSTALL:
    for routed in _COUNTERPARTS:
      if type(routed) is not _ScopedOptimizerMeta:
        set_metaclass(routed, _ScopedOptimizerMeta)


@contextlib.contextmanager
def zero1_optimizers(
    mesh: jax.sharding.Mesh | None = None, data_axis: DataAxis | None = Zero1Options.data_axis,
    strict: bool = Zero1Options.strict, *, pin_gradients: bool = Zero1Options.pin_gradients,
    offload_state_to_host: bool | float = Zero1Options.offload_state_to_host,
    state_dtype: Any = Zero1Options.state_dtype, state_rounding: str = Zero1Options.state_rounding,
    master_dtype: Any = Zero1Options.master_dtype,
    params_across_dtype: Any = Zero1Options.params_across_dtype,
) -> Iterator[list[Zero1Optimizer]]:
  """Inside the block, ``nnx.Optimizer(model, tx, wrt=..., graph=...)`` builds
  ``Zero1Optimizer(model, tx, mesh, wrt=..., graph=..., data_axis=..., strict=...)``
  (and ``nnx.ModelAndOptimizer(model, tx, wrt=...)`` a ``Zero1ModelAndOptimizer``).

  Wherever the call is written (your code, a library's trainer, a helper it
  calls), as long as it runs in this thread or asyncio task while the block is
  open. Other threads meanwhile get the plain ``nnx.Optimizer``. Yields the list
  of optimizers built so far. Scopes nest; the innermost applies.

  Args:
    mesh: the mesh for every optimizer built inside; ``None`` resolves it at each
      construction as ``Zero1Optimizer`` does (``jax.set_mesh``, a legacy
      ``with mesh:``, the mesh the parameters live on; one device and no mesh is
      data-parallel size 1).
    data_axis: the data-parallel mesh axis (or axes); ``None`` means ``"data"``.
    strict: as for ``Zero1Optimizer``, for every optimizer built inside.
    pin_gradients: as for ``Zero1Optimizer``.
    offload_state_to_host: as for ``Zero1Optimizer`` (``True`` or a fraction).
    state_dtype: as for ``Zero1Optimizer`` (e.g. ``jnp.bfloat16``).
    state_rounding: as for ``Zero1Optimizer``.
    master_dtype: as for ``Zero1Optimizer`` (for bfloat16 parameters).
    params_across_dtype: as for ``Zero1Optimizer`` (on a pod, with ``master_dtype``).

  Returns:
    A context manager yielding the list of the ``Zero1Optimizer`` s built in the block so far.

  Raises:
    Zero1Error: at entry, for a bad ``data_axis``, a ``mesh`` without it or a bad
      ``state_dtype`` / ``state_rounding``; then
      from each construction that cannot apply (as ``Zero1Optimizer`` does).

  Example::

    >>> import jax, optax
    >>> from flax import nnx
    >>> from nnx_zero1 import Zero1Optimizer, zero1_optimizers
    >>> model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    >>> with zero1_optimizers(jax.make_mesh((1,), ("data",))) as built:
    ...   opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    >>> type(opt).__name__, built == [opt], isinstance(opt, nnx.Optimizer)
    ('Zero1Optimizer', True, True)
    >>> type(nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)).__name__
    'Optimizer'
  """
  options = Zero1Options(data_axis=Zero1Options.data_axis if data_axis is None else data_axis, strict=strict,
                         pin_gradients=pin_gradients, offload_state_to_host=offload_state_to_host,
                         state_dtype=state_dtype, state_rounding=state_rounding, master_dtype=master_dtype,
                         params_across_dtype=params_across_dtype)
  with options_scope(mesh, options) as built:
    yield built


@contextlib.contextmanager
def options_scope(mesh: jax.sharding.Mesh | None, options: Zero1Options) -> Iterator[list[Zero1Optimizer]]:
  """:func:`zero1_optimizers` for a caller that holds the options record (the mixin, the engines).

  Raises:
    Zero1Error: at entry, a ``mesh`` without the data axes.

  Example::

    >>> import jax, optax
    >>> from flax import nnx
    >>> with options_scope(jax.make_mesh((1,), ("data",)), Zero1Options(strict=True)) as built:
    ...   opt = nnx.Optimizer(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), optax.sgd(0.1), wrt=nnx.Param)
    >>> built[0].strict
    True
  """
  if mesh is not None:
    check_data_axes_on_mesh(resolve_mesh(mesh), options.data_axis)
  _install()
  scope = _Scope(mesh=mesh, options=options, built=[])
  token = _SCOPE.set(scope)
  try:
    yield scope.built
  finally:
    _SCOPE.reset(token)
