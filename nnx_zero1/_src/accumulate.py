"""``value_and_grad_accumulated``: gradient accumulation with one gradient reduction per step.

In a data-parallel training step that accumulates micro-batches with
``lax.scan``, XLA reduces the gradients across replicas once per micro-batch.
This function computes them per replica instead (``jax.shard_map``): each
replica accumulates the gradients of its own rows over the micro-batches with
no collective, and the sums are reduced once, after the loop, with the
reduction core (:mod:`nnx_zero1._src.reduction`, the one the MaxText-style
engines use): a ``psum_scatter`` (a literal reduce-scatter) straight onto the
Zero-1 layout for a ``Zero1Optimizer``, a ``psum`` (all-reduce) onto the
parameters' own layout for a plain ``nnx.Optimizer``. With
``shard_accumulator=True`` (ZeRO-2) each micro-batch's gradients are
reduce-scattered instead, into an accumulator already on the Zero-1 layout.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_zero1._src import deferral, reduction
from nnx_zero1._src.errors import Zero1Error, describe_mesh
from nnx_zero1._src.mesh import resolve_mesh, variable_shardings
from nnx_zero1._src.optimizer import Zero1Optimizer, mark_zero1_grads
from nnx_zero1._src.placement import current_sharding, place
from nnx_zero1._src.specs import DataAxis, axes_entry, data_axes, data_axis_size
from nnx_zero1._src.stages import across_for

__all__ = ["value_and_grad_accumulated"]

logger = logging.getLogger("nnx_zero1")  # the public package name, which users configure

LossFn = Callable[[Any, Any], jax.Array]  # (model, batch) -> mean loss; the model: any nnx.Module


def value_and_grad_accumulated(
    loss_fn: LossFn,
    model: nnx.Module,
    batch: Any,
    *,
    micro_batches: int,
    optimizer: nnx.Optimizer,
    data_axis: DataAxis | None = None,
    strict: bool | None = None,
    defer_reduction: bool = True,
    shard_accumulator: bool = False,
    across_dtype: Any = None,
) -> tuple[jax.Array, nnx.State]:
  """The mean loss and gradients of ``batch``, accumulated over micro-batches and reduced once.

  Call it inside your own ``nnx.jit`` step in place of ``nnx.value_and_grad``,
  then ``optimizer.update(model, grads)``. ``loss_fn(model, batch)`` is the
  mean loss over the rows of the batch it is given. The result equals
  ``nnx.value_and_grad(loss_fn)(model, batch)`` over the whole batch, with the
  sums taken in another order (equal up to the last bits).

  How: each data-parallel replica runs ``loss_fn`` on its own rows
  (``jax.shard_map``, so the model sees local arrays), ``micro_batches`` at a
  time in a ``lax.scan``, adding the gradients with no collective. After the
  loop each gradient is reduced once: with a ``Zero1Optimizer``, reduce-scattered
  straight onto its Zero-1 layout (``update`` then neither pins nor re-slices
  it); with a plain ``nnx.Optimizer``, all-reduced onto the parameter's layout.

  Micro-batch ``k`` is the ``k``-th of ``micro_batches`` equal slices of every
  replica's rows (the batch leaves' dimension 0, split over the data axes).
  This grouping moves no data between devices; it matters only to a loss that
  is not a mean over rows.

  Preconditions for the deferred reduction: replicated parameters, and every
  batch leaf split over the data axes on dimension 0 only (or not at all).
  Otherwise the gradients are reduced every micro-batch (XLA differentiates
  the global program), logged at info level, or ``Zero1Error`` is raised when
  ``strict`` (default: the optimizer's own ``strict``).

  Only the ``optimizer.wrt`` variables are differentiated. ``loss_fn`` must not
  update other model state (``BatchNorm`` statistics in training mode, RNG
  streams of ``nnx.Dropout``): replicas and micro-batches would each have
  their own copy of it, so this refuses such a model with ``Zero1Error``.
  Pass RNG keys in the batch, or put such modules in eval mode.

  Example::

    >>> import jax, jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> from nnx_zero1 import Zero1Optimizer, value_and_grad_accumulated
    >>> mesh = jax.make_mesh((2,), ("data",))
    >>> with jax.set_mesh(mesh):
    ...   model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    ...   opt = Zero1Optimizer(model, optax.adam(1e-3))
    >>> loss_fn = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)
    >>> @nnx.jit
    ... def train_step(model, opt, batch):
    ...   loss, grads = value_and_grad_accumulated(loss_fn, model, batch, micro_batches=4, optimizer=opt)
    ...   opt.update(model, grads)
    ...   return loss
    >>> batch = {"x": jnp.ones((16, 4)), "y": jnp.zeros((16, 2))}
    >>> with jax.set_mesh(mesh):
    ...   loss = train_step(model, opt, batch)
    >>> int(opt.step[...]), loss.shape
    (1, ())

  Args:
    loss_fn: ``loss_fn(model, batch) -> scalar``, the mean loss over ``batch``.
    model: the NNX model.
    batch: a pytree of arrays whose dimension 0 is the batch (rows).
    micro_batches: how many micro-batches the step accumulates; every replica's
      rows must divide by it.
    optimizer: the ``Zero1Optimizer`` or ``nnx.Optimizer`` that will apply the
      gradients; its ``wrt``, mesh and layout decide what is reduced where.
    data_axis: the mesh axis (or axes) the batch's rows are split over and the
      gradients summed over; it includes the axes a ``Zero1Optimizer`` splits its
      state over and may name more (``("replica", "data")`` for a state split over
      ``data`` only: each gradient is reduce-scattered over ``data`` and its slice
      all-reduced over ``replica``, the bytes of one all-reduce on each network).
      Default: the axes dimension 0 of every batch leaf is split over, where that
      can be seen (concrete arrays, Explicit meshes) and includes the optimizer's
      axes; else the ``Zero1Optimizer``'s, or ``"data"``.
    strict: raise ``Zero1Error`` instead of reducing every micro-batch when the
      reduction cannot be deferred; default: ``optimizer.strict`` (False for
      ``nnx.Optimizer``).
    defer_reduction: False reduces every micro-batch (the global program in a
      ``lax.scan``), e.g. to measure what deferral saves.
    shard_accumulator: ZeRO-2: keep the gradient accumulator on the Zero-1
      layout, 1/N of the gradients per device instead of a whole copy, at the
      price of one reduce-scatter per micro-batch instead of one per step.
      Needs a ``Zero1Optimizer`` and the conditions of the deferred reduction.
      The result equals the deferred one up to the order of the sums.
    across_dtype: a narrower floating dtype (``jnp.bfloat16``), or ``jnp.int8``,
      for the stages of the reduction over the slow axes: every data axis but the
      last one listed (``("replica", "data")``: ``replica``, across TPU slices or
      GPU nodes). What crosses between slices or nodes is then half the bytes of
      float32 gradients, rounded to that dtype; with ``jnp.int8`` a quarter of
      them and one float32 scale per 256 values (1.6% more): a reduce-scatter
      across is an all-to-all of int8 blocks, each peer dequantising and summing
      its chunk in float32 (its own part exact), an all-reduce that and an
      all-gather of the int8 sums. Inside them the sums keep the gradient's
      dtype. Not bit-identical to the exact reduction (``docs/pods.md`` measures
      the loss). Needs a data axis over several mesh axes, the deferred
      reduction, floating gradients and one wider than ``across_dtype``
      (bfloat16 parameters' gradients cross in bfloat16 already); where the slow
      axes have size 1 nothing crosses and nothing is rounded.

  Returns:
    ``(loss, grads)``: the mean loss over the batch (a replicated scalar) and
    the mean gradients as an ``nnx.State`` of the ``wrt`` variables.

  Raises:
    Zero1Error: a batch whose rows do not split into replicas x micro-batches, a
      ``data_axis`` without the ``Zero1Optimizer``'s axes, no mesh for a plain
      ``nnx.Optimizer``, a ``loss_fn`` that updates other model state,
      (``strict``) a reduction that cannot be deferred, or ``shard_accumulator``
      with a plain ``nnx.Optimizer``, ``defer_reduction=False`` or gradients no
      replica can compute whole; ``across_dtype`` that is neither a floating
      dtype nor ``jnp.int8``, with an integer parameter, with one data axis,
      where the reduction cannot be deferred, or where no
      gradient is wider than it (nothing to narrow).
  """
  zero1 = optimizer if isinstance(optimizer, Zero1Optimizer) else None
  if shard_accumulator:
    _check_shard_accumulator(zero1, defer_reduction)
  strict = bool(getattr(optimizer, "strict", False) if strict is None else strict)
  graphdef, params, rest = nnx.split(model, optimizer.wrt, ...)  # type: ignore[misc]  # flax types split as variadic
  pure_params, pure_rest = nnx.as_pure(params), nnx.as_pure(rest)
  mesh = zero1.mesh if zero1 is not None else _plain_mesh(pure_params, batch)
  state_axes = zero1.data_axis if zero1 is not None else data_axes("data")
  if data_axis is None:
    axes = deferral.reduction_axes(_batch_shardings(batch, mesh), state_axes)
  else:
    axes = data_axes(data_axis)
  n = data_axis_size(mesh, axes)
  if zero1 is not None and not set(zero1.data_axis) <= set(axes):
    raise Zero1Error(f"data_axis={axes} does not include the axes the Zero1Optimizer splits its state over, "
                     f"{zero1.data_axis}; pass data_axis= with them, or leave it out; {describe_mesh(mesh)}")
  _check_micro_batches(batch, micro_batches, n, mesh)
  across = across_for(across_dtype, axes, mesh, [x.dtype for x in jax.tree.leaves(pure_params)])
  one_device = zero1 is not None and zero1.zero1_plan.single_device
  if one_device:
    # Data-parallel size 1 (one device, no mesh): the one replica's program on the plan's
    # one-device mesh; nothing to reduce, nothing to split.
    homes = tuple(NamedSharding(mesh, P()) for _ in jax.tree.leaves(pure_params))
  else:
    homes = _homes(params, optimizer, mesh)
  targets = homes if one_device or zero1 is None else zero1.zero1_plan.zero1_param_shardings
  loss_of_params = deferral.loss_of_params(loss_fn, graphdef, optimizer.wrt)
  args = (loss_of_params, pure_params, pure_rest, batch, micro_batches, mesh, axes)

  blocker = deferral.deferral_blocker(_batch_shardings(batch, mesh), homes, axes)
  if across.dtype is not None and (blocker is not None or not defer_reduction):
    why = blocker if blocker is not None else "defer_reduction=False asks for XLA's reduction"
    raise Zero1Error(f"across_dtype={across.dtype.name} narrows the library's own reduction across "
                     f"{sorted(across.axes)}, but {why}; leave across_dtype out; {describe_mesh(mesh)}")
  if shard_accumulator:
    if blocker is not None:
      raise Zero1Error(f"shard_accumulator=True needs each replica's whole gradients, but {blocker}; "
                       f"leave shard_accumulator out; {describe_mesh(mesh)}")
    loss, grads = _scatter_every_micro_batch(*args, homes, targets, across)
    return loss, mark_zero1_grads(_as_state(params, grads))
  if not deferral.defer(blocker, requested=defer_reduction, strict=strict, mesh=mesh,
                         who="value_and_grad_accumulated", log=logger if defer_reduction else None):
    loss, grads = _reduce_each_micro_batch(*args)
    return loss, _as_state(params, grads)
  loss, grads = _reduce_once(*args, homes, targets, across)
  if one_device:  # back on the device the parameters (and nnx.Optimizer's arithmetic) live on
    loss, grads = jax.device_put((loss, grads), jax.sharding.SingleDeviceSharding(mesh.devices.flat[0]))
  state = _as_state(params, grads)
  return loss, mark_zero1_grads(state) if zero1 and not one_device else state


def _check_shard_accumulator(zero1: Zero1Optimizer | None, defer_reduction: bool) -> None:
  if zero1 is None:
    raise Zero1Error(
        "shard_accumulator=True reduce-scatters each micro-batch's gradients onto the optimizer's "
        "Zero-1 layout, which a plain nnx.Optimizer does not have (its state is whole on every "
        "replica, so it needs whole gradients); use Zero1Optimizer"
    )
  if not defer_reduction:
    raise Zero1Error(
        "shard_accumulator=True reduce-scatters every micro-batch's per-replica gradients; "
        "defer_reduction=False asks for the global program instead: pass one or the other"
    )


def _plain_mesh(params: Any, batch: Any) -> Any:
  mesh = resolve_mesh(None, (params, batch), traced_ok=True)
  if mesh is None:
    raise Zero1Error(
        "value_and_grad_accumulated with a plain nnx.Optimizer needs a device mesh: place the model "
        "on one, or call the step under jax.set_mesh(mesh)"
    )
  return mesh


def _check_micro_batches(batch: Any, micro_batches: int, n: int, mesh) -> None:
  if not isinstance(micro_batches, int) or micro_batches < 1:
    raise Zero1Error(f"micro_batches must be a positive int, got {micro_batches!r}; pass e.g. "
                     "micro_batches=8")
  leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
  if not leaves:
    raise Zero1Error("the batch has no arrays; pass a pytree of arrays whose dimension 0 is the batch")
  for path, x in leaves:
    rows = jnp.shape(x)[0] if jnp.ndim(x) else None
    if rows is None or rows % (n * micro_batches):
      raise Zero1Error(
          f"batch leaf {jax.tree_util.keystr(path)} of shape {tuple(jnp.shape(x))} does not split into "
          f"{n} replicas x {micro_batches} micro-batches of equal rows (dimension 0 must divide by "
          f"{n * micro_batches}); pass a batch whose rows divide by it, or fewer micro_batches; "
          f"{describe_mesh(mesh)}"
      )


def _homes(params: nnx.State, optimizer: nnx.Optimizer, mesh) -> tuple[NamedSharding, ...]:
  """The parameters' layouts, as far as they can be seen. Concrete arrays and Explicit meshes
  carry them; on an Auto mesh under jit they come from the Zero1Optimizer's record, or from the
  variables' ``out_sharding`` metadata (``mesh.variable_shardings``, as ``nnx.get_named_sharding``
  reads it); else replicated is assumed (and ``shard_map`` makes them so)."""
  leaves = jax.tree.leaves(nnx.as_pure(params))
  plan = getattr(optimizer, "zero1_plan", None)
  recorded = plan.param_shardings if plan is not None else variable_shardings(params, mesh)
  return tuple(current_sharding(x, s) for x, s in zip(leaves, recorded, strict=True))


def _batch_shardings(batch: Any, mesh) -> list[NamedSharding]:
  """The batch leaves' layouts that can be seen (concrete, or traced on an Explicit mesh)."""
  out = []
  for x in jax.tree.leaves(batch):
    if isinstance(x, jax.core.Tracer):
      sharding = jax.typeof(x).sharding
      if not sharding.mesh.empty:
        out.append(NamedSharding(mesh, sharding.spec))
    elif isinstance(getattr(x, "sharding", None), NamedSharding):
      out.append(x.sharding)
  return out


