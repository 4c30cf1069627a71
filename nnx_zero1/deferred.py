"""Deferred gradient reduction: one gradient collective per optimizer step.

The one implementation in nnx-zero1, used by ``value_and_grad_accumulated``
(custom loops: one ``shard_map`` over a whole step) and by the MaxText-style
engines (one kernel per micro-batch, the partial sums kept in between). Its two
per-replica building blocks are :func:`replica_value_and_grad` (a gradient of a
replica's own rows, no collective) and :func:`reduce_local` (the one collective).

For engines, the accumulator keeps one partial gradient sum per data-parallel replica: a
leading dimension of size N (the data-axis size) sharded over the data axis,
so each replica holds exactly its own row and a micro-batch costs no
collective. Rows sum to the sum, over micro-batches, of the gradient of the
global mean loss. ``reduce_rows`` turns them into one gradient per parameter
with a single collective per leaf: ``psum`` (an all-reduce) onto the
parameter's layout, or ``psum_scatter`` (a reduce-scatter) straight onto a
layout that adds the data axis to one dimension, such as the Zero-1 layout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_zero1.errors import Zero1Error, describe_mesh
from nnx_zero1.plan import base_sharding
from nnx_zero1.specs import (
    axes_entry,
    canonical_spec,
    data_axis_size,
    entry_axes,
    padded_entries,
    spec_axes,
    spec_entries,
)

__all__ = [
    "accumulator_sharding",
    "mean_of_sums",
    "reduce_local",
    "replica_value_and_grad",
    "scatter_dims",
    "batch_sharding",
    "deferral_blocker",
    "local_grads",
    "local_loss",
    "reduce_rows",
    "add_to_first_row",
    "zeros_accumulator",
]


def batch_sharding(shape: Sequence[int], sharding: Any, mesh: Mesh, axes: tuple[str, ...]) -> NamedSharding:
  """Where one batch leaf goes: its own spec, with the data axes on dimension 0
  unless some dimension already carries one of them (so it is idempotent).

  Example::

    >>> import jax
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> s = batch_sharding((4, 3), None, mesh, ("data",))
    >>> s.spec, batch_sharding((4, 3), s, mesh, ("data",)).spec
    (P('data',), P('data',))
    >>> batch_sharding((4, 3), NamedSharding(mesh, P(("data",), None)), mesh, ("data",)).spec
    P('data',)
  """
  spec = sharding.spec if isinstance(sharding, NamedSharding) else P()
  entries = [entry_axes(e) for e in padded_entries(spec, len(shape))]
  if not set(axes) & set(spec_axes(spec)):
    if not shape:
      raise Zero1Error(f"a batch leaf must have a batch dimension, got a scalar; {describe_mesh(mesh)}")
    entries[0] = entries[0] + tuple(axes)
  # The canonical spelling, so equal layouts share a kernel.
  return NamedSharding(mesh, canonical_spec(entries))


def deferral_blocker(
    batch_shardings: Sequence[NamedSharding], param_shardings: Sequence[NamedSharding], axes: tuple[str, ...]
) -> str | None:
  """Why per-replica gradients cannot be kept for this batch, or None when they can.

  Deferral needs each replica to compute a whole gradient from its own rows:
  the batch split over the data axes only (on dimension 0), and the
  parameters replicated.

  Example::

    >>> import jax
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((1, 1), ("data", "model"))
    >>> deferral_blocker([NamedSharding(mesh, P(("data", "model")))], [], ("data",))
    "the batch is sharded over ('model',) as well as the data axis"
  """
  for s in batch_shardings:
    other = tuple(a for a in spec_axes(s.spec) if a not in axes)
    if other:
      return f"the batch is sharded over {other} as well as the data axis"
    later = [d for d, e in enumerate(spec_entries(s.spec)) if d and set(entry_axes(e)) & set(axes)]
    if later:
      return f"the batch is split over the data axis on dimension {later[0]}, not dimension 0"
  for s in param_shardings:
    if spec_axes(s.spec):
      return f"a parameter is sharded ({s.spec}), so no replica holds whole gradients"
  return None


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


def replica_value_and_grad(
    loss_of_params: Callable[[Any, Any], jax.Array], params: Any, batch: Any, n: int, axes: tuple[str, ...]
) -> tuple[jax.Array, Any]:
  """Inside ``shard_map``: this replica's share of the global mean loss and its gradient, no collective.

  ``loss_of_params(params, batch)`` is the mean loss over the rows it is given
  (this replica's); it is scaled by 1/n (n replicas of equal rows), so the
  replicas' gradients sum to the gradient of the global mean. The parameters
  enter invariant over the data axes; cast to varying, the transpose does not
  psum their gradients, the very reduction this defers.

  Example::

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> f = lambda w, b: replica_value_and_grad(lambda p, x: jnp.mean(x * p), w, b, 1, ("data",))
    >>> batch = jax.device_put(jnp.arange(4.0), NamedSharding(mesh, P("data")))
    >>> loss, g = jax.shard_map(f, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()),
    ...                         check_vma=False)(jnp.ones(()), batch)
    >>> float(loss), float(g)
    (1.5, 1.5)
  """
  params = jax.tree.map(lambda p: jax.lax.pcast(p, axes, to="varying"), params)
  loss, grads = jax.value_and_grad(lambda p: loss_of_params(p, batch) / n)(params)
  # Whole gradients before they join an accumulator: XLA may otherwise fold the accumulator
  # into the backward pass's last scatter-add (a tied embedding's) in one program and not in
  # another, and the engine's kernel and a scan body would then add in different orders.
  return loss, jax.lax.optimization_barrier(grads)


def reduce_local(partial: jax.Array, dim: int | None, axes: tuple[str, ...]) -> jax.Array:
  """Inside ``shard_map``: sums one partial gradient over the replicas with one collective.

  ``dim`` None: ``psum`` (an all-reduce), the whole sum on every replica.
  Otherwise ``psum_scatter`` along ``dim`` (a literal ``reduce-scatter``):
  each replica gets its 1/n slice of the sum, as on a layout that adds the
  data axes to that dimension (the Zero-1 layout).

  Example::

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> f = lambda g: reduce_local(g, 0, ("data",))
    >>> jax.shard_map(f, mesh=mesh, in_specs=P(), out_specs=P("data"), check_vma=False)(jnp.ones(4)).tolist()
    [1.0, 1.0, 1.0, 1.0]
  """
  if dim is None:
    return jax.lax.psum(partial, axes)
  return jax.lax.psum_scatter(partial, axes, scatter_dimension=dim, tiled=True)


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


def _scatter_dim(param_spec: P, target_spec: P, ndim: int, axes: tuple[str, ...]) -> int | None:
  """The dimension where ``target_spec`` adds the data axes to ``param_spec``; None if it does not."""
  pairs = zip(padded_entries(param_spec, ndim), padded_entries(target_spec, ndim))
  for dim, (before, after) in enumerate(pairs):
    if entry_axes(after) == entry_axes(before) + tuple(axes):
      return dim
    if entry_axes(after) != entry_axes(before):
      raise Zero1Error(f"cannot reduce-scatter {param_spec} onto {target_spec} over {axes}")
  return None


def mean_of_sums(sums: Any, count: jax.Array) -> Any:
  """Gradients summed over ``count`` micro-batches -> their mean.

  ``count`` is a traced integer, so XLA keeps a division here instead of
  folding a constant reciprocal into the optimizer's multiply-adds: the
  engines and ``value_and_grad_accumulated`` compute the same bits.

  Example::

    >>> import jax.numpy as jnp
    >>> mean_of_sums({"w": jnp.full(2, 6.0)}, jnp.asarray(3))["w"].tolist()
    [2.0, 2.0]
  """
  return jax.tree.map(lambda g: g / count.astype(g.dtype), sums)


def scatter_dims(
    ndims: Sequence[int], param_shardings: Sequence[NamedSharding], targets: Sequence[NamedSharding],
    axes: tuple[str, ...],
) -> list[int | None]:
  """For each parameter, the dimension :func:`reduce_local` scatters along to reach its target
  layout (None: the target is the parameter's own layout, an all-reduce).

  Example::

    >>> import jax
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> home = NamedSharding(mesh, P())
    >>> scatter_dims([2, 1], [home, home], [NamedSharding(mesh, P(None, "data")), home], ("data",))
    [1, None]
  """
  return [
      _scatter_dim(p.spec, t.spec, ndim, axes)
      for ndim, p, t in zip(ndims, param_shardings, targets, strict=True)
  ]


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
      _scatter_dim(p.spec, t.spec, a.ndim - 1, r)
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
