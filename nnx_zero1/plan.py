"""The Zero-1 plan: which optimizer leaves go where, worked out once at construction.

Pure functions of (tx, abstract params, their shardings, mesh, data axis). The
plan is hashable so it can live as a static attribute of the optimizer and be
read at trace time without touching any array.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nnx_zero1.layout import ALREADY_SHARDED, SCALAR, zero1_layout

__all__ = ["LeafPlan", "Zero1Plan", "make_plan", "base_sharding"]

NOT_PARAM_SHAPED = "not parameter-shaped"


@dataclasses.dataclass(frozen=True)
class LeafPlan:
  """Where one optimizer-state leaf lives, and why it is not split if it is not."""

  path: str
  shape: tuple[int, ...]
  dtype: str
  sharding: NamedSharding
  reason: str | None  # None: split over the data axis


@dataclasses.dataclass(frozen=True)
class Zero1Plan:
  """Layouts for one (tx, params, mesh, data axis): flat, in tree-leaf order."""

  mesh: Mesh
  data_axis: tuple[str, ...]
  param_treedef: Any
  param_shapes: tuple[tuple[int, ...], ...]
  param_dtypes: tuple[str, ...]
  param_shardings: tuple[NamedSharding, ...]  # as the parameters were placed
  zero1_param_shardings: tuple[NamedSharding, ...]
  state_leaves: tuple[LeafPlan, ...]


def base_sharding(array: Any, mesh: Mesh) -> NamedSharding:
  """The mesh sharding a parameter has now; an unplaced array counts as replicated.

  Example::

    >>> import jax, jax.numpy as jnp
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> base_sharding(jnp.ones(3), mesh).spec
    P()
  """
  sharding = getattr(array, "sharding", None)
  if isinstance(sharding, NamedSharding):
    return NamedSharding(mesh, sharding.spec, memory_kind=sharding.memory_kind)
  return NamedSharding(mesh, PartitionSpec())


FACTORED = -1  # tagged per-parameter by optax, but not the parameter's shape
OTHER = -2


def _param_index_of_state_leaves(tx, abstract_state, param_shapes, treedef) -> list[int]:
  """For each state leaf: the index of its parameter, FACTORED or OTHER."""
  indices = jax.tree.unflatten(treedef, range(len(param_shapes)))
  tagged = optax.tree_utils.tree_map_params(
      tx,
      lambda leaf, i: i if tuple(leaf.shape) == param_shapes[i] else FACTORED,
      abstract_state,
      indices,
      transform_non_params=lambda leaf: OTHER,
  )
  return jax.tree.leaves(tagged)


def make_plan(tx: optax.GradientTransformation, params: Any, mesh: Mesh, data_axis) -> Zero1Plan:
  """Works out the Zero-1 layout of every leaf of ``tx.init(params)``.

  ``params`` is a pure pytree of arrays (or ``ShapeDtypeStruct``s with a
  ``sharding``). Parameter-shaped state takes its parameter's Zero-1 layout;
  other state that optax tags as per-parameter (adafactor's factored
  statistics) is split on its own shape; everything else stays replicated.

  Example::

    >>> import jax, jax.numpy as jnp, optax
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> plan = make_plan(optax.adam(1e-3), {"w": jnp.ones((4, 2))}, mesh, ("data",))
    >>> [leaf.reason for leaf in plan.state_leaves]
    ['scalar', None, None]
  """
  leaves, treedef = jax.tree.flatten(params)
  shapes = tuple(tuple(x.shape) for x in leaves)
  shardings = tuple(base_sharding(x, mesh) for x in leaves)
  zero1 = tuple(zero1_layout(s, sh, data_axis)[0] for s, sh in zip(shapes, shardings))
  abstract_params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  abstract_state = jax.eval_shape(tx.init, abstract_params)
  owners = _param_index_of_state_leaves(tx, abstract_state, shapes, treedef)
  replicated = NamedSharding(mesh, PartitionSpec())
  rows = []
  flat_state = jax.tree_util.tree_flatten_with_path(abstract_state)[0]
  for (path, leaf), owner in zip(flat_state, owners, strict=True):
    shape = tuple(leaf.shape)
    if owner >= 0:
      sharding, reason = zero1_layout(shape, shardings[owner], data_axis)
    elif owner == FACTORED:
      sharding, reason = zero1_layout(shape, replicated, data_axis)
    else:
      sharding, reason = replicated, SCALAR if not shape else NOT_PARAM_SHAPED
    reason = None if reason == ALREADY_SHARDED else reason
    rows.append(LeafPlan(jax.tree_util.keystr(path), shape, str(leaf.dtype), sharding, reason))
  return Zero1Plan(
      mesh=mesh,
      data_axis=tuple(data_axis),
      param_treedef=treedef,
      param_shapes=shapes,
      param_dtypes=tuple(str(x.dtype) for x in leaves),
      param_shardings=shardings,
      zero1_param_shardings=zero1,
      state_leaves=tuple(rows),
  )

