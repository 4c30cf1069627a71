"""Gradient reduction across data-parallel replicas: the one home of every path's collective.

Custom loops (``value_and_grad_accumulated``), the reference ``Engine`` and
MaxText's engine all reduce gradients here:

- :func:`replica_value_and_grad`: a replica's gradient of its own rows, no collective;
- per-replica partial sums travel as *rows*: a leading dimension over the data
  axes (:func:`accumulator_sharding`), one row per replica;
- :func:`reduce_rows` and :func:`reduce_unreduced` reduce them with one
  collective per leaf (:func:`reduce_local`, through one ``shard_map`` wrapper):
  a ``psum_scatter`` (a literal reduce-scatter) straight onto a layout that adds
  the data axes to one dimension (the Zero-1 layout), or a ``psum`` onto the
  parameter's own layout;
- :func:`scatter_into` is the same collective inside a micro-batch loop (ZeRO-2):
  each micro-batch's gradient reduce-scattered into an accumulator already on the
  Zero-1 layout, 1/N of the gradient per device;
- :func:`defer` decides, once for every path, whether the reduction can wait
  until the optimizer step; :func:`loss_of_params` is how every path calls a
  user's loss (refusing one that changes other model state).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_zero1._src.errors import Zero1Error, describe_mesh
from nnx_zero1._src.specs import (
    axes_entry,
    canonical_spec,
    entry_axes,
    padded_entries,
    spec_axes,
    spec_entries,
)

__all__ = [
    "accumulator_sharding",
    "batch_sharding",
    "defer",
    "deferral_blocker",
    "loss_of_params",
    "mean_of_sums",
    "reduce_local",
    "reduce_rows",
    "reduce_unreduced",
    "replica_value_and_grad",
    "row_axes",
    "scatter_dim",
    "scatter_dims",
    "scatter_into",
    "scattered_zeros",
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


def scattered_zeros(params: Any, dims: Sequence[int | None], axes: tuple[str, ...], n: int) -> Any:
  """Inside ``shard_map``: a zero accumulator for :func:`scatter_into`, one replica's block.

  A leaf with a scatter dimension gets its 1/n slice there (varying over the
  data axes, as ``psum_scatter``'s result); one without (an all-reduced leaf)
  is whole (invariant, as ``psum``'s).

  Example::

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> f = lambda w, b: scattered_zeros([w, b], [0, None], ("data",), 1)
    >>> [z.shape for z in jax.shard_map(f, mesh=mesh, in_specs=P(), out_specs=[P("data"), P()])(
    ...     jnp.ones((8, 2)), jnp.ones(3))]
    [(8, 2), (3,)]
  """
  def zeros(p, dim):
    if dim is None:
      return jax.numpy.zeros_like(p)
    shape = list(p.shape)
    shape[dim] //= n
    block = jax.numpy.zeros(shape, p.dtype)
    return jax.lax.pcast(block, axes, to="varying")

  leaves, treedef = jax.tree.flatten(params)
  return jax.tree.unflatten(treedef, [zeros(p, d) for p, d in zip(leaves, dims, strict=True)])


def scatter_into(acc: Any, grads: Any, dims: Sequence[int | None], axes: tuple[str, ...]) -> Any:
  """Inside ``shard_map``: adds one micro-batch's per-replica gradients to a sharded accumulator.

  Each leaf is reduced with :func:`reduce_local` (one collective per leaf and
  micro-batch: a reduce-scatter onto ``dims``, an all-reduce where ``dims`` is
  None) and added to this replica's block of ``acc``, so the accumulator is
  never whole on any device (ZeRO-2).

  Args:
    acc: this replica's accumulator blocks (from :func:`scattered_zeros`).
    grads: this replica's whole gradients of the micro-batch.
    dims: per leaf, the dimension to scatter along (:func:`scatter_dims`).
    axes: the data axes.

  Returns:
    The new accumulator blocks.

  Example::

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> f = lambda g: scatter_into(scattered_zeros([g], [0], ("data",), 1), [g], [0], ("data",))[0]
    >>> jax.shard_map(f, mesh=mesh, in_specs=P(), out_specs=P("data"), check_vma=False)(jnp.ones(4)).tolist()
    [1.0, 1.0, 1.0, 1.0]
  """
  a_leaves, treedef = jax.tree.flatten(acc)
  g_leaves = treedef.flatten_up_to(grads)  # type: ignore[attr-defined]  # PyTreeDef's stub is not seen
  reduced = [reduce_local(g, d, axes) for g, d in zip(g_leaves, dims, strict=True)]
  # The barrier keeps each collective in its micro-batch: the TPU compiler otherwise moves a
  # reduction that only feeds a loop's running sum out of the loop (sum of reduce-scatters =
  # reduce-scatter of the sum), which brings back a whole accumulator per replica.
  reduced = jax.lax.optimization_barrier(reduced)
  summed = [a + r for a, r in zip(a_leaves, reduced, strict=True)]
  return jax.tree.unflatten(treedef, summed)


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


def defer(
    blocker: str | None, *, requested: bool, strict: bool, mesh: Any, who: str,
    log: logging.Logger | None = None,
) -> bool:
  """The deferral policy of every path: whether gradients stay per replica until the step.

  Args:
    blocker: :func:`deferral_blocker`'s answer for this batch and these parameters.
    requested: the caller's ``defer_reduction``; False reduces every micro-batch.
    strict: raise instead of reducing every micro-batch when deferral was
      requested but cannot apply.
    mesh: the mesh, named in the error.
    who: the caller's name, for the log line.
    log: where to say (at info level) that the reduction is not deferred; None: silent.

  Returns:
    True to defer (one collective per optimizer step), False to reduce every micro-batch.

  Raises:
    Zero1Error: ``strict`` and deferral was requested but ``blocker`` says it cannot apply.

  Example::

    >>> import jax
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> defer(None, requested=True, strict=True, mesh=mesh, who="step")
    True
    >>> defer("a parameter is sharded", requested=True, strict=False, mesh=mesh, who="step")
    False
  """
  if not requested:
    if log is not None:
      log.info("%s: defer_reduction=False; reducing gradients every micro-batch", who)
    return False
  if blocker is None:
    return True
  if strict:
    raise Zero1Error(f"strict: cannot defer the gradient reduction: {blocker}; {describe_mesh(mesh)}")
  if log is not None:
    log.info("%s: cannot defer the gradient reduction (%s); reducing every micro-batch", who, blocker)
  return False


def loss_of_params(loss_fn: Callable[[Any, Any], jax.Array], graphdef: Any, wrt: Any) -> Callable:
  """``loss_fn(model, batch)`` as a function of (``wrt`` arrays, other model state, batch).

  Replicas and micro-batches each run the loss on their own copy of the
  model's other state (batch statistics, RNG counters), so an update to it has
  no single value to keep: such a loss is refused, never silently dropped.

  Args:
    loss_fn: ``loss_fn(model, batch) -> scalar``.
    graphdef: the model's ``nnx.graphdef``.
    wrt: the filter of the trained variables.

  Returns:
    ``f(params, rest, batch) -> scalar``, ``params`` and ``rest`` pure states.

  Raises:
    Zero1Error: (when ``f`` is traced) ``loss_fn`` changed model state other than ``wrt``.

  Example::

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    >>> f = loss_of_params(lambda m, b: jnp.mean(m(b)), graphdef, nnx.Param)
    >>> f(nnx.as_pure(params), nnx.as_pure(rest), jnp.ones((4, 2))).shape
    ()
  """
  def loss(params, rest, batch):
    model = nnx.merge(graphdef, params, rest)
    value = loss_fn(model, batch)
    after = jax.tree.leaves(nnx.as_pure(nnx.state(model, nnx.Not(wrt))))
    before = jax.tree_util.tree_flatten_with_path(rest)[0]
    changed = [jax.tree_util.keystr(p) for (p, x), y in zip(before, after, strict=True) if x is not y]
    if changed:
      raise Zero1Error(
          f"loss_fn updates model state other than the trained parameters ({', '.join(changed[:4])}): "
          "it cannot be carried across replicas and micro-batches; put such modules in eval mode "
          "or pass RNG keys in the batch"
      )
    return value

  return loss


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
    dims: Sequence[int | None], axes: Sequence[tuple[str, ...]],
    local: Callable[[jax.Array, tuple], jax.Array],
) -> list[jax.Array]:
  """The one ``shard_map``: each leaf's local block -> ``local(block, axes)`` -> one collective."""
  def per_replica(*blocks):
    return tuple(
        reduce_local(local(b, a), d, a) if a else local(b, a)
        for b, d, a in zip(blocks, dims, axes, strict=True)
    )

  out_specs = tuple(t.spec for t in targets)
  return list(jax.shard_map(per_replica, mesh=mesh, in_specs=tuple(in_specs), out_specs=out_specs)(*leaves))


def reduce_rows(
    rows: Any, param_shardings: Sequence[NamedSharding], targets: Sequence[NamedSharding],
    mesh: Mesh, axes: tuple[str, ...],
) -> Any:
  """Sums each leaf's per-replica rows with one collective per leaf.

  A leaf whose target adds the data axes to one dimension of its parameter's
  layout is reduce-scattered onto it (``psum_scatter``, a literal
  ``reduce-scatter`` in the HLO); a leaf whose target is the parameter's own
  layout is all-reduced (``psum``).

  Args:
    rows: per parameter, ``(N, *param.shape)`` on :func:`accumulator_sharding`.
    param_shardings: the parameters' layouts.
    targets: where each reduced gradient goes (its parameter's layout or the Zero-1 one).
    mesh: the mesh.
    axes: the data axes.

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
  dims = [
      scatter_dim(p.spec, t.spec, a.ndim - 1, r)
      for a, p, t, r in zip(leaves, param_shardings, targets, row_sets, strict=True)
  ]
  in_specs = [accumulator_sharding(p, a.ndim - 1, axes).spec for a, p in zip(leaves, param_shardings)]
  # One local row, or several of which only the first is non-zero (gradients added already reduced).
  local = lambda block, r: block[0] if r == axes else block.sum(0)  # noqa: E731
  return jax.tree.unflatten(treedef, _reduce_each(leaves, mesh, in_specs, targets, dims, row_sets, local))


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
  dims = scatter_dims([g.ndim for g in leaves], [NamedSharding(mesh, h) for h in homes], target_leaves, axes)
  in_specs = [P(*home, unreduced=set(axes)) for home in homes]
  if into is None:
    reduced = _reduce_each(leaves, mesh, in_specs, target_leaves, dims, [axes] * len(leaves), lambda x, _: x)
  else:
    acc_specs = [t.spec for t in target_leaves]
    add = lambda acc, g: scatter_into(acc, g, dims, axes)  # noqa: E731
    acc = treedef.flatten_up_to(into)  # type: ignore[attr-defined]  # PyTreeDef's stub is not seen
    reduced = jax.shard_map(add, mesh=mesh, in_specs=(acc_specs, in_specs), out_specs=acc_specs)(acc, leaves)
  return jax.tree.unflatten(treedef, reduced)
