"""Gradient reduction across data-parallel replicas: the one home of every path's collective.

Custom loops (``value_and_grad_accumulated``), the reference ``Engine`` and
MaxText's engine all reduce gradients here (whether they may wait to do so is
:mod:`nnx_zero1._src.deferral`'s question):

- per-replica partial sums travel as *rows*: a leading dimension over the data
  axes (:func:`accumulator_sharding`), one row per replica;
- :func:`reduce_rows` and :func:`reduce_unreduced` reduce them with one
  collective per leaf (:func:`reduce_local`, through one ``shard_map`` wrapper):
  a ``psum_scatter`` (a literal reduce-scatter) straight onto a layout that adds
  the data axes to one dimension (the Zero-1 layout), or a ``psum`` onto the
  parameter's own layout. A leaf the layout rule splits over only some of the
  data axes, or over several dimensions (:data:`Scatter`), takes a
  ``psum_scatter`` per dimension and a ``psum`` over the data axes it is not
  split over;
- :func:`scatter_into` is the same collective inside a micro-batch loop (ZeRO-2):
  each micro-batch's gradient reduce-scattered into an accumulator already on the
  Zero-1 layout, 1/N of the gradient per device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_zero1._src.errors import Zero1Error
from nnx_zero1._src.specs import axes_entry, entry_axes, padded_entries, spec_axes
from nnx_zero1._src.stages import EXACT, Across, all_reduce_by_stages, psum_by_network, scatter_by_stages

__all__ = [
    "Scatter",
    "accumulator_sharding",
    "mean_of_sums",
    "reduce_local",
    "reduce_rows",
    "reduce_unreduced",
    "row_axes",
    "scatter_into",
    "scatter_of",
    "scattered_zeros",
    "scatters_of",
]

Scatter = tuple[tuple[int, tuple[str, ...]], ...]
"""How one leaf's sum reaches its target layout: per dimension the target adds data axes to,
``(dimension, those axes)``, each a ``psum_scatter`` there; the data axes it adds nowhere are
``psum``-ed. ``()``: a ``psum`` over every data axis, onto the parameter's own layout."""


def _scattered(scatter: Scatter) -> tuple[str, ...]:
  return tuple(a for _, over in scatter for a in over)


def reduce_local(
    partial: jax.Array, scatter: Scatter, axes: tuple[str, ...], across: Across = EXACT,
) -> jax.Array:
  """Inside ``shard_map``: sums one partial gradient over the replicas.

  ``scatter`` ``()``: ``psum`` (an all-reduce), the whole sum on every replica.
  Otherwise a ``psum_scatter`` (a literal ``reduce-scatter``) along each of its
  dimensions over the axes it names there, so each replica gets its slice of
  the sum as on the target layout (the Zero-1 layout), then a ``psum`` over the
  data axes the target does not split over (a leaf split over only some of them). Each stage over
  ``across``'s slow axes runs in its dtype.

  Example::

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> f = lambda g: reduce_local(g, ((0, ("data",)),), ("data",))
    >>> jax.shard_map(f, mesh=mesh, in_specs=P(), out_specs=P("data"), check_vma=False)(jnp.ones(4)).tolist()
    [1.0, 1.0, 1.0, 1.0]
  """
  if not scatter:
    return all_reduce_by_stages(partial, axes, across)
  for dim, over in scatter:
    partial = scatter_by_stages(partial, over, dim, across)
  rest = tuple(a for a in axes if a not in _scattered(scatter))
  return psum_by_network(partial, rest, across) if rest else partial


