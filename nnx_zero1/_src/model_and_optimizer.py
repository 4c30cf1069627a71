"""``Zero1ModelAndOptimizer``: the Zero-1 counterpart of flax's ``nnx.ModelAndOptimizer``.

flax's ``ModelAndOptimizer(model, tx, *, wrt)`` is an ``nnx.Optimizer`` that
holds its model, so ``update(grads)`` takes the gradients alone. This class is
that, with the optimizer state of a ``Zero1Optimizer``: it subclasses both
(``isinstance`` holds for ``nnx.ModelAndOptimizer``, ``Zero1Optimizer`` and
``nnx.Optimizer``), builds its state as ``Zero1Optimizer`` does, and its
inherited ``update(grads)`` hands ``self.model`` to ``Zero1Optimizer.update``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import optax
from flax import nnx

from nnx_zero1._src.optimizer import Zero1Optimizer

__all__ = ["Zero1ModelAndOptimizer"]


class Zero1ModelAndOptimizer(nnx.ModelAndOptimizer, Zero1Optimizer):  # type: ignore[misc]  # update(grads), as flax's
  """``nnx.ModelAndOptimizer`` with its optimizer state split over the data axis (Zero-1).

  Same arguments as ``nnx.ModelAndOptimizer`` plus ``Zero1Optimizer``'s
  ``mesh`` and every option of :class:`Zero1Options`; ``update(grads)``
  updates ``self.model``. Inside ``zero1_optimizers()``, ``nnx.ModelAndOptimizer(...)``
  builds one of these.

  Args:
    model: the model; kept as ``self.model``.
    tx: the optax transformation.
    mesh: as for ``Zero1Optimizer`` (``None``: the current or the parameters' mesh).
    wrt: the variables to optimize (default ``nnx.Param``).
    graph: as for ``Zero1Optimizer``.
    data_axis: the data-parallel mesh axis or axes.
    strict: as for ``Zero1Optimizer``.
    pin_gradients: as for ``Zero1Optimizer``.
    offload_state_to_host: as for ``Zero1Optimizer``.
    state_dtype: as for ``Zero1Optimizer``.
    state_rounding: as for ``Zero1Optimizer``.
    master_dtype: as for ``Zero1Optimizer``.
    params_across_dtype: as for ``Zero1Optimizer``.
    options: as for ``Zero1Optimizer``: every option as one :class:`Zero1Options` record.

  Raises:
    Zero1Error: as ``Zero1Optimizer`` does, before any state exists.

  Example::

    >>> import jax, jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> from nnx_zero1 import Zero1ModelAndOptimizer
    >>> model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    >>> state = Zero1ModelAndOptimizer(model, optax.sgd(0.1), jax.make_mesh((1,), ("data",)))
    >>> _ = state.update(nnx.grad(lambda m: m(jnp.ones((1, 2))).sum())(state.model))
    >>> int(state.step[...]), isinstance(state, nnx.ModelAndOptimizer)
    (1, True)
  """

  @functools.wraps(Zero1Optimizer.__init__)  # type: ignore[misc]  # its arguments, listed once
  def __init__(self, model: Any, tx: optax.GradientTransformation, mesh: jax.sharding.Mesh | None = None,
               **keywords: Any):
    # Zero1Optimizer's construction, not nnx.ModelAndOptimizer's (which would build the full,
    # replicated state first); then what ModelAndOptimizer adds: the model it updates.
    Zero1Optimizer.__init__(self, model, tx, mesh, **keywords)
    self.model = model
