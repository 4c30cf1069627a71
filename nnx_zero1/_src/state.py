"""The optimizer state, created directly on the Zero-1 layout: no full-size copy ever exists."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax
from flax import nnx
from jax.sharding import NamedSharding

from nnx_zero1._src.compat import to_opt_state
from nnx_zero1._src.layout_plan import Zero1Plan
from nnx_zero1._src.offload import compute_shardings, to_storage
from nnx_zero1._src.placement import place_tree
from nnx_zero1._src.specs import spec_entries

__all__ = ["init_sharded_state", "opt_state_init"]


def opt_state_init(tx: optax.GradientTransformation) -> Callable[[Any], Any]:
  """``param_state -> to_opt_state(tx.init(param_state))``, as ``nnx.Optimizer`` builds its state.

  Use one such function for the abstract state and for the real one: jax
  traces a function once per input type, so ``tx.init`` is traced once.

  Example::

    >>> import jax, jax.numpy as jnp, optax
    >>> jax.eval_shape(opt_state_init(optax.sgd(0.1)), {"w": jnp.ones(2)})
    (EmptyState(), EmptyState())
  """
  return lambda param_state: to_opt_state(tx.init(param_state))


def init_sharded_state(
    tx: optax.GradientTransformation, param_state: Any, plan: Zero1Plan, *, init: Callable | None = None
) -> Any:
  """``to_opt_state(tx.init(param_state))``, created directly on the Zero-1 layout.

  The state is built inside one jit whose output shardings are the plan's, so
  no full-size replicated copy of the moments ever exists. ``init`` is
  :func:`opt_state_init` ``(tx)``; pass the one the plan was made with. Parameter-derived
  ``OptVariable``s record their Zero-1 layout in ``out_sharding`` metadata, so
  code that re-places optimizer state from metadata keeps it.

  Example::

    >>> import jax, optax
    >>> from flax import nnx
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    >>> state = nnx.state(model, nnx.Param)
    >>> from nnx_zero1._src.layout_plan import make_plan
    >>> plan = make_plan(optax.sgd(0.1), nnx.as_pure(state), mesh, ("data",))
    >>> init_sharded_state(optax.sgd(0.1), state, plan)
    (EmptyState(), EmptyState())
  """
  init = opt_state_init(tx) if init is None else init
  abstract = jax.eval_shape(init, param_state)  # no new trace when `init` has traced param_state before
  leaves, treedef = jax.tree.flatten(abstract)
  targets = jax.tree.unflatten(treedef, [leaf.sharding for leaf in plan.state_leaves])
  state = jax.jit(init, out_shardings=targets)(param_state)
  if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(state)):
    # Built under a trace (nnx.eval_shape, inside jit): an inner jit's out_shardings do not
    # reach the traced types, so give them the Zero-1 layout (and memory kind) explicitly.
    state = to_storage(place_tree(state, compute_shardings(plan)), plan)
  variables = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  variables = [v for v in variables if jax.tree.leaves(v)]  # not masked-out (MaskedNode) ones
  for var, leaf in zip(variables, plan.state_leaves, strict=True):
    assert isinstance(leaf.sharding, NamedSharding)  # single-device plans never get here
    if var.has_metadata("out_sharding") or leaf.reason is None:
      var.set_metadata(out_sharding=spec_entries(leaf.sharding.spec))
  return state
