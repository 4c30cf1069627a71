"""Extra keyword arguments of ``tx.update`` (``GradientTransformationExtraArgs``).

Optax's line searches take ``value=``, ``grad=`` and ``value_fn=``: arrays and a
function of the parameters. Zero-1 runs ``tx.update`` on parameter slices, on an
Explicit mesh inside ``auto_axes``; these helpers keep the functions out of that
boundary and give ``value_fn`` the parameters as ``nnx.Optimizer`` would.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding

from nnx_zero1._src.placement import place_tree
from nnx_zero1._src.specs import is_explicit

__all__ = ["partition_arrays", "value_fn_at_home"]


def partition_arrays(tree: Any) -> tuple[list, Callable[[list], Any]]:
  """``tree``'s array leaves, and a function that rebuilds ``tree`` from new ones.

  Everything else (``value_fn=`` callables, Python numbers, strings) is kept as it
  is, so it can cross a function boundary that only takes arrays.

  Example::

    >>> import jax.numpy as jnp
    >>> arrays, rebuild = partition_arrays({"value": jnp.ones(()), "value_fn": len})
    >>> len(arrays), rebuild([jnp.zeros(())])["value_fn"] is len
    (1, True)
  """
  leaves, treedef = jax.tree.flatten(tree)
  is_array = [isinstance(x, jax.Array | np.ndarray | np.generic) for x in leaves]

  def rebuild(arrays: list) -> Any:
    it = iter(arrays)
    return jax.tree.unflatten(treedef, [next(it) if a else x for x, a in zip(leaves, is_array)])

  return [x for x, a in zip(leaves, is_array) if a], rebuild


def value_fn_at_home(value_fn: Callable, plan, homes: Sequence[NamedSharding]) -> Callable:
  """``value_fn`` called with the parameters back on ``homes``, their own layout.

  A line search calls ``value_fn(params)`` from inside ``tx.update``, where the
  parameters are Zero-1 slices (and, on an Explicit mesh, the data axis is Auto).
  The returned function gathers them back first, in the Explicit world on an
  Explicit mesh, so the user's function runs exactly as under ``nnx.Optimizer``
  (arrays it closes over keep their sharding types). It is differentiable.

  Example::

    >>> import jax, jax.numpy as jnp, optax
    >>> from nnx_zero1._src.layout_plan import make_plan
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> plan = make_plan(optax.sgd(0.1), {"w": jnp.ones(4)}, mesh, ("data",))
    >>> fn = value_fn_at_home(lambda p: p["w"].sum(), plan, plan.param_shardings)
    >>> float(fn({"w": jnp.ones(4)}))
    4.0
  """
  def at_home(params, *args, **kwargs):
    return value_fn(place_tree(params, homes), *args, **kwargs)

  sliced = jax.tree.unflatten(plan.param_treedef, plan.zero1_param_shardings)

  def wrapped(params, *args, **kwargs):
    if not _inside_auto_axes(plan):
      return at_home(params, *args, **kwargs)
    run = lambda p: at_home(p, *args, **kwargs)
    return jax.sharding.explicit_axes(run, axes=plan.data_axis, in_sharding=(sliced,))(params)

  return wrapped


def _inside_auto_axes(plan) -> bool:
  """True inside ``tx.update`` on an Explicit mesh: the context has the data axes Auto."""
  context = jax.sharding.get_abstract_mesh()
  if context.empty or not is_explicit(plan.mesh, plan.data_axis):
    return False
  types = dict(zip(context.axis_names, context.axis_types))
  return any(is_explicit(plan.mesh, (a,)) and types.get(a) == AxisType.Auto for a in plan.data_axis)
