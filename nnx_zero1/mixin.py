"""``ShardedOptimizerMixin``: Zero-1 for trainers that build an ``nnx.Optimizer`` in ``__init__``.

The trainer's own ``__init__`` runs unchanged; while it runs, the
``nnx.Optimizer(...)`` calls it makes (in this thread only) build a
``Zero1Optimizer`` with the same arguments instead. The state is created on
the Zero-1 layout directly, so no full-size copy of the moments ever exists,
and anything the trainer does next with its optimizer (restore a checkpoint,
re-place the state from its variable metadata) sees the Zero-1 layout.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import inspect
import threading
import types
from collections.abc import Iterator
from typing import Any

import jax
from flax import nnx

from nnx_zero1.checks import resolve_mesh
from nnx_zero1.errors import Zero1Error, describe_mesh
from nnx_zero1.optimizer import Zero1Optimizer
from nnx_zero1.specs import DataAxis, data_axes, data_axis_size

__all__ = ["ShardedOptimizerMixin"]

_NNX = nnx
_OPTIMIZER = nnx.Optimizer


@dataclasses.dataclass
class _Route:
  """What one trainer construction asked for, and the optimizers it got."""

  mesh: jax.sharding.Mesh
  data_axis: tuple[str, ...]
  strict: bool
  built: list[Zero1Optimizer] = dataclasses.field(default_factory=list)


# The route of the trainer being constructed in this thread (or task), if any.
_ROUTE: contextvars.ContextVar[_Route | None] = contextvars.ContextVar("nnx_zero1_route", default=None)


class _RoutedOptimizerType(type):
  """Calls build a ``Zero1Optimizer`` while this thread constructs a mixin trainer, else a
  plain ``nnx.Optimizer``; ``isinstance``/``issubclass`` answer as for ``nnx.Optimizer``."""

  def __call__(cls, model, tx, *args, **kwargs):
    route = _ROUTE.get()
    if route is None:
      return _OPTIMIZER(model, tx, *args, **kwargs)
    if args:
      raise TypeError(f"nnx.Optimizer takes 2 positional arguments but {2 + len(args)} were given")
    opt = Zero1Optimizer(model, tx, route.mesh, data_axis=route.data_axis, strict=route.strict, **kwargs)
    route.built.append(opt)
    return opt

  def __instancecheck__(cls, obj) -> bool:
    return isinstance(obj, _OPTIMIZER)

  def __subclasscheck__(cls, sub) -> bool:
    return issubclass(sub, _OPTIMIZER)

  def __getattr__(cls, name: str) -> Any:
    return getattr(_OPTIMIZER, name)


class _RoutedOptimizer(metaclass=_RoutedOptimizerType):
  """What ``nnx.Optimizer`` names in a trainer's module while a mixin trainer is being built."""


class _RoutedNnx(types.ModuleType):
  """``flax.nnx`` as seen from a trainer's module during construction: only ``Optimizer`` differs."""

  Optimizer = _RoutedOptimizer

  def __init__(self):
    super().__init__(_NNX.__name__, _NNX.__doc__)

  def __getattr__(self, name: str) -> Any:
    return getattr(_NNX, name)


_ROUTED_NNX = _RoutedNnx()
_LOCK = threading.Lock()
# id(module globals) -> (the globals, {name: original value}, number of constructions using it)
_PATCHED: dict[int, tuple[dict, dict[str, Any], int]] = {}


def _init_globals(cls: type, after: type) -> list[dict]:
  """The module globals of every ``__init__`` that ``cls`` runs after ``after`` in its MRO."""
  mro = cls.__mro__
  found, seen = [], set()
  for klass in mro[mro.index(after) + 1:]:
    init = klass.__dict__.get("__init__")
    module_globals = getattr(inspect.unwrap(init), "__globals__", None) if init else None
    if module_globals is None or id(module_globals) in seen:
      continue
    seen.add(id(module_globals))
    found.append(module_globals)
  return found


def _routable_names(module_globals: dict) -> dict[str, Any]:
  """Names in a module bound to ``flax.nnx`` or to ``nnx.Optimizer`` itself."""
  return {
      name: value
      for name, value in module_globals.items()
      if value is _NNX or value is _OPTIMIZER
  }


def _install(module_globals: dict) -> bool:
  with _LOCK:
    key = id(module_globals)
    if key in _PATCHED:
      g, originals, users = _PATCHED[key]
      _PATCHED[key] = (g, originals, users + 1)
      return True
    originals = _routable_names(module_globals)
    if not originals:
      return False
    for name, value in originals.items():
      module_globals[name] = _ROUTED_NNX if value is _NNX else _RoutedOptimizer
    _PATCHED[key] = (module_globals, originals, 1)
    return True


def _uninstall(module_globals: dict) -> None:
  with _LOCK:
    g, originals, users = _PATCHED[id(module_globals)]
    if users > 1:
      _PATCHED[id(module_globals)] = (g, originals, users - 1)
      return
    del _PATCHED[id(module_globals)]
    g.update(originals)