def scattered_zeros(params: Any, scatters: Sequence[Scatter]) -> Any:
  """Inside ``shard_map``: a zero accumulator for :func:`scatter_into`, one replica's block.

  A leaf with a scatter gets its slice on each of its dimensions (varying over
  the axes scattered, as ``psum_scatter``'s result); one without (an all-reduced
  leaf) is whole (invariant, as ``psum``'s).

  Example::

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> f = lambda w, b: scattered_zeros([w, b], [((0, ("data",)),), ()])
    >>> [z.shape for z in jax.shard_map(f, mesh=mesh, in_specs=P(), out_specs=[P("data"), P()])(
    ...     jnp.ones((8, 2)), jnp.ones(3))]
    [(8, 2), (3,)]
  """
  def zeros(p, scatter):
    if not scatter:
      return jax.numpy.zeros_like(p)
    shape = list(p.shape)
    for dim, over in scatter:
      shape[dim] //= jax.lax.axis_size(over)
    block = jax.numpy.zeros(shape, p.dtype)
    return jax.lax.pcast(block, _scattered(scatter), to="varying")

  leaves, treedef = jax.tree.flatten(params)
  return jax.tree.unflatten(treedef, [zeros(p, d) for p, d in zip(leaves, scatters, strict=True)])


def scatter_into(
    acc: Any, grads: Any, scatters: Sequence[Scatter], axes: tuple[str, ...], across: Across = EXACT,
) -> Any:
  """Inside ``shard_map``: adds one micro-batch's per-replica gradients to a sharded accumulator.

  Each leaf is reduced with :func:`reduce_local` (one collective per leaf and
  micro-batch: a reduce-scatter as ``scatters`` says, an all-reduce where its
  scatter is ``()``) and added to this replica's block of ``acc``, so the
  accumulator is never whole on any device (ZeRO-2).

  Args:
    acc: this replica's accumulator blocks (from :func:`scattered_zeros`).
    grads: this replica's whole gradients of the micro-batch.
    scatters: per leaf, how it reaches its target layout (:func:`scatters_of`).
    axes: the data axes.
    across: the slow axes and the dtype their stages run in.

  Returns:
    The new accumulator blocks.

  Example::

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> over = [((0, ("data",)),)]
    >>> f = lambda g: scatter_into(scattered_zeros([g], over), [g], over, ("data",))[0]
    >>> jax.shard_map(f, mesh=mesh, in_specs=P(), out_specs=P("data"), check_vma=False)(jnp.ones(4)).tolist()
    [1.0, 1.0, 1.0, 1.0]
  """
  a_leaves, treedef = jax.tree.flatten(acc)
  g_leaves = treedef.flatten_up_to(grads)  # type: ignore[attr-defined]  # PyTreeDef's stub is not seen
  reduced = [reduce_local(g, d, axes, across) for g, d in zip(g_leaves, scatters, strict=True)]
  # The barrier keeps each collective in its micro-batch: the TPU compiler otherwise moves a
  # reduction that only feeds a loop's running sum out of the loop (sum of reduce-scatters =
  # reduce-scatter of the sum), which brings back a whole accumulator per replica.
  reduced = _barrier(reduced, [frozenset(_scattered(s)) for s in scatters])
  summed = [a + r for a, r in zip(a_leaves, reduced, strict=True)]
  return jax.tree.unflatten(treedef, summed)


def _barrier(values: list, varying: Sequence[frozenset]) -> list:
  """``optimization_barrier`` over ``values``, one per set of axes they vary over (``varying``):
  jax 0.10.2's barrier gives every result the union of its operands' varying axes, which would
  make an all-reduced leaf (invariant) or one split over some data axes vary over all of them."""
  out = list(values)
  for key in dict.fromkeys(varying):
    group = [i for i, k in enumerate(varying) if k == key]
    for i, value in zip(group, jax.lax.optimization_barrier([values[i] for i in group]), strict=True):
      out[i] = value
  return out


def scatter_of(param_spec: P, target_spec: P, ndim: int, axes: tuple[str, ...]) -> Scatter:
  """Where ``target_spec`` adds data axes (some of ``axes``) to ``param_spec``'s entries.

  Raises ``Zero1Error`` when ``target_spec`` is not ``param_spec`` with data axes
  appended to its entries (one collective per dimension could not reach it).

  Example::

    >>> scatter_of(P(None, "tp"), P("data", "tp"), 2, ("replica", "data"))
    ((0, ('data',)),)
    >>> scatter_of(P(), P(), 1, ("data",))
    ()
  """
  out = []
  pairs = zip(padded_entries(param_spec, ndim), padded_entries(target_spec, ndim))
  for dim, (before, after) in enumerate(pairs):
    old, new = entry_axes(before), entry_axes(after)
    if new == old:
      continue
    if new[: len(old)] != old or not set(new[len(old):]) <= set(axes):
      raise Zero1Error(f"cannot reduce-scatter {param_spec} onto {target_spec} over {axes}: the layout "
                       "rule never asks this; report it as a bug of nnx-zero1 with this message")
    out.append((dim, new[len(old):]))
  return tuple(out)


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


