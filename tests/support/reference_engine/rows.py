"""The engine's gradient accumulator: one partial gradient sum per data-parallel replica.

A leading dimension of size N (the data-axis size) sharded over the data axis
(:func:`nnx_zero1._src.reduction.accumulator_sharding`), so each replica holds
exactly its own row and a micro-batch costs no collective. Rows sum to the sum,
over micro-batches, of the gradient of the global mean loss; the engine's update
kernel reduces them once with :func:`nnx_zero1._src.reduction.reduce_rows`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_zero1._src.deferral import replica_value_and_grad
from nnx_zero1._src.mesh import sharding_on_mesh
from nnx_zero1._src.reduction import accumulator_sharding, row_axes, scatter_into, scatters_of
from nnx_zero1._src.specs import axes_entry, data_axis_size

__all__ = [
    "add_to_first_row", "local_grads", "local_loss", "scattered_grads", "zeros_accumulator", "zeros_on",
]


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
    sharding = accumulator_sharding(sharding_on_mesh(p, mesh), p.ndim, axes)
    return jax.device_put(jnp.zeros((n, *p.shape), p.dtype), sharding)

  return jax.tree.map(zeros, params)


def zeros_on(params: Any, targets: Sequence[NamedSharding]) -> Any:
  """ZeRO-2's accumulator: zeros shaped like the parameters, on ``targets`` (the Zero-1 layout).

  Example::

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> zeros_on({"w": jnp.ones(3)}, [NamedSharding(mesh, P("data"))])["w"].sharding.spec
    P('data',)
  """
  leaves, treedef = jax.tree.flatten(params)
  zeros = [jax.device_put(jnp.zeros(p.shape, p.dtype), t) for p, t in zip(leaves, targets, strict=True)]
  return jax.tree.unflatten(treedef, zeros)


def local_grads(
    loss_of_params: Callable[[Any, Any, Any], jax.Array], params: Any, rest: Any, acc: Any, batch: Any,
    mesh: Mesh, axes: tuple[str, ...],
) -> tuple[jax.Array, Any]:
  """One micro-batch with no gradient collective: each replica adds its own gradient to its row.

  ``loss_of_params(params, rest, batch)`` is the mean loss over the batch it is
  given; it runs per replica (inside ``shard_map``, ``rest`` the model's other
  state, passed in replicated) on that replica's rows, and its loss is scaled by
  1/N so the rows sum to the gradient of the global mean. Parameters must be
  replicated. Returns the global mean loss (a scalar all-reduce) and the new
  accumulator.

  Example::

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> w = {"w": jax.device_put(jnp.ones(()), NamedSharding(mesh, P()))}
    >>> batch = jax.device_put(jnp.ones(4), NamedSharding(mesh, P("data")))
    >>> acc = zeros_accumulator(w, mesh, ("data",))
    >>> loss_fn = lambda p, rest, b: jnp.mean(b * p["w"])
    >>> loss, acc = local_grads(loss_fn, w, {}, acc, batch, mesh, ("data",))
    >>> float(acc["w"][0])
    1.0
  """
  acc_specs = jax.tree.map(lambda a: P(axes_entry(axes)), acc)
  add = lambda acc, grads: jax.tree.map(lambda a, g: a + g[None], acc, grads)
  return _per_replica_step(loss_of_params, params, rest, acc, batch, mesh, axes, acc_specs, add)


def _per_replica_step(loss_of_params, params, rest, acc, batch, mesh, axes, acc_specs, add):
  """One ``shard_map``: each replica's gradient of its own rows, added to ``acc`` by ``add``."""
  n = data_axis_size(mesh, axes)

  def per_replica(params, rest, acc, batch):
    local = lambda p, b: loss_of_params(p, rest, b)
    loss, grads = replica_value_and_grad(local, params, batch, n, axes)
    return jax.lax.psum(loss, axes), add(acc, grads)

  batch_specs = jax.tree.map(lambda b: P(axes_entry(axes)), batch)
  return jax.shard_map(
      per_replica, mesh=mesh,
      in_specs=(jax.tree.map(lambda p: P(), (params, rest)) + (acc_specs, batch_specs)),
      out_specs=(P(), acc_specs),
  )(params, rest, acc, batch)


def scattered_grads(
    loss_of_params: Callable[[Any, Any, Any], jax.Array], params: Any, rest: Any, acc: Any, batch: Any,
    mesh: Mesh, axes: tuple[str, ...], targets: Sequence[NamedSharding],
) -> tuple[jax.Array, Any]:
  """ZeRO-2: one micro-batch's per-replica gradients reduce-scattered into ``acc``, which is
  already summed and on ``targets`` (the Zero-1 layout); :func:`scatter_into` does the collective.

  Returns the global mean loss and the new accumulator (parameter-shaped, on ``targets``).

  Example::

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> w = {"w": jax.device_put(jnp.ones(4), NamedSharding(mesh, P()))}
    >>> target = NamedSharding(mesh, P("data"))
    >>> acc = {"w": jax.device_put(jnp.zeros(4), target)}
    >>> batch = jax.device_put(jnp.ones(4), NamedSharding(mesh, P("data")))
    >>> loss_fn = lambda p, rest, b: jnp.mean(b * p["w"].sum())
    >>> loss, acc = scattered_grads(loss_fn, w, {}, acc, batch, mesh, ("data",), [target])
    >>> acc["w"].tolist()
    [1.0, 1.0, 1.0, 1.0]
  """
  homes = [NamedSharding(mesh, P())] * len(targets)  # deferral's condition: replicated parameters
  scatters = scatters_of([p.ndim for p in jax.tree.leaves(params)], homes, targets, axes)
  acc_specs = jax.tree.unflatten(jax.tree.structure(acc), [t.spec for t in targets])
  add = lambda acc, grads: scatter_into(acc, grads, scatters, axes)
  return _per_replica_step(loss_of_params, params, rest, acc, batch, mesh, axes, acc_specs, add)


def local_loss(
    loss_of_params: Callable[[Any, Any, Any], jax.Array], params: Any, rest: Any, batch: Any, mesh: Mesh,
    axes: tuple[str, ...],
) -> jax.Array:
  """The global mean loss, each replica computing its own rows' mean (as ``local_grads`` does).

  Example::

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> w = jax.device_put(jnp.ones(()), NamedSharding(mesh, P()))
    >>> batch = jax.device_put(jnp.ones(4), NamedSharding(mesh, P("data")))
    >>> float(local_loss(lambda p, rest, b: jnp.mean(b * p), w, {}, batch, mesh, ("data",)))
    1.0
  """
  n = data_axis_size(mesh, axes)
  batch_specs = jax.tree.map(lambda b: P(axes_entry(axes)), batch)
  return jax.shard_map(
      lambda p, r, b: jax.lax.psum(loss_of_params(p, r, b) / n, axes), mesh=mesh,
      in_specs=(jax.tree.map(lambda p: P(), (params, rest)) + (batch_specs,)), out_specs=P(),
  )(params, rest, batch)


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
