"""Reducing gradients that a jitted program holds ``unreduced`` over the data axis.

MaxText's engine tags the parameters it differentiates ``reduced`` over ``"data"``,
so their gradients come out ``unreduced`` (one partial sum per replica) and
accumulate without a collective. Resharding such a gradient onto a layout split
over ``"data"`` compiles to all-reduce + slice on XLA's CPU backend; ``shard_map``
with ``psum_scatter`` gives one literal reduce-scatter instead.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_zero1._src import deferred

__all__ = ["reduce_scatter_unreduced"]

_DATA = "data"


def reduce_scatter_unreduced(grads: Any, targets: Any) -> Any:
  """Reduces gradients held ``unreduced`` over ``"data"`` with one collective per leaf:
  a reduce-scatter onto a target that adds ``"data"`` to one dimension, an all-reduce
  onto a target that is the gradient's own layout.

  Example::

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:2])
    >>> w = jax.device_put(jnp.ones(2), NamedSharding(mesh, P()))
    >>> x = jax.device_put(jnp.ones((4, 2)), NamedSharding(mesh, P("data")))
    >>> def grads(w, x):  # a parameter tagged reduced gets an unreduced gradient
    ...   w = jax.sharding.reshard(w, NamedSharding(mesh, P(reduced={"data"})))
    ...   return jax.grad(lambda w: (x @ w).sum())(w)
    >>> step = lambda w, x: reduce_scatter_unreduced(grads(w, x), NamedSharding(mesh, P("data")))
    >>> with jax.set_mesh(mesh):
    ...   out = jax.jit(step)(w, x)
    >>> out.sharding.spec, out.tolist()
    (P('data',), [4.0, 4.0])
  """
  leaves, treedef = jax.tree.flatten(grads)
  target_leaves = treedef.flatten_up_to(targets)  # type: ignore[attr-defined]  # PyTreeDef's stub is not seen
  mesh = target_leaves[0].mesh
  homes = [P(*jax.typeof(g).sharding.spec.partitions) for g in leaves]
  dims = deferred.scatter_dims(
      [g.ndim for g in leaves], [NamedSharding(mesh, h) for h in homes], target_leaves, (_DATA,)
  )

  def per_replica(*parts):
    return tuple(deferred.reduce_local(x, dim, (_DATA,)) for x, dim in zip(parts, dims))

  in_specs = tuple(P(*home, unreduced={_DATA}) for home in homes)
  out_specs = tuple(t.spec for t in target_leaves)
  reduced = jax.shard_map(per_replica, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(*leaves)
  return jax.tree.unflatten(treedef, reduced)