def scatters_of(
    ndims: Sequence[int], param_shardings: Sequence[NamedSharding], targets: Sequence[NamedSharding],
    axes: tuple[str, ...],
) -> list[Scatter]:
  """For each parameter, how :func:`reduce_local` reaches its target layout (:func:`scatter_of`;
  ``()``: the target is the parameter's own layout, an all-reduce).

  Example::

    >>> import jax
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> home = NamedSharding(mesh, P())
    >>> scatters_of([2, 1], [home, home], [NamedSharding(mesh, P(None, "data")), home], ("data",))
    [((1, ('data',)),), ()]
  """
  return [
      scatter_of(p.spec, t.spec, ndim, axes)
      for ndim, p, t in zip(ndims, param_shardings, targets, strict=True)
  ]


def row_axes(param_spec: P, axes: tuple[str, ...]) -> tuple[str, ...]:
  """The data axes a parameter's rows are split over: those the parameter does not
  use already (a parameter split over ``data`` cannot be split over it twice).

  Example::

    >>> row_axes(P("data", None), ("replica", "data")), row_axes(P(), ("data",))
    (('replica',), ('data',))
  """
  used = set(spec_axes(param_spec))
  return tuple(a for a in axes if a not in used)


def accumulator_sharding(param_sharding: NamedSharding, ndim: int, axes: tuple[str, ...]) -> NamedSharding:
  """The layout of a parameter's rows: a leading replica dimension over the data axes.

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


def _reduce_each(
    leaves: Sequence[jax.Array], mesh: Any, in_specs: Sequence[P], targets: Sequence[NamedSharding],
    scatters: Sequence[Scatter], axes: Sequence[tuple[str, ...]],
    local: Callable[[jax.Array, tuple], jax.Array], across: Across = EXACT,
) -> list[jax.Array]:
  """The one ``shard_map``: each leaf's local block -> ``local(block, axes)`` -> one collective."""
  def per_replica(*blocks):
    return tuple(
        reduce_local(local(b, a), d, a, across) if a else local(b, a)
        for b, d, a in zip(blocks, scatters, axes, strict=True)
    )

  out_specs = tuple(t.spec for t in targets)
  return list(jax.shard_map(per_replica, mesh=mesh, in_specs=tuple(in_specs), out_specs=out_specs)(*leaves))


def reduce_rows(
    rows: Any, param_shardings: Sequence[NamedSharding], targets: Sequence[NamedSharding],
    mesh: Mesh, axes: tuple[str, ...], across: Across = EXACT,
) -> Any:
  """Sums each leaf's per-replica rows with one collective per leaf.

  A leaf whose target adds the data axes to one dimension of its parameter's
  layout is reduce-scattered onto it (``psum_scatter``, a literal
  ``reduce-scatter`` in the HLO; a target split over only some of them adds a
  ``psum`` over the rest); a leaf whose target is the parameter's own layout is
  all-reduced (``psum``).

  Args:
    rows: per parameter, ``(N, *param.shape)`` on :func:`accumulator_sharding`.
    param_shardings: the parameters' layouts.
    targets: where each reduced gradient goes (its parameter's layout or the Zero-1 one).
    mesh: the mesh.
    axes: the data axes.
    across: the slow axes and the dtype their stages run in (default: all exact).

  Returns:
    The summed gradients, shaped like the parameters, on ``targets``.

  Example::

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> home = NamedSharding(mesh, P())
    >>> rows = {"w": jax.device_put(jnp.ones((1, 4)), NamedSharding(mesh, P("data")))}
    >>> reduce_rows(rows, [home], [NamedSharding(mesh, P("data"))], mesh, ("data",))["w"].sharding.spec
    P('data',)
  """
  leaves, treedef = jax.tree.flatten(rows)
  row_sets = [row_axes(p.spec, axes) for p in param_shardings]
  scatters = [
      scatter_of(p.spec, t.spec, a.ndim - 1, r)
      for a, p, t, r in zip(leaves, param_shardings, targets, row_sets, strict=True)
  ]
  in_specs = [accumulator_sharding(p, a.ndim - 1, axes).spec for a, p in zip(leaves, param_shardings)]
  # One local row, or several of which only the first is non-zero (gradients added already reduced).
  local = lambda block, r: block[0] if r == axes else block.sum(0)
  reduced = _reduce_each(leaves, mesh, in_specs, targets, scatters, row_sets, local, across)
  return jax.tree.unflatten(treedef, reduced)


