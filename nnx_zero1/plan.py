"""The Zero-1 plan: which optimizer leaves go where, worked out once at construction.

Pure functions of (tx, abstract params, their shardings, mesh, data axis). The
plan is hashable so it can live as a static attribute of the optimizer and be
read at trace time without touching any array.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import jax
import optax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from nnx_zero1.errors import Zero1Error
from nnx_zero1.layout import ALREADY_SHARDED, SCALAR, data_axis_size, spec_entries, zero1_layout

__all__ = ["LeafPlan", "Zero1Plan", "make_plan", "base_sharding", "memory_layout", "statistic_layout"]

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


NOT_ALIGNED = "statistic over the dimension its parameter is split on"
PARAM_NOT_SPLIT = "statistic of a parameter that is not split"
AMBIGUOUS = "per-parameter statistic whose dimensions match its parameter's in more than one way"


@dataclasses.dataclass(frozen=True)
class _Owner:
  """Which parameter a state leaf belongs to (``index`` None: none), and whether it has its shape."""

  index: int | None
  same_shape: bool = False


def _owners_by_structure(abstract_state, param_shapes, treedef) -> list[_Owner]:
  """For each state leaf, matched against the parameters by tree position and shape.

  The fallback when optax cannot map the state (``tree_map_params`` runs ``tx.init`` on
  placeholders, which lbfgs's line search cannot take): every subtree of the state
  with the parameters' tree structure ties its leaves to the parameter at the same
  position, when a leaf has that parameter's shape or that shape behind a leading
  axis (lbfgs's memories). Anything else belongs to no parameter.
  """
  indices = jax.tree.leaves(jax.tree.unflatten(treedef, range(len(param_shapes))))

  def like_params(node) -> bool:
    return jax.tree.structure(node) == treedef

  def tag(node):
    if not like_params(node):
      return _Owner(None)
    leaves = jax.tree.leaves(node)
    owners = []
    for leaf, i in zip(leaves, indices, strict=True):
      shape = tuple(leaf.shape)
      tied = shape == param_shapes[i] or shape[1:] == param_shapes[i]
      owners.append(_Owner(i if tied else None, shape == param_shapes[i]))
    return owners

  tagged = jax.tree.map(tag, abstract_state, is_leaf=like_params)
  return jax.tree.leaves(tagged, is_leaf=lambda x: isinstance(x, _Owner))


def _owners_of_state_leaves(tx, abstract_state, param_shapes, treedef) -> list[_Owner]:
  """For each state leaf, in tree-leaf order: the parameter optax says it belongs to."""
  indices = jax.tree.unflatten(treedef, range(len(param_shapes)))

  def tag(leaf, i):
    if isinstance(leaf, optax.MaskedNode):  # a masked-out parameter: no leaves to place
      return leaf
    return _Owner(i, tuple(leaf.shape) == param_shapes[i])

  try:
    tagged = optax.tree_utils.tree_map_params(
        tx, tag, abstract_state, indices,
        transform_non_params=lambda leaf: _Owner(None),
        is_leaf=lambda x: isinstance(x, optax.MaskedNode),
    )
  except Exception:  # noqa: BLE001 -- optax's placeholders do not run every init (lbfgs)
    return _owners_by_structure(abstract_state, param_shapes, treedef)
  return jax.tree.leaves(tagged, is_leaf=lambda x: isinstance(x, _Owner))


def _uses(entries, data_axis) -> bool:
  names = {a for e in entries if e is not None for a in ((e,) if isinstance(e, str) else e)}
  return bool(names & set(data_axis))


def _entries(sharding: NamedSharding, rank: int) -> list:
  entries = list(spec_entries(sharding.spec))
  return entries + [None] * (rank - len(entries))


def _as_jit_returns_it(sharding: NamedSharding, rank: int) -> NamedSharding:
  """On an Explicit mesh a jitted step hands arrays back with one spec entry per
  dimension (``P('data', None)``); state born that way does not cost a second
  dispatch-cache entry on the next step."""
  if not any(t == AxisType.Explicit for t in sharding.mesh.axis_types):
    return sharding
  entries = _entries(sharding, rank)
  return NamedSharding(sharding.mesh, PartitionSpec(*entries), memory_kind=sharding.memory_kind)


def statistic_layout(
    shape: tuple[int, ...], param_shape: tuple[int, ...], param_zero1: NamedSharding, data_axis
) -> tuple[NamedSharding, str | None]:
  """Layout of a per-parameter statistic that keeps some of its parameter's dimensions.

  Adafactor's factored second moments drop one dimension of their parameter.
  Each dimension the statistic keeps keeps its entry of the parameter's Zero-1
  spec, so the statistic lines up with the sliced gradient (on an Explicit mesh
  anything else is an illegal sharding). It is split over the data axis only
  if it keeps the dimension that carries it; ``reason`` says why not otherwise.
  If its dimensions match the parameter's in more than one way with different
  layouts (a square matrix), it stays replicated.

  Example::

    >>> import jax
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> zero1 = NamedSharding(mesh, P("data"))
    >>> statistic_layout((16,), (16, 32), zero1, ("data",))[0].spec
    P('data',)
    >>> statistic_layout((32,), (16, 32), zero1, ("data",))[1]
    'statistic over the dimension its parameter is split on'
  """
  mesh = param_zero1.mesh
  replicated = NamedSharding(mesh, PartitionSpec())
  if not shape:  # a per-parameter scalar (NovoGrad's second moment)
    return replicated, SCALAR
  entries = _entries(param_zero1, len(param_shape))
  specs = {
      tuple(entries[k] for k in kept)
      for kept in itertools.combinations(range(len(param_shape)), len(shape))
      if tuple(param_shape[k] for k in kept) == tuple(shape)
  }
  if not specs:
    return replicated, NOT_PARAM_SHAPED
  if len(specs) > 1:
    return replicated, AMBIGUOUS
  kept_entries = list(specs.pop())
  while kept_entries and kept_entries[-1] is None:
    kept_entries.pop()
  sharding = NamedSharding(mesh, PartitionSpec(*kept_entries), memory_kind=param_zero1.memory_kind)
  if _uses(kept_entries, data_axis):
    return sharding, None
  return sharding, NOT_ALIGNED if _uses(entries, data_axis) else PARAM_NOT_SPLIT


def memory_layout(param_layout: tuple[NamedSharding, str | None]) -> NamedSharding:
  """Layout of a stack of parameter-shaped values (lbfgs's memories): a leading axis
  kept whole on every replica, then the parameter's Zero-1 layout.

  ``param_layout`` is :func:`~nnx_zero1.layout.zero1_layout`'s answer for the parameter.

  Example::

    >>> import jax
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> memory_layout((NamedSharding(mesh, P("data")), None)).spec
    P(None, 'data')
  """
  sharding, _ = param_layout
  entries = spec_entries(sharding.spec)
  spec = PartitionSpec(None, *entries) if entries else PartitionSpec()
  return NamedSharding(sharding.mesh, spec, memory_kind=sharding.memory_kind)


def _refuse_unmapped(tx, rows, mesh, data_axis) -> None:
  """Non-scalar state of which optax could tie none to a parameter would stay whole on
  every replica: a silently replicated optimizer. Refuse it by name."""
  tensors = [r for r in rows if r.shape]
  if data_axis_size(mesh, data_axis) > 1 and tensors and all(r.reason == NOT_PARAM_SHAPED for r in tensors):
    name = getattr(tx.init, "__qualname__", type(tx).__name__).split(".<locals>")[0]
    raise Zero1Error(
        f"none of the optimizer state of {name} can be tied to a parameter "
        f"(optax.tree_utils.tree_map_params finds no parameter-shaped leaf among "
        f"{', '.join(r.path for r in tensors[:4])}), so Zero-1 would split nothing; "
        f"mesh axes {tuple(mesh.axis_names)} (shape {dict(mesh.shape)})"
    )


def make_plan(tx: optax.GradientTransformation, params: Any, mesh: Mesh, data_axis) -> Zero1Plan:
  """Works out the Zero-1 layout of every leaf of ``tx.init(params)``.

  ``params`` is a pure pytree of arrays (or ``ShapeDtypeStruct``s with a
  ``sharding``). Parameter-shaped state takes its parameter's Zero-1 layout;
  other state that optax tags as per-parameter (adafactor's factored
  statistics) follows it on the dimensions it keeps (:func:`statistic_layout`);
  everything else stays replicated. Masked-out parameters (``MaskedNode``) have
  no state leaves.

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
  layouts = [zero1_layout(s, sh, data_axis) for s, sh in zip(shapes, shardings)]
  zero1 = tuple(sharding for sharding, _ in layouts)
  abstract_params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  abstract_state = jax.eval_shape(tx.init, abstract_params)
  owners = _owners_of_state_leaves(tx, abstract_state, shapes, treedef)
  replicated = NamedSharding(mesh, PartitionSpec())
  rows = []
  flat_state = jax.tree_util.tree_flatten_with_path(abstract_state)[0]
  for (path, leaf), owner in zip(flat_state, owners, strict=True):
    shape = tuple(leaf.shape)
    if owner.index is not None and owner.same_shape:
      sharding, reason = zero1_layout(shape, shardings[owner.index], data_axis)
    elif owner.index is not None and shape[1:] == shapes[owner.index]:
      sharding, reason = memory_layout(layouts[owner.index]), layouts[owner.index][1]
    elif owner.index is not None:
      i = owner.index
      sharding, reason = statistic_layout(shape, shapes[i], zero1[i], data_axis)
    else:
      sharding, reason = replicated, SCALAR if not shape else NOT_PARAM_SHAPED
    reason = None if reason == ALREADY_SHARDED else reason
    sharding = _as_jit_returns_it(sharding, len(shape))
    rows.append(LeafPlan(jax.tree_util.keystr(path), shape, str(leaf.dtype), sharding, reason))
  _refuse_unmapped(tx, rows, mesh, data_axis)
  return Zero1Plan(
      mesh=mesh,
      data_axis=tuple(data_axis),
      param_treedef=treedef,
      param_shapes=shapes,
      param_shardings=shardings,
      zero1_param_shardings=zero1,
      state_leaves=tuple(rows),
  )

