"""Deferred reduction's policy: whether a path may keep per-replica gradients until the step.

Every path that accumulates gradients (``value_and_grad_accumulated``, the
reference ``Engine``, MaxText's engine) asks the same questions, in one order:

- :func:`batch_sharding`: where a batch leaf goes (the data axes on dimension 0);
- :func:`deferral_blocker`: why this batch and these parameters cannot keep
  per-replica gradients, or None;
- :func:`defer`: the decision (honouring ``defer_reduction`` and ``strict``);
- :func:`replica_value_and_grad`: a replica's gradient of its own rows, with no
  collective (the reduction it defers is :mod:`nnx_zero1._src.reduction`'s);
- :func:`loss_of_params`: how every path calls a user's loss (refusing one that
  changes other model state).
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
from nnx_zero1._src.specs import canonical_spec, entry_axes, padded_entries, spec_axes, spec_entries

__all__ = [
    "batch_sharding", "defer", "deferral_blocker", "loss_of_params", "reduction_axes",
    "replica_value_and_grad",
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
      raise Zero1Error(f"a batch leaf must have a batch dimension, got a scalar; pass scalars to loss_fn "
                       f"some other way (close over them); {describe_mesh(mesh)}")
    entries[0] = entries[0] + tuple(axes)
  # The canonical spelling, so equal layouts share a kernel.
  return NamedSharding(mesh, canonical_spec(entries))


def reduction_axes(batch_shardings: Sequence[NamedSharding], axes: tuple[str, ...]) -> tuple[str, ...]:
  """The axes per-replica gradients are summed over: the axes of more than one device every batch leaf's
  dimension 0 is split over, in their order, when those are ``axes`` (where the state is split) and more;
  else ``axes``.

  A pod's batch is split over ``("replica", "data")`` while Zero-1 may split the state over ``data``
  alone: the gradients are then reduce-scattered over ``data`` and all-reduced over ``replica`` (the
  reduction's bytes on each network are those of one all-reduce), where reducing over ``data`` alone
  would not sum the slices' gradients at all.

  Example::

    >>> import jax
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((2, 1), ("replica", "data"), devices=jax.devices()[:2])
    >>> reduction_axes([NamedSharding(mesh, P(("replica", "data"), None))], ("data",))
    ('replica', 'data')
    >>> reduction_axes([NamedSharding(mesh, P("data"))], ("data",)), reduction_axes([], ("data",))
    (('data',), ('data',))
    >>> reduction_axes([NamedSharding(mesh, P(("replica", "data")))], ("replica",))  # data: one device
    ('replica',)
  """
  # Axes of one device split nothing (Tunix names fsdp on its batches where fsdp may be 1): the
  # program stays the one over ``axes``.
  firsts = {tuple(a for a in entry_axes(padded_entries(s.spec, 1)[0]) if a in axes or s.mesh.shape[a] > 1)
            for s in batch_shardings}
  if len(firsts) == 1:
    (first,) = firsts
    if set(axes) < set(first):
      return first
  return axes


def deferral_blocker(
    batch_shardings: Sequence[NamedSharding], param_shardings: Sequence[NamedSharding], axes: tuple[str, ...]
) -> str | None:
  """Why per-replica gradients cannot be kept for this batch, or None when they can.

  Deferral needs each replica to compute a whole gradient from its own rows:
  the batch split over the data axes only (on dimension 0), and the
  parameters replicated. A mesh axis of size 1 splits nothing: Tunix's models
  name ``fsdp`` and ``tp`` on every kernel, and on a mesh where both are 1 their
  parameters are replicated.

  Example::

    >>> import jax
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((2, 2), ("data", "model"))
    >>> deferral_blocker([NamedSharding(mesh, P(("data", "model")))], [], ("data",))
    "the batch is sharded over ('model',) as well as the data axis"
    >>> one = jax.make_mesh((2, 1), ("data", "model"))
    >>> over_one = NamedSharding(one, P(("data", "model")))
    >>> deferral_blocker([over_one], [NamedSharding(one, P("model"))], ("data",)) is None
    True
  """
  for s in batch_shardings:
    other = tuple(a for a in _splitting(s) if a not in axes)
    if other:
      return f"the batch is sharded over {other} as well as the data axis"
    later = [d for d, e in enumerate(spec_entries(s.spec)) if d and set(entry_axes(e)) & set(axes)]
    if later:
      return f"the batch is split over the data axis on dimension {later[0]}, not dimension 0"
  for s in param_shardings:
    if _splitting(s):
      return f"a parameter is sharded ({s.spec}), so no replica holds whole gradients"
  return None


def _splitting(sharding: NamedSharding) -> tuple[str, ...]:
  """The mesh axes of more than one device that ``sharding`` splits over."""
  return tuple(a for a in spec_axes(sharding.spec) if sharding.mesh.shape[a] > 1)


def replica_value_and_grad(
    loss_of_params: Callable[[Any, Any], jax.Array], params: Any, batch: Any, n: int, axes: tuple[str, ...]
) -> tuple[jax.Array, Any]:
  """Inside ``shard_map``: this replica's share of the global mean loss and its gradient, no collective.

  ``loss_of_params(params, batch)`` is the mean loss over the rows it is given
  (this replica's); it is scaled by 1/n (n replicas of equal rows), so the
  replicas' gradients sum to the gradient of the global mean. The parameters
  enter invariant over the data axes; cast to varying, the transpose does not
  psum their gradients, the very reduction this defers.

  Each gradient is held whole (an optimization barrier per leaf) before it
  joins an accumulator, and joins it as soon as the backward pass has it: a
  barrier over all of them would keep every gradient alive until the last is
  computed, a second copy of the accumulator's bytes (measured on the TPU
  compiler: one micro-batch of a 4.4B bfloat16 model refused at 18.61G, then
  compiled with 5.55 GiB of temporaries).

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
  # One barrier per leaf, so no leaf waits for the others (see above).
  return loss, jax.tree.map(jax.lax.optimization_barrier, grads)


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
    raise Zero1Error(f"strict: cannot defer the gradient reduction: {blocker}; drop strict=True to reduce "
                     f"every micro-batch instead (docs/custom_loops.md); {describe_mesh(mesh)}")
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