def reduce_unreduced(grads: Any, targets: Any, axes: tuple[str, ...] = ("data",), *, into: Any = None) -> Any:
  """Reduces gradients a jitted program holds ``unreduced`` over ``axes``, one collective per leaf.

  A parameter tagged ``reduced`` over the data axis (MaxText's engine does so)
  gets an ``unreduced`` gradient: one partial sum per replica, accumulated with
  no collective. Resharding it onto a layout split over the data axis compiles
  to all-reduce + slice on XLA's CPU backend; this gives one reduce-scatter.
  With ``into`` (ZeRO-2 in MaxText's engine) the reduced gradients are added to
  an accumulator already on ``targets`` by :func:`scatter_into`, the collective
  the other ZeRO-2 paths run per micro-batch.

  Args:
    grads: traced gradients whose type is ``unreduced`` over ``axes``.
    targets: a tree of ``NamedSharding`` shaped like ``grads``.
    axes: the data axes.
    into: None, or a tree shaped like ``grads`` on ``targets`` to add the
      reduced gradients to.

  Returns:
    The reduced gradients on ``targets`` (``into`` plus them, when given).

  Example::

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:2])
    >>> w = jax.device_put(jnp.ones(2), NamedSharding(mesh, P()))
    >>> x = jax.device_put(jnp.ones((4, 2)), NamedSharding(mesh, P("data")))
    >>> def grads(w, x):  # a parameter tagged reduced gets an unreduced gradient
    ...   w = jax.sharding.reshard(w, NamedSharding(mesh, P(reduced={"data"})))
    ...   return jax.grad(lambda w: (x @ w).sum())(w)
    >>> step = lambda w, x: reduce_unreduced(grads(w, x), NamedSharding(mesh, P("data")))
    >>> with jax.set_mesh(mesh):
    ...   out = jax.jit(step)(w, x)
    >>> out.sharding.spec, out.tolist()
    (P('data',), [4.0, 4.0])
    >>> add = lambda w, x, acc: reduce_unreduced(grads(w, x), NamedSharding(mesh, P("data")), into=acc)
    >>> with jax.set_mesh(mesh):
    ...   jax.jit(add)(w, x, out).tolist()  # ZeRO-2: a second micro-batch added to the first
    [8.0, 8.0]
  """
  leaves, treedef = jax.tree.flatten(grads)
  target_leaves = treedef.flatten_up_to(targets)  # type: ignore[attr-defined]  # PyTreeDef's stub is not seen
  mesh = target_leaves[0].mesh
  homes = [P(*jax.typeof(g).sharding.spec.partitions) for g in leaves]
  home_shardings = [NamedSharding(mesh, h) for h in homes]
  scatters = scatters_of([g.ndim for g in leaves], home_shardings, target_leaves, axes)
  in_specs = [P(*home, unreduced=set(axes)) for home in homes]
  if into is None:
    every = [axes] * len(leaves)
    reduced = _reduce_each(leaves, mesh, in_specs, target_leaves, scatters, every, lambda x, _: x)
  else:
    acc_specs = [t.spec for t in target_leaves]
    add = lambda acc, g: scatter_into(acc, g, scatters, axes)
    acc = treedef.flatten_up_to(into)  # type: ignore[attr-defined]  # PyTreeDef's stub is not seen
    reduced = jax.shard_map(add, mesh=mesh, in_specs=(acc_specs, in_specs), out_specs=acc_specs)(acc, leaves)
  return jax.tree.unflatten(treedef, reduced)