@contextlib.contextmanager
def _routing(cls: type, route: _Route) -> Iterator[None]:
  """Routes the ``nnx.Optimizer`` calls of ``cls``'s base ``__init__``s to ``Zero1Optimizer``."""
  installed: list[dict] = []
  token = _ROUTE.set(route)
  try:
    for module_globals in _init_globals(cls, ShardedOptimizerMixin):
      if _install(module_globals):
        installed.append(module_globals)
    if not installed:
      raise Zero1Error(
          f"{cls.__name__}: no __init__ after ShardedOptimizerMixin in its MRO is defined in a "
          "module that refers to flax.nnx or nnx.Optimizer, so there is no optimizer "
          "construction to route to Zero1Optimizer"
      )
    yield
  finally:
    _ROUTE.reset(token)
    for module_globals in installed:
      _uninstall(module_globals)


class ShardedOptimizerMixin:
  """Gives a trainer a ``Zero1Optimizer`` without changing its constructor.

  Put it first among the bases: ``class MyZero1Trainer(ShardedOptimizerMixin,
  MyTrainer)``. While ``MyTrainer.__init__`` (and the ``__init__`` of its own
  bases) runs, each ``nnx.Optimizer(model, tx, wrt=..., graph=...)`` call it makes
  builds ``Zero1Optimizer(model, tx, mesh, wrt=..., graph=..., data_axis=...,
  strict=...)`` instead, with its state created directly on the Zero-1 layout.

  What a trainer must look like for this to apply:

  - its ``__init__`` builds the optimizer by calling ``nnx.Optimizer(...)`` (through
    ``from flax import nnx`` or ``from flax.nnx import Optimizer``) in the module
    that defines that ``__init__``, in the calling thread;
  - the model's parameters are already placed on the mesh when that happens;
  - a mesh is current: ``jax.set_mesh(mesh)`` or a legacy ``with mesh:`` block;
  - the mesh has the data axis (or axes).

  Anything else is a ``Zero1Error``, never a silently replicated optimizer: no
  mesh, a mesh without the data axis (both before the trainer's ``__init__``
  starts), a trainer whose ``__init__`` modules do not use ``nnx.Optimizer``, or
  one that built no optimizer by the end of its ``__init__``.

  Only the calling thread is affected: other threads (and code outside the
  trainer's modules) constructing ``nnx.Optimizer`` meanwhile get the plain
  one, and everything is put back when ``__init__`` returns or raises.

  Options come from class attributes, or from :meth:`zero1_options`, which
  adapters override to read them from the trainer's own config.

  Example::

    >>> import jax, optax
    >>> from flax import nnx
    >>> from nnx_zero1 import ShardedOptimizerMixin, Zero1Optimizer
    >>> class Trainer:
    ...   def __init__(self, model, tx):
    ...     self.optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    >>> class Zero1Trainer(ShardedOptimizerMixin, Trainer):
    ...   zero1_data_axis = "data"
    >>> model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    >>> with jax.set_mesh(jax.make_mesh((1,), ("data",))):
    ...   trainer = Zero1Trainer(model, optax.adam(1e-3))
    >>> isinstance(trainer.optimizer, Zero1Optimizer)
    True

  Attributes:
    zero1_data_axis: the mesh axis (or tuple of axes) the state is split over.
    zero1_strict: raise ``Zero1Error`` when a parameter-shaped leaf cannot be split.
  """

  zero1_data_axis: DataAxis = "data"
  zero1_strict: bool = False

  def __init_subclass__(cls, **kwargs: Any):
    super().__init_subclass__(**kwargs)
    # Show the trainer's own constructor, unless a class before the mixin defines another.
    mro = cls.__mro__
    at = mro.index(ShardedOptimizerMixin)
    own_init = any("__init__" in klass.__dict__ for klass in mro[:at])
    trainer = mro[at + 1]
    cls.__signature__ = None if own_init or trainer is object else inspect.signature(trainer)

  def __init__(self, *args: Any, **kwargs: Any):
    options = self.zero1_options(*args, **kwargs)
    axes = data_axes(options["data_axis"])
    mesh = resolve_mesh(None)
    data_axis_size(mesh, axes)
    route = _Route(mesh=mesh, data_axis=axes, strict=bool(options["strict"]))
    with _routing(type(self), route):
      super().__init__(*args, **kwargs)
    if not route.built:
      raise Zero1Error(
          f"{type(self).__name__}.__init__ built no nnx.Optimizer, so there was nothing to "
          f"make Zero-1; {describe_mesh(mesh)}"
      )

  def zero1_options(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """The Zero-1 options for one construction, given the constructor's arguments.

    Returns ``{"data_axis": ..., "strict": ...}``; by default the class
    attributes. Adapters override this to read the trainer's config.

    Example::

      >>> class Trainer:
      ...   def __init__(self, model, tx, config):
      ...     self.optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
      >>> class Zero1Trainer(ShardedOptimizerMixin, Trainer):
      ...   def zero1_options(self, model, tx, config):
      ...     return {"data_axis": config["data_axis"], "strict": True}
    """
    return {"data_axis": self.zero1_data_axis, "strict": self.zero1_strict}
