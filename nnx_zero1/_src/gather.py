"""The new parameters' way home after ``tx``: from the Zero-1 layout back to each parameter's own.

By default that is the compiler's all-gather (:func:`nnx_zero1._src.placement.place_tree`), exact. With
``params_across_dtype`` (a pod, master copies kept) the gather runs in stages instead
(:func:`nnx_zero1._src.stages.gather_by_stages`): over the slow data axes first, in that dtype (``int8``:
blocks with a float32 scale each, a quarter of float32's bytes and the scales), then inside each slice or
node at the model's precision. Every replica, the owner of a block included, gets the same rounded values,
so replicas never diverge; the masters keep the exact ones, and ``tx`` runs on them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nnx_zero1._src.errors import Zero1Error, describe_mesh
from nnx_zero1._src.layout_plan import Zero1Plan
from nnx_zero1._src.placement import place, place_tree
from nnx_zero1._src.reduction import Scatter, scatter_of
from nnx_zero1._src.stages import Across, gather_by_stages, slow_axes

__all__ = ["gather_home", "gathered_plan"]


def gathered_plan(plan: Zero1Plan, dtype: np.dtype | None, params: Any) -> Zero1Plan:
  """``plan`` with the dtype its new parameters cross the slow data axes in (``params_across_dtype``).

  Args:
    plan: a plan whose storage is set (``master_dtype`` checked and kept).
    dtype: the checked ``params_across_dtype`` (None: nothing asked).
    params: the pure parameters (arrays or ``ShapeDtypeStruct``s).

  Returns:
    The plan; unchanged when nothing is asked or nothing crosses (one slice or node: nothing is rounded,
    the update is the one without the option, bit for bit).

  Raises:
    Zero1Error: a floating ``dtype`` no narrower than every parameter (the gather would send the bytes it
      sends without it).

  Example::

    >>> import jax, jax.numpy as jnp, optax
    >>> from nnx_zero1._src.layout_plan import make_plan
    >>> mesh = jax.make_mesh((1, 1), ("replica", "data"))
    >>> plan = make_plan(optax.sgd(0.1), {"w": jnp.ones(8)}, mesh, ("replica", "data"))
    >>> gathered_plan(plan, jnp.dtype(jnp.int8), {"w": jnp.ones(8)}).params_across_dtype is None  # one slice
    True
  """
  if dtype is None:
    return plan
  widths = {np.dtype(x.dtype).name: np.dtype(x.dtype).itemsize for x in jax.tree.leaves(params)}
  if jnp.issubdtype(dtype, jnp.floating) and not any(w > dtype.itemsize for w in widths.values()):
    raise Zero1Error(
        f"params_across_dtype={dtype} narrows wider parameters between slices or nodes; these are "
        f"{', '.join(sorted(widths))} already: leave params_across_dtype out (or use jnp.int8); "
        f"{describe_mesh(plan.mesh)}")
  if not slow_axes(plan.data_axis, plan.mesh):
    return plan
  return dataclasses.replace(plan, params_across_dtype=str(dtype))


def _across(plan: Zero1Plan) -> Across:
  return Across(slow_axes(plan.data_axis, plan.mesh), jnp.dtype(plan.params_across_dtype))


def _crosses(gathers: Scatter, across: Across) -> bool:
  """Whether a leaf's gathers reach over a slow axis (else it stays inside the slice: the exact gather)."""
  return any(a in across.axes for _, over in gathers for a in over)


def gather_home(params: Any, homes: Sequence[Any], plan: Zero1Plan) -> Any:
  """The new parameters, on the Zero-1 layout, back on ``homes``: their own layouts.

  Args:
    params: the pure new parameters (or updates) on ``plan.zero1_param_shardings``, in the model's dtype.
    homes: one ``NamedSharding`` per leaf, where each goes back to.
    plan: the optimizer's plan; ``plan.params_across_dtype`` None: the compiler's all-gather, exact.

  Returns:
    ``params`` on ``homes``. With ``params_across_dtype``, each leaf that gathers over a slow axis is
    all-gathered by :func:`gather_by_stages` in one ``shard_map``: rounded on its hop across, the same
    values on every replica; the others as without it.

  Raises:
    Zero1Error: a home that is not the Zero-1 layout less some data axes (no staged gather reaches it).

  Example::

    >>> import jax, jax.numpy as jnp, optax
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> from nnx_zero1._src.layout_plan import make_plan
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> plan = make_plan(optax.sgd(0.1), {"w": jnp.ones(8)}, mesh, ("data",))
    >>> gather_home({"w": jnp.ones(8)}, [NamedSharding(mesh, P())], plan)["w"].sharding.is_fully_replicated
    True
  """
  if plan.params_across_dtype is None:
    return place_tree(params, homes)
  across = _across(plan)
  leaves, treedef = jax.tree.flatten(params)
  gathers = [_gathers(x.ndim, home, zero1, plan)
             for x, home, zero1 in zip(leaves, homes, plan.zero1_param_shardings, strict=True)]
  staged = [i for i, g in enumerate(gathers) if _crosses(g, across)]
  out = [x if i in staged else place(x, home) for i, (x, home) in enumerate(zip(leaves, homes))]

  def per_replica(*blocks: jax.Array) -> tuple[jax.Array, ...]:
    gathered = []
    for block, i in zip(blocks, staged, strict=True):
      for dim, over in gathers[i]:
        block = gather_by_stages(block, over, dim, across)
      gathered.append(block)
    return tuple(gathered)

  if staged:
    in_specs = tuple(plan.zero1_param_shardings[i].spec for i in staged)
    moved = jax.shard_map(per_replica, mesh=plan.mesh, in_specs=in_specs,
                          out_specs=tuple(homes[i].spec for i in staged))(*(leaves[i] for i in staged))
    for i, x in zip(staged, moved, strict=True):
      out[i] = x
  return jax.tree.unflatten(treedef, out)


def _gathers(ndim: int, home: Any, zero1: Any, plan: Zero1Plan) -> Scatter:
  """Per dimension, the data axes a leaf is gathered over from its Zero-1 layout to ``home``."""
  try:
    return scatter_of(home.spec, zero1.spec, ndim, plan.data_axis)
  except Zero1Error:
    raise Zero1Error(f"params_across_dtype gathers each parameter from its Zero-1 layout {zero1.spec} back "
                     f"to its own, here {home.spec}, which is not that layout less some data axes; leave "
                     f"params_across_dtype out for this model; {describe_mesh(plan.mesh)}") from None
