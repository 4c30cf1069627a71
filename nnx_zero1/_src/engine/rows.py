"""The engines' gradient accumulator: one partial gradient sum per data-parallel replica.

A leading dimension of size N (the data-axis size) sharded over the data axis,
so each replica holds exactly its own row and a micro-batch costs no
collective. Rows sum to the sum, over micro-batches, of the gradient of the
global mean loss. :func:`reduce_rows` turns them into one gradient per
parameter with a single collective per leaf (:func:`nnx_zero1._src.deferred.reduce_local`):
``psum`` (an all-reduce) onto the parameter's layout, or ``psum_scatter`` (a
reduce-scatter) straight onto a layout that adds the data axis to one
dimension, such as the Zero-1 layout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_zero1._src.deferred import reduce_local, replica_value_and_grad, scatter_dim
from nnx_zero1._src.plan import base_sharding
from nnx_zero1._src.specs import axes_entry, data_axis_size, padded_entries, spec_axes

__all__ = [
    "accumulator_sharding",
    "add_to_first_row",
    "local_grads",
    "local_loss",
    "reduce_rows",
    "row_axes",
    "zeros_accumulator",
]


def accumulator_sharding(param_sharding: NamedSharding, ndim: int, axes: tuple[str, ...]) -> NamedSharding:
  """The layout of a parameter's accumulator: a leading replica dimension over the data axes.

  Example::

    >>> import jax
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> accumulator_sharding(NamedSharding(mesh, P()), 2, ("data",)).spec
    P('data', None, None)
  """
  spec = param_sharding.spec
  rows = row_axes(spec, axes)
  leading = axes_entry(rows) if rows else None
  return NamedSharding(param_sharding.mesh, P(leading, *padded_entries(spec, ndim)))


def row_axes(param_spec: P, axes: tuple[str, ...]) -> tuple[str, ...]:
  """The data axes an accumulator's replica dimension is split over: those the parameter
  does not use already (a parameter split over ``data`` cannot be split over it twice).

  Example::

    >>> row_axes(P("data", None), ("replica", "data")), row_axes(P(), ("data",))
    (('replica',), ('data',))
  """
  used = set(spec_axes(param_spec))
  return tuple(a for a in axes if a not in used)


def zeros_accumulator(params: Any, mesh: Mesh, axes: tuple[str, ...]) -> Any:
  """Zeros of shape ``(N, *param.shape)`` for each parameter, one row per replica.

  Example::

    >>> import jax, jax.numpy as jnp
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> zeros_accumulator({"w": jnp.ones(3)}, mesh, ("data",))["w"].shape
    (1, 3)
  """
  n = data_axis_size(mesh, axes)

  def zeros(p):
    sharding = accumulator_sharding(base_sharding(p, mesh), p.ndim, axes)
    return jax.device_put(jnp.zeros((n, *p.shape), p.dtype), sharding)

  return jax.tree.map(zeros, params)


def local_grads(
    loss_of_params: Callable[[Any, Any], jax.Array], params: Any, acc: Any, batch: Any,
    mesh: Mesh, axes: tuple[str, ...],
) -> tuple[jax.Array, Any]:
  """One micro-batch with no gradient collective: each replica adds its own gradient to its row.

  ``loss_of_params(params, batch)`` is the mean loss over the batch it is
  given; it runs per replica (inside ``shard_map``) on that replica's rows, and
  its loss is scaled by 1/N so the rows sum to the gradient of the global mean.
  Parameters must be replicated. Returns the global mean loss (a scalar
  all-reduce) and the new accumulator.

  Example::

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> w = {"w": jax.device_put(jnp.ones(()), NamedSharding(mesh, P()))}
    >>> batch = jax.device_put(jnp.ones(4), NamedSharding(mesh, P("data")))
    >>> acc = zeros_accumulator(w, mesh, ("data",))
    >>> loss, acc = local_grads(lambda p, b: jnp.mean(b * p["w"]), w, acc, batch, mesh, ("data",))
    >>> float(acc["w"][0])
    1.0
  """
  n = data_axis_size(mesh, axes)

  def per_replica(params, acc, batch):
    loss, grads = replica_value_and_grad(loss_of_params, params, batch, n, axes)
    acc = jax.tree.map(lambda a, g: a + g[None], acc, grads)
    return jax.lax.psum(loss, axes), acc

  acc_specs = jax.tree.map(lambda a: P(axes_entry(axes)), acc)
  batch_specs = jax.tree.map(lambda b: P(axes_entry(axes)), batch)
  return jax.shard_map(
      per_replica, mesh=mesh,
      in_specs=(jax.tree.map(lambda p: P(), params), acc_specs, batch_specs),
      out_specs=(P(), acc_specs),
  )(params, acc, batch)


def local_loss(
    loss_of_params: Callable[[Any, Any], jax.Array], params: Any, batch: Any, mesh: Mesh,
    axes: tuple[str, ...],
) -> jax.Array:
  """The global mean loss, each replica computing its own rows' mean (as ``local_grads`` does).

  Example::

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> w = jax.device_put(jnp.ones(()), NamedSharding(mesh, P()))
    >>> batch = jax.device_put(jnp.ones(4), NamedSharding(mesh, P("data")))
    >>> float(local_loss(lambda p, b: jnp.mean(b * p), w, batch, mesh, ("data",)))
    1.0
  """
  n = data_axis_size(mesh, axes)
  batch_specs = jax.tree.map(lambda b: P(axes_entry(axes)), batch)
  return jax.shard_map(
      lambda p, b: jax.lax.psum(loss_of_params(p, b) / n, axes), mesh=mesh,
      in_specs=(jax.tree.map(lambda p: P(), params), batch_specs), out_specs=P(),
  )(params, batch)


def add_to_first_row(
    acc: Any, grads: Any, param_shardings: Sequence[NamedSharding], mesh: Mesh, axes: tuple[str, ...]
) -> Any:
  """Adds already-reduced gradients to replica 0's row (the other rows add zero),
  so the accumulator format and its row sum are the same as with deferral.

  Example::

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> home = NamedSharding(mesh, P())
    >>> acc = zeros_accumulator({"w": jnp.ones(2)}, mesh, ("data",))
    >>> add_to_first_row(acc, {"w": jax.device_put(jnp.ones(2), home)}, [home], mesh, ("data",))["w"].tolist()
    [[1.0, 1.0]]
  """
  leaves, treedef = jax.tree.flatten(grads)
  rows = [row_axes(s.spec, axes) for s in param_shardings]

  def add(a, g, r):
    first = jax.lax.axis_index(r) == 0 if r else True
    g = jnp.where(first, g, jnp.zeros_like(g))
    return a + g[None] if r == axes else a.at[0].add(g)  # the local block holds 1 row, or several

  def per_replica(acc, grads):
    added = [add(a, g, r) for a, g, r in zip(jax.tree.leaves(acc), jax.tree.leaves(grads), rows, strict=True)]
    return jax.tree.unflatten(treedef, added)

  grad_specs = jax.tree.unflatten(treedef, [s.spec for s in param_shardings])
  acc_specs = jax.tree.unflatten(
      treedef,
      [accumulator_sharding(s, g.ndim, axes).spec for g, s in zip(leaves, param_shardings, strict=True)],
  )
  return jax.shard_map(per_replica, mesh=mesh, in_specs=(acc_specs, grad_specs), out_specs=acc_specs)(
      acc, grads
  )


def reduce_rows(
    acc: Any, param_shardings: Sequence[NamedSharding], targets: Sequence[NamedSharding],
    mesh: Mesh, axes: tuple[str, ...],
) -> Any:
  """Sums each accumulator over its replica rows with one collective per leaf.

  A leaf whose target adds the data axes to one dimension of its parameter's
  layout is reduce-scattered onto it (``psum_scatter``, a literal
  ``reduce-scatter`` in the HLO); a leaf whose target is the parameter's own
  layout is all-reduced (``psum``).

  Example::

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> acc = zeros_accumulator({"w": jnp.ones(4)}, mesh, ("data",))
    >>> home = NamedSharding(mesh, P())
    >>> reduce_rows(acc, [home], [NamedSharding(mesh, P("data"))], mesh, ("data",))["w"].sharding.spec
    P('data',)
  """
  leaves, treedef = jax.tree.flatten(acc)
  rows = [row_axes(p.spec, axes) for p in param_shardings]
  dims = [
      scatter_dim(p.spec, t.spec, a.ndim - 1, r)
      for a, p, t, r in zip(leaves, param_shardings, targets, rows, strict=True)
  ]

  def per_replica(*blocks):
    out = []
    for block, dim, r in zip(blocks, dims, rows, strict=True):
      row = block[0] if r == axes else block.sum(0)  # several local rows: only the first is non-zero
      out.append(reduce_local(row, dim, r) if r else row)
    return tuple(out)

  in_specs = tuple(accumulator_sharding(p, a.ndim - 1, axes).spec for a, p in zip(leaves, param_shardings))
  out_specs = tuple(t.spec for t in targets)
  reduced = jax.shard_map(per_replica, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(*leaves)
  return jax.tree.unflatten(treedef, reduced)
