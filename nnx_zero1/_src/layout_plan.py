"""The Zero-1 plan: which optimizer leaves go where, worked out once at construction.

Pure functions of (tx, abstract params, their shardings, mesh, data axis), and
of the layouts the parameters' Variables declare for their optimizer state
(:func:`declared_specs`, the one reader of that metadata). The plan is hashable
so it can live as a static attribute of the optimizer and be read at trace time
without touching any array.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from nnx_zero1._src.compat import optimizer_sharding_of
from nnx_zero1._src.errors import Zero1Error, describe_mesh
from nnx_zero1._src.layout import (
    NOTES,
    Reason,
    declared_layout,
    is_split,
    memory_layout,
    statistic_layout,
    zero1_layout,
)
from nnx_zero1._src.mesh import sharding_on_mesh
from nnx_zero1._src.specs import DataAxis, data_axes, data_axis_size, full_rank_sharding

__all__ = [
    "LeafPlan", "Zero1Plan", "declared_specs", "make_plan", "one_device_mesh", "param_layouts",
    "single_device_plan",
]


@dataclasses.dataclass(frozen=True)
class LeafPlan:
  """Where one optimizer-state leaf lives, and why it is not split if it is not."""

  path: str
  shape: tuple[int, ...]
  dtype: str
  sharding: jax.sharding.Sharding  # a NamedSharding; SingleDeviceSharding in a single-device plan
  reason: Reason | None  # None: split over the data axis (all of them, or see ``note``)
  by_parameter: bool = False  # split already by its parameter's own layout (FSDP): nothing added
  compute_dtype: str | None = None  # stored in ``dtype`` but computed in this (``state_dtype``)
  note: Reason | None = None  # how a split leaf is split: PARTLY_SPLIT or DECLARED (reason is None)


@dataclasses.dataclass(frozen=True)
class Zero1Plan:
  """Layouts for one (tx, params, mesh, data axis): flat, in tree-leaf order."""

  mesh: Mesh
  data_axis: tuple[str, ...]
  param_treedef: Any
  param_shapes: tuple[tuple[int, ...], ...]
  param_shardings: tuple[NamedSharding, ...]  # as the parameters were placed
  zero1_param_shardings: tuple[NamedSharding, ...]
  param_reasons: tuple[Reason | None, ...]  # each parameter's zero1_layout reason (split: ``is_split``)
  state_leaves: tuple[LeafPlan, ...]
  single_device: bool = False  # no mesh, one device: nothing is placed, as nnx.Optimizer
  offload_state: bool = False  # some state leaves in host memory between steps (``_src/storage.py``)
  offload_masters: bool = False  # master copies kept, and in host memory (``offload_state_to_host=True``)
  state_rounding: str | None = None  # how narrowed leaves are cast down; None: no state_dtype
  master_dtype: str | None = None  # float32 master copies of the parameters (``_src/storage.py``)
  # The new parameters' hop between slices or nodes narrowed (``params_across_dtype``, ``_src/gather.py``);
  # None: asked for nothing, or nothing crosses (one slice).
  params_across_dtype: str | None = None


@dataclasses.dataclass(frozen=True)
class _Owner:
  """Which parameter a state leaf belongs to (``index`` None: none), and whether it has its shape."""

  index: int | None
  same_shape: bool = False


def _owners_by_path(abstract_state, param_shapes, treedef) -> list[_Owner]:
  """For each state leaf, matched against the parameters by key path and shape.

  The fallback when optax cannot map the state (``tree_map_params`` runs ``tx.init`` on
  placeholders, which lbfgs's line search cannot take): a state leaf whose path ends
  with a parameter's path (``[0].mu['l1']['kernel']`` ends with ``['l1']['kernel']``;
  the longest such parameter path wins) belongs to that parameter when it has its
  shape, or its shape behind a leading axis (lbfgs's memories). Anything else
  belongs to no parameter.
  """
  index_tree = jax.tree.unflatten(treedef, range(len(param_shapes)))
  flat_indices = jax.tree_util.tree_flatten_with_path(index_tree)[0]
  param_paths = {i: jax.tree_util.keystr(path) for path, i in flat_indices}

  def owner(path, leaf) -> _Owner:
    where, shape = jax.tree_util.keystr(path), tuple(leaf.shape)
    tied = [
        i for i, p in param_paths.items()
        if where.endswith(p) and (shape == param_shapes[i] or shape[1:] == param_shapes[i])
    ]
    if not tied:
      return _Owner(None)
    i = max(tied, key=lambda i: len(param_paths[i]))
    return _Owner(i, shape == param_shapes[i])

  return [owner(path, leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_state)[0]]


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
    return _owners_by_path(abstract_state, param_shapes, treedef)
  return jax.tree.leaves(tagged, is_leaf=lambda x: isinstance(x, _Owner))


def _refuse_unmapped(tx, leaf_plans, mesh, data_axis) -> None:
  """Non-scalar state of which optax could tie none to a parameter would stay whole on
  every replica: a silently replicated optimizer. Refuse it by name."""
  tensors = [r for r in leaf_plans if r.shape]
  unmapped = tensors and all(r.reason == Reason.NOT_PARAM_SHAPED for r in tensors)
  if data_axis_size(mesh, data_axis) > 1 and unmapped:
    name = getattr(tx.init, "__qualname__", type(tx).__name__).split(".<locals>")[0]
    raise Zero1Error(
        f"none of the optimizer state of {name} can be tied to a parameter "
        f"(neither optax.tree_utils.tree_map_params nor matching by tree position and shape "
        f"finds a parameter-shaped leaf among "
        f"{', '.join(r.path for r in tensors[:4])}), so Zero-1 would split nothing; use the transformation "
        f"without the wrapper that reshapes its state (optax.adamw(...), not "
        f"optax.flatten(optax.adamw(...)): an elementwise update is the same leaf by leaf), or nnx.Optimizer "
        f"for it; {describe_mesh(mesh)}"
    )


def declared_specs(variables: Any) -> tuple[PartitionSpec | None, ...]:
  """Each Variable's declared ``optimizer_sharding`` as a spec, in tree-leaf order (None: none declared).

  Read as ``nnx.get_partition_spec`` reads ``out_sharding`` (logical names through the
  logical-axis rules in force and the Variable's own ``sharding_rules``), which is what
  ``nnx.Optimizer`` places the state by.

  Args:
    variables: a pytree of ``nnx.Variable`` s (an ``nnx.State`` of parameters).

  Returns:
    One ``PartitionSpec`` or None per Variable.

  Example::

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> declared_specs({"w": nnx.Param(jnp.ones((2, 4)), optimizer_sharding=(None, "data")),
    ...                 "b": nnx.Param(jnp.ones(4))})
    (None, P(None, 'data'))
  """
  out: list[PartitionSpec | None] = []
  for var in jax.tree.leaves(variables, is_leaf=lambda x: isinstance(x, nnx.Variable)):
    declared = optimizer_sharding_of(var) if isinstance(var, nnx.Variable) else None
    if declared is None:
      out.append(None)
    else:  # a stand-in whose out_sharding is the declared one: placement metadata only, nothing moves
      spec = jax.tree.leaves(nnx.get_partition_spec(var.replace(out_sharding=declared)))[0]
      out.append(PartitionSpec(*spec))
  return tuple(out)


def param_layouts(
    params: Any, param_shardings: Sequence[NamedSharding], data_axis: DataAxis,
    declared: Sequence[PartitionSpec | None] | None = None,
) -> tuple[tuple[NamedSharding, Reason | None], ...]:
  """Each parameter's Zero-1 layout and its reason, in tree-leaf order: the rule's
  (:func:`zero1_layout`), or the one its Variable declares (``declared``) where Zero-1 can honour it
  (:func:`declared_layout`).

  Args:
    params: the parameters, a pytree of arrays (or ``ShapeDtypeStruct`` s).
    param_shardings: their shardings, in tree-leaf order.
    data_axis: the data-parallel mesh axis, or a tuple of axes.
    declared: their declared ``optimizer_sharding`` specs (:func:`declared_specs`); None: none.

  Returns:
    ``(sharding, reason)`` per parameter, as :func:`zero1_layout` returns them.

  Raises:
    Zero1Error: naming the parameter, the declared spec and why it cannot be honoured.

  Example::

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> home = NamedSharding(mesh, P())
    >>> [s.spec for s, _ in param_layouts({"w": jnp.ones((4, 2))}, [home], ("data",), [P(None, "data")])]
    [P(None, 'data')]
  """
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  declared = tuple(declared) if declared is not None else (None,) * len(flat)
  out = []
  for (path, x), sharding, spec in zip(flat, param_shardings, declared, strict=True):
    if spec is None:
      out.append(zero1_layout(tuple(x.shape), sharding, data_axis))
      continue
    try:
      out.append(declared_layout(tuple(x.shape), sharding, spec, data_axis))
    except Zero1Error as e:
      raise Zero1Error(
          f"parameter {jax.tree_util.keystr(path)} declares optimizer_sharding {spec}, which Zero-1 over "
          f"{data_axes(data_axis)} cannot honour: {e}; declare the parameter's own axes first and data axes "
          f"after them, or leave optimizer_sharding out (the layout rule then applies); "
          f"{describe_mesh(sharding.mesh)}"
      ) from None
  return tuple(out)


def make_plan(
    tx: optax.GradientTransformation, params: Any, mesh: Mesh, data_axis: DataAxis, *,
    abstract_state: Any = None, param_shardings: Sequence[NamedSharding] | None = None,
    layouts: Sequence[tuple[NamedSharding, Reason | None]] | None = None,
) -> Zero1Plan:
  """Works out the Zero-1 layout of every leaf of ``tx.init(params)``.

  ``params`` is a pure pytree of arrays (or ``ShapeDtypeStruct``s with a
  ``sharding``). Parameter-shaped state takes its parameter's Zero-1 layout;
  other state that optax tags as per-parameter (adafactor's factored
  statistics) follows it on the dimensions it keeps (:func:`statistic_layout`);
  everything else stays replicated. Masked-out parameters (``MaskedNode``) have
  no state leaves. ``abstract_state`` is ``jax.eval_shape(tx.init, params)`` as
  pure ``ShapeDtypeStruct``s, when the caller has it already (else it is traced here).
  ``param_shardings`` are the parameters' shardings on ``mesh`` in tree-leaf order,
  when the caller knows more than the arrays say (traced parameters' declared specs,
  :func:`~nnx_zero1._src.mesh.variable_shardings`); else :func:`sharding_on_mesh` of each.
  ``layouts`` are the parameters' Zero-1 layouts in the same order when the caller has
  worked them out (:func:`param_layouts`, with the layouts their Variables declare); else
  the rule's (:func:`zero1_layout`) for each.

  Raises:
    Zero1Error: state of which nothing can be tied to a parameter.

  Example::

    >>> import jax, jax.numpy as jnp, optax
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> plan = make_plan(optax.adam(1e-3), {"w": jnp.ones((4, 2))}, mesh, ("data",))
    >>> [leaf.reason for leaf in plan.state_leaves]
    [<Reason.SCALAR: 'scalar'>, None, None]
  """
  leaves, treedef = jax.tree.flatten(params)
  shapes = tuple(tuple(x.shape) for x in leaves)
  if param_shardings is None:
    param_shardings = [sharding_on_mesh(x, mesh) for x in leaves]
  shardings = tuple(param_shardings)
  if layouts is None:
    layouts = param_layouts(params, shardings, data_axis)  # once per parameter
  zero1 = tuple(sharding for sharding, _ in layouts)
  if abstract_state is None:
    abstract_params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    abstract_state = jax.eval_shape(tx.init, abstract_params)
  owners = _owners_of_state_leaves(tx, abstract_state, shapes, treedef)
  replicated = NamedSharding(mesh, PartitionSpec())
  leaf_plans = []
  flat_state = jax.tree_util.tree_flatten_with_path(abstract_state)[0]
  for (path, leaf), owner in zip(flat_state, owners, strict=True):
    shape = tuple(leaf.shape)
    if owner.index is not None and owner.same_shape:
      sharding, reason = layouts[owner.index]
    elif owner.index is not None and shape[1:] == shapes[owner.index]:
      sharding, reason = memory_layout(zero1[owner.index]), layouts[owner.index][1]
    elif owner.index is not None:
      i = owner.index
      sharding, reason = statistic_layout(shape, shapes[i], zero1[i], data_axis)
      if reason is None and layouts[i][1] in NOTES:  # it follows its parameter's layout
        reason = layouts[i][1]
    else:
      sharding, reason = replicated, Reason.SCALAR if not shape else Reason.NOT_PARAM_SHAPED
    by_parameter = reason == Reason.ALREADY_SHARDED
    note = reason if reason in NOTES else None
    reason = None if is_split(reason) else reason
    sharding = full_rank_sharding(sharding, len(shape))
    name = jax.tree_util.keystr(path)
    leaf_plans.append(LeafPlan(name, shape, str(leaf.dtype), sharding, reason, by_parameter, note=note))
  _refuse_unmapped(tx, leaf_plans, mesh, data_axis)
  return Zero1Plan(
      mesh=mesh,
      data_axis=tuple(data_axis),
      param_treedef=treedef,
      param_shapes=shapes,
      param_shardings=shardings,
      zero1_param_shardings=zero1,
      param_reasons=tuple(reason for _, reason in layouts),
      state_leaves=tuple(leaf_plans),
  )



def one_device_mesh(device: jax.Device, data_axis: tuple[str, ...]) -> Mesh:
  """A mesh of one device whose axes are the data axes, each of size 1.

  Example::

    >>> import jax
    >>> dict(one_device_mesh(jax.devices()[0], ("data",)).shape)
    {'data': 1}
  """
  devices = np.array([device], dtype=object).reshape((1,) * len(data_axis))
  return Mesh(devices, data_axis, axis_types=(AxisType.Auto,) * len(data_axis))


def single_device_plan(plan: Zero1Plan, device: jax.Device) -> Zero1Plan:
  """``plan`` for a model on one device with no mesh: every leaf stays where
  ``nnx.Optimizer`` puts it (``SingleDeviceSharding``), and says why.

  Example::

    >>> import jax, jax.numpy as jnp, optax
    >>> device = jax.devices()[0]
    >>> plan = make_plan(optax.sgd(0.1, momentum=0.9), {"w": jnp.ones(4)},
    ...                  one_device_mesh(device, ("data",)), ("data",))
    >>> [str(leaf.reason) for leaf in single_device_plan(plan, device).state_leaves]
    ['data-parallel size 1 (one device, no mesh)']
  """
  here = jax.sharding.SingleDeviceSharding(device)
  on_device = tuple(
      dataclasses.replace(leaf, sharding=here, reason=leaf.reason or Reason.ONE_DEVICE, note=None)
      for leaf in plan.state_leaves
  )
  return dataclasses.replace(plan, state_leaves=on_device, single_device=True)
