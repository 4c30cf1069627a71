"""The engine's kernels as module-level functions of a hashable static spec.

Each engine wraps them in ``jax.jit`` with shardings read off its live arrays.
Because the traced function and its static spec compare equal across engines
of one shape, a second engine (a restart, a restore) reuses the compiled code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_zero1._src import deferral, reduction
from nnx_zero1._src.optimizer import mark_zero1_grads
from tests.support.reference_engine import rows

__all__ = ["DEFERRED", "GLOBAL", "SCATTERED", "KernelSpec", "jit_fwd_bwd", "jit_update", "jit_eval"]

DEFERRED = "deferred"  # per-replica partial sums in shard_map; update() reduces once
GLOBAL = "global"  # XLA differentiates the global program and reduces every micro-batch
SCATTERED = "scattered"  # ZeRO-2: a reduce-scatter per micro-batch into a Zero-1-layout accumulator


@dataclasses.dataclass(frozen=True)
class KernelSpec:
  """What the kernels need besides arrays: graph definitions, loss, mesh and layouts.

  Example::

    >>> import jax
    >>> from flax import nnx
    >>> model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> spec = KernelSpec(nnx.graphdef(model), None, print, mesh, ("data",), nnx.Param, (), ())
    >>> hash(spec) == hash(dataclasses.replace(spec))
    True
  """

  model_def: Any
  opt_def: Any
  loss_fn: Callable
  mesh: Mesh
  axes: tuple[str, ...]
  wrt: Any
  homes: tuple[NamedSharding, ...]  # the parameters' layouts
  targets: tuple[NamedSharding, ...]  # where update() puts the reduced gradients
  mode: str = DEFERRED


def _loss_of_params(spec: KernelSpec) -> Callable[[Any, Any, Any], jax.Array]:
  return deferral.loss_of_params(spec.loss_fn, spec.model_def, spec.wrt)


def _fwd_bwd(spec: KernelSpec, params, rest, acc, micro_steps, batch):
  loss_of_params = _loss_of_params(spec)
  if spec.mode == GLOBAL:
    loss, grads = jax.value_and_grad(loss_of_params)(params, rest, batch)
    acc = rows.add_to_first_row(acc, grads, spec.homes, spec.mesh, spec.axes)
  elif spec.mode == SCATTERED:
    loss, acc = rows.scattered_grads(
        loss_of_params, params, rest, acc, batch, spec.mesh, spec.axes, spec.targets
    )
  else:
    loss, acc = rows.local_grads(loss_of_params, params, rest, acc, batch, spec.mesh, spec.axes)
  return loss, acc, micro_steps + 1


def _update(spec: KernelSpec, params, rest, opt_state, acc, micro_steps):
  model = nnx.merge(spec.model_def, params, rest)
  optimizer = nnx.merge(spec.opt_def, opt_state)
  if spec.mode == SCATTERED:  # reduce-scattered micro-batch by micro-batch already
    summed = acc
  else:
    summed = reduction.reduce_rows(acc, spec.homes, spec.targets, spec.mesh, spec.axes)
  grads = reduction.mean_of_sums(summed, micro_steps)
  # The optimizer selects gradients by ``wrt``, so they travel as variables.
  variables = jax.tree.unflatten(jax.tree.structure(nnx.state(model, spec.wrt)), jax.tree.leaves(grads))
  if spec.targets != spec.homes:  # reduce-scattered onto the Zero-1 layout already
    variables = mark_zero1_grads(variables)
  optimizer.update(model, variables)
  zeros = jax.tree.map(jnp.zeros_like, acc)
  new_params = nnx.as_pure(nnx.state(model, spec.wrt))
  return new_params, nnx.as_pure(nnx.state(optimizer)), zeros, jnp.zeros_like(micro_steps), optax.tree.norm(
      grads
  )


def _evaluate(spec: KernelSpec, params, rest, batch):
  loss_of_params = _loss_of_params(spec)
  if spec.mode == GLOBAL:
    return loss_of_params(params, rest, batch)
  return rows.local_loss(loss_of_params, params, rest, batch, spec.mesh, spec.axes)


def shardings_of(tree: Any) -> Any:
  """The sharding of every array in ``tree``, as a tree of the same shape."""
  return jax.tree.map(lambda x: x.sharding, tree)


def jit_fwd_bwd(spec: KernelSpec, params, rest, acc, micro_steps, batch):
  """The micro-batch kernel ``(spec, params, rest, acc, micro_steps, batch) -> (loss, acc, micro_steps)``.

  In/out shardings are those of the arrays given; ``acc`` and ``micro_steps`` are donated.

  Example::

    kernel = jit_fwd_bwd(spec, params, rest, acc, micro_steps, batch)
    loss, acc, micro_steps = kernel(spec, params, rest, acc, micro_steps, batch)
  """
  replicated = NamedSharding(spec.mesh, P())
  return jax.jit(
      _fwd_bwd, static_argnums=0,
      in_shardings=shardings_of((params, rest, acc, micro_steps, batch)),
      out_shardings=(replicated, *shardings_of((acc, micro_steps))),
      donate_argnums=(3, 4),
  )


def jit_update(spec: KernelSpec, params, rest, opt_state, acc, micro_steps):
  """The update kernel ``(spec, params, rest, opt_state, acc, micro_steps) ->
  (params, opt_state, acc, micro_steps, grad_norm)``, on the given arrays' shardings.

  Example::

    kernel = jit_update(spec, params, rest, opt_state, acc, micro_steps)
    params, opt_state, acc, micro_steps, grad_norm = kernel(spec, params, rest, opt_state, acc, micro_steps)
  """
  replicated = NamedSharding(spec.mesh, P())
  return jax.jit(
      _update, static_argnums=0,
      in_shardings=shardings_of((params, rest, opt_state, acc, micro_steps)),
      out_shardings=(*shardings_of((params, opt_state, acc, micro_steps)), replicated),
      donate_argnums=(1, 3, 4, 5),
  )


def jit_eval(spec: KernelSpec, params, rest, batch):
  """The evaluation kernel ``(spec, params, rest, batch) -> mean loss``.

  Example::

    loss = jit_eval(spec, params, rest, batch)(spec, params, rest, batch)
  """
  return jax.jit(
      _evaluate, static_argnums=0, in_shardings=shardings_of((params, rest, batch)),
      out_shardings=NamedSharding(spec.mesh, P()),
  )
