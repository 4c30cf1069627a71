"""Deferred gradient reduction: one gradient collective per optimizer step.

The one implementation in nnx-zero1, used by ``value_and_grad_accumulated``
(custom loops: one ``shard_map`` over a whole step) and by the MaxText-style
engines (one kernel per micro-batch, the partial sums kept in between). Its two
per-replica building blocks are :func:`replica_value_and_grad` (a gradient of a
replica's own rows, no collective) and :func:`reduce_local` (the one collective).

The MaxText-style engines keep their partial sums between kernels in the
per-replica rows of :mod:`nnx_zero1._src.engine.rows`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_zero1._src.errors import Zero1Error, describe_mesh
from nnx_zero1._src.specs import (
    canonical_spec,
    entry_axes,
    padded_entries,
    spec_axes,
    spec_entries,
)

__all__ = [
    "batch_sharding",
    "deferral_blocker",
    "mean_of_sums",
    "reduce_local",
    "replica_value_and_grad",
    "scatter_dim",
    "scatter_dims",
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


def scatter_dim(param_spec: P, target_spec: P, ndim: int, axes: tuple[str, ...]) -> int | None:
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
      scatter_dim(p.spec, t.spec, ndim, axes)
      for ndim, p, t in zip(ndims, param_shardings, targets, strict=True)
  ]