def _as_state(params: nnx.State, grads: Any) -> nnx.State:
  """Gradient arrays as an ``nnx.State`` of the parameters' variables (what ``update`` selects by ``wrt``)."""
  return jax.tree.unflatten(jax.tree.structure(params), jax.tree.leaves(grads))


def _local_micro_batches(batch: Any, micro_batches: int) -> Any:
  """One replica's rows ``(r, ...)`` as ``(micro_batches, r // micro_batches, ...)``."""
  return jax.tree.map(lambda x: x.reshape(micro_batches, x.shape[0] // micro_batches, *x.shape[1:]), batch)


def _scan_per_replica(
    loss_of_params, params, rest, batch, micro_batches, mesh, axes, *, zeros, add, out_specs
):
  """Per replica (``shard_map``): a scan over its micro-batches, each gradient folded into an
  accumulator by ``add(acc, grads)`` from ``zeros(params)``; returns (mean loss, accumulator on
  ``out_specs``, a tree of specs shaped like ``params``)."""
  n = data_axis_size(mesh, axes)
  data = P(axes_entry(axes))

  def per_replica(params, rest, batch):
    local_loss = lambda p, b: loss_of_params(p, rest, b)

    def micro(carry, micro_batch):
      loss_sum, acc = carry
      loss, grads = deferral.replica_value_and_grad(local_loss, params, micro_batch, n, axes)
      return (loss_sum + loss, add(acc, grads)), None

    start = (jax.lax.pcast(jnp.zeros((), jnp.float32), axes, to="varying"), zeros(params))
    (loss_sum, acc), _ = jax.lax.scan(micro, start, _local_micro_batches(batch, micro_batches))
    return jax.lax.psum(loss_sum, axes) / micro_batches, acc

  replicated = lambda tree: jax.tree.map(lambda x: place(x, NamedSharding(mesh, P())), tree)
  params, rest = replicated(params), replicated(rest)
  batch = jax.tree.map(lambda x: place(x, NamedSharding(mesh, data)), batch)
  return jax.shard_map(
      per_replica, mesh=mesh,
      in_specs=(jax.tree.map(lambda _: P(), (params, rest)) + (jax.tree.map(lambda _: data, batch),)),
      out_specs=(P(), out_specs),
  )(params, rest, batch)


def _mean(sums: Any, micro_batches: int) -> list:
  # A count XLA cannot see through: the mean is computed as the engines compute it.
  count = jax.lax.optimization_barrier(jnp.asarray(micro_batches, jnp.int32))
  return jax.tree.leaves(reduction.mean_of_sums(sums, count))


def _reduce_once(loss_of_params, params, rest, batch, micro_batches, mesh, axes, homes, targets, across):
  """Per replica: a scan over its micro-batches with no collective, into one row per replica;
  then :func:`reduction.reduce_rows`, one collective per leaf, as the engines reduce theirs."""
  varying = lambda x: jax.lax.pcast(x, axes, to="varying")
  loss, rows = _scan_per_replica(
      loss_of_params, params, rest, batch, micro_batches, mesh, axes,
      zeros=lambda p: jax.tree.map(lambda x: varying(jnp.zeros_like(x))[None], p),
      add=lambda acc, g: jax.tree.map(lambda a, x: a + x[None], acc, g),
      out_specs=jax.tree.map(lambda _: P(axes_entry(axes)), params),
  )
  return loss, _mean(reduction.reduce_rows(rows, homes, targets, mesh, axes, across), micro_batches)


def _scatter_every_micro_batch(
    loss_of_params, params, rest, batch, micro_batches, mesh, axes, homes, targets, across
):
  """ZeRO-2: per replica, each micro-batch's gradients reduce-scattered
  (:func:`reduction.scatter_into`) into an accumulator on the Zero-1 layout."""
  leaves = jax.tree.leaves(params)
  scatters = reduction.scatters_of([x.ndim for x in leaves], homes, targets, axes)
  loss, sums = _scan_per_replica(
      loss_of_params, params, rest, batch, micro_batches, mesh, axes,
      zeros=lambda p: reduction.scattered_zeros(p, scatters),
      add=lambda acc, g: reduction.scatter_into(acc, g, scatters, axes, across),
      out_specs=jax.tree.unflatten(jax.tree.structure(params), [t.spec for t in targets]),
  )
  return loss, _mean(sums, micro_batches)


def _global_micro_batches(batch: Any, micro_batches: int, n: int) -> Any:
  """The same grouping as the deferred path, on the global arrays: ``(micro_batches, rows, ...)``."""
  def split(x):
    r = x.shape[0] // (n * micro_batches)
    x = x.reshape(n, micro_batches, r, *x.shape[1:]).swapaxes(0, 1)
    return x.reshape(micro_batches, n * r, *x.shape[3:])

  return jax.tree.map(split, batch)


def _reduce_each_micro_batch(loss_of_params, params, rest, batch, micro_batches, mesh, axes):
  """The global program in a scan: XLA reduces the gradients of every micro-batch."""
  n = data_axis_size(mesh, axes)
  grad_fn = jax.value_and_grad(lambda p, b: loss_of_params(p, rest, b))

  def micro(carry, micro_batch):
    loss_sum, acc = carry
    loss, grads = grad_fn(params, micro_batch)
    return (loss_sum + loss, jax.tree.map(jnp.add, acc, grads)), None

  zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
  (loss_sum, acc), _ = jax.lax.scan(micro, zeros, _global_micro_batches(batch, micro_batches, n))
  return loss_sum / micro_batches, jax.tree.map(lambda g: g / micro_batches, acc)
