"""``ShardedOptimizerMixin``: Zero-1 for trainers that build an ``nnx.Optimizer`` in ``__init__``.

The trainer's own ``__init__`` runs unchanged inside
:func:`nnx_zero1.zero1_optimizers`, so each ``nnx.Optimizer(...)`` it builds (in
this thread) is a ``Zero1Optimizer`` with the same arguments. The state is
created on the Zero-1 layout directly, so no full-size copy of the moments ever
exists, and anything the trainer does next with its optimizer (restore a
checkpoint, re-place the state from its variable metadata) sees that layout.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import jax

from nnx_zero1._src.errors import Zero1Error
from nnx_zero1._src.mesh import current_mesh
from nnx_zero1._src.options import Zero1Options
from nnx_zero1._src.scope import options_scope
from nnx_zero1._src.specs import DataAxis, check_data_axes_on_mesh

__all__ = ["ShardedOptimizerMixin"]


class ShardedOptimizerMixin:
  """Gives a trainer a ``Zero1Optimizer`` without changing its constructor.

  Put it first among the bases: ``class MyZero1Trainer(ShardedOptimizerMixin,
  MyTrainer)``. ``MyTrainer.__init__`` runs inside ``zero1_optimizers(...)``:
  each ``nnx.Optimizer(model, tx, wrt=..., graph=...)`` it makes, wherever that
  call is written, builds ``Zero1Optimizer(model, tx, wrt=..., graph=...,
  data_axis=..., strict=...)`` instead, with its state created directly on the
  Zero-1 layout.

  The mesh is resolved as ``Zero1Optimizer`` does when the optimizer is built:
  the current one (``jax.set_mesh`` or a legacy ``with mesh:``), else the mesh
  the model's parameters live on; a model on one device with no mesh is
  data-parallel size 1 (nothing split; ``zero1_strict`` refuses it).

  ``Zero1Error``, never a silently replicated optimizer: a current mesh without
  the data axis (before the trainer's ``__init__`` starts), any optimizer that
  cannot be made Zero-1, or a trainer that built no ``nnx.Optimizer`` in this
  thread by the end of its ``__init__``. Other threads constructing
  ``nnx.Optimizer`` meanwhile get the plain one.

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

  Args:
    *args: the trainer's constructor arguments, passed to it unchanged.
    **kwargs: the trainer's constructor keyword arguments, passed to it unchanged.

  Raises:
    Zero1Error: (from ``__init__``) a current mesh without the data axis, an
      optimizer that cannot be made Zero-1, or a trainer that built none.

  Attributes:
    zero1_data_axis: the mesh axis (or tuple of axes) the state is split over.
    zero1_strict: ``Zero1Optimizer(strict=...)``.
    zero1_pin_gradients: ``Zero1Optimizer(pin_gradients=...)``.
    zero1_offload_state_to_host: ``Zero1Optimizer(offload_state_to_host=...)``: ``True`` or a fraction.
    zero1_state_dtype: ``Zero1Optimizer(state_dtype=...)``, e.g. ``jnp.bfloat16``.
    zero1_state_rounding: ``Zero1Optimizer(state_rounding=...)``.
    zero1_master_dtype: ``Zero1Optimizer(master_dtype=...)``, for bfloat16 models.
    zero1_params_across_dtype: ``Zero1Optimizer(params_across_dtype=...)``, on a pod with masters.
  """

  # Each default is the record's (a new option is one field of Zero1Options and one line here).
  zero1_data_axis: DataAxis | None = Zero1Options.data_axis  # None: left to zero1_options (Tunix's config)
  zero1_strict: bool = Zero1Options.strict
  zero1_pin_gradients: bool = Zero1Options.pin_gradients
  zero1_offload_state_to_host: bool | float = Zero1Options.offload_state_to_host
  zero1_state_dtype: Any = Zero1Options.state_dtype
  zero1_state_rounding: str = Zero1Options.state_rounding
  zero1_master_dtype: Any = Zero1Options.master_dtype
  zero1_params_across_dtype: Any = Zero1Options.params_across_dtype

  def __init_subclass__(cls, **kwargs: Any):
    super().__init_subclass__(**kwargs)
    # Show the trainer's own constructor, unless a class before the mixin defines another.
    mro = cls.__mro__
    at = mro.index(ShardedOptimizerMixin)
    own_init = any("__init__" in klass.__dict__ for klass in mro[:at])
    trainer = mro[at + 1]
    signature = None if own_init or trainer is object else inspect.signature(trainer)
    cls.__signature__ = signature  # type: ignore[attr-defined]  # the attribute inspect.signature reads

  def __init__(self, *args: Any, **kwargs: Any):
    options = Zero1Options(**self.zero1_options(*args, **kwargs))  # the one check of the options
    for mesh in self._zero1_meshes(*args, **kwargs):
      check_data_axes_on_mesh(mesh, options.data_axis)
    with options_scope(None, options) as built:
      super().__init__(*args, **kwargs)
    if not built:
      raise Zero1Error(
          f"{type(self).__name__}.__init__ built no nnx.Optimizer in this thread, so there was "
          f"nothing to make Zero-1 (data axis {options.data_axis}); build the optimizer in __init__, or use "
          f"Zero1Optimizer directly (docs/custom_loops.md)"
      )

  def zero1_options(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """The Zero-1 options for one construction, given the constructor's arguments.

    By default the class attributes; adapters override this to read the
    trainer's config.

    Args:
      *args: the constructor's arguments, as the trainer receives them.
      **kwargs: the constructor's keyword arguments.

    Returns:
      ``Zero1Optimizer``'s keyword options by name (``{"data_axis": ..., "strict": ...,
      "pin_gradients": ..., "offload_state_to_host": ..., "state_dtype": ..., "state_rounding": ...,
      "master_dtype": ..., "params_across_dtype": ...}``); any left out takes ``Zero1Optimizer``'s
      default. ``data_axis`` ``None`` means ``"data"``.

    Example::

      >>> class Trainer:
      ...   def __init__(self, model, tx, config):
      ...     self.optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
      >>> class Zero1Trainer(ShardedOptimizerMixin, Trainer):
      ...   def zero1_options(self, model, tx, config):
      ...     return {"data_axis": config["data_axis"], "strict": True}
    """
    return {field.name: getattr(self, f"zero1_{field.name}") for field in dataclasses.fields(Zero1Options)}

  def _zero1_meshes(self, *args: Any, **kwargs: Any) -> list[jax.sharding.Mesh]:
    """Meshes the optimizers will be built on, checked for the data axis before
    ``__init__`` starts: the current mesh, if any."""
    current = current_mesh()
    return [] if current is None else [current]
