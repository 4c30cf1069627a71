"""What ``Zero1Optimizer.__init__`` does: :func:`build_plan`, the one place a plan is built from
the options (every refusal before any state exists), then the state and master copies born on it,
inside one jit each, so no full-size copy of the moments ever exists."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax
from flax import nnx
from jax.sharding import NamedSharding

from nnx_zero1._src.checks import check_params, check_strict
from nnx_zero1._src.compat import Filter, to_opt_state
from nnx_zero1._src.errors import Zero1Error, Zero1Warning, warn_at_user_line
from nnx_zero1._src.gather import gathered_plan
from nnx_zero1._src.layout_plan import (
    Zero1Plan,
    declared_specs,
    make_plan,
    one_device_mesh,
    param_layouts,
    single_device_plan,
)
from nnx_zero1._src.mesh import resolve_mesh, traced, variable_shardings
from nnx_zero1._src.options import Zero1Options
from nnx_zero1._src.placement import move_tree, place_tree
from nnx_zero1._src.specs import check_data_axes_on_mesh, spec_entries
from nnx_zero1._src.storage import DEVICE, compute_shardings, master_shardings, narrowed, storage_plan, store

__all__ = ["build_plan", "init_masters", "init_sharded_state", "opt_state_init"]


def build_plan(
    tx: optax.GradientTransformation, param_state: Any, mesh: jax.sharding.Mesh | None,
    options: Zero1Options, wrt: Filter = nnx.Param,
) -> Zero1Plan:
  """The plan for ``tx`` on ``param_state`` (an ``nnx.State`` of parameters), as ``options`` ask.

  Resolves the mesh (``None``: the current one, else the parameters'; one device and no mesh
  is data-parallel size 1), checks the parameters, lays out every leaf, applies the storage.

  Raises:
    Zero1Error: everything ``Zero1Optimizer`` refuses, before any state exists.

  Example::

    >>> import jax, optax
    >>> from flax import nnx
    >>> params = nnx.state(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), nnx.Param)
    >>> plan = build_plan(optax.adam(1e-3), params, jax.make_mesh((1,), ("data",)), Zero1Options())
    >>> len(plan.state_leaves)
    5
  """
  axes = tuple(options.data_axis)
  params = nnx.as_pure(param_state)
  mesh = resolve_mesh(mesh, params)
  device = None
  if mesh is None:  # one device, no mesh: data-parallel size 1
    device = _device_of(params)
    mesh = one_device_mesh(device, axes)
    if options.strict:
      raise Zero1Error(
          f"strict=True, but the model is on one device ({device}) and no mesh is set: "
          "data-parallel size 1, so Zero-1 would split nothing; build the model and the optimizer "
          "under jax.set_mesh(mesh)"
      )
  check_data_axes_on_mesh(mesh, axes)
  check_params(params, wrt, mesh)
  # Read off the Variables: traced parameters (built under nnx.eval_shape) on Auto axes carry
  # their layout in sharding metadata only. A declared optimizer_sharding is refused here, before
  # flax places even the abstract state by it (with no mesh nothing is placed, as nnx.Optimizer).
  shardings = variable_shardings(param_state, mesh)
  declared = declared_specs(param_state) if device is None else None
  layouts = param_layouts(params, shardings, axes, declared)
  abstract_state = nnx.as_pure(jax.eval_shape(opt_state_init(tx, options.master_dtype), param_state))
  plan = make_plan(tx, params, mesh, axes, abstract_state=abstract_state, param_shardings=shardings,
                   layouts=layouts)
  if device is not None:
    plan = single_device_plan(plan, device)
  if options.strict:
    check_strict(plan)
  plan = gathered_plan(storage_plan(plan, options, params), options.params_across_dtype, params)
  if device is not None:
    _warn_one_device(device)
  return plan


def _device_of(params: Any) -> jax.Device:
  """The one device unplaced parameters sit on (the default device if none is known)."""
  for leaf in jax.tree.leaves(params):
    devices = getattr(getattr(leaf, "sharding", None), "device_set", None)
    if devices:
      return next(iter(devices))
  return jax.devices()[0]


def _warn_one_device(device: jax.Device) -> None:
  """Data-parallel size 1 is legal, but with more devices visible it is most likely a forgotten mesh."""
  if jax.device_count() > 1:
    warn_at_user_line(
        f"Zero1Optimizer: no mesh is set and the model is on one device ({device}) while "
        f"{jax.device_count()} are visible: data-parallel size 1, nothing is split. Build the model and "
        "the optimizer under jax.set_mesh(mesh) (strict=True makes this an error; "
        "warnings.simplefilter('ignore', nnx_zero1.Zero1Warning) silences it where one device is meant).",
        Zero1Warning,
    )


def opt_state_init(tx: optax.GradientTransformation, master_dtype: Any = None) -> Callable[[Any], Any]:
  """``param_state -> to_opt_state(tx.init(param_state))``, as ``nnx.Optimizer`` builds its state.

  With ``master_dtype``, ``tx.init`` sees the parameters cast to it: ``tx``'s state is
  made for the master copies, as a float32 model's would be. Use one such function for
  the abstract state and for the real one: jax traces a function once per input type,
  so ``tx.init`` is traced once.

  Example::

    >>> import jax, jax.numpy as jnp, optax
    >>> jax.eval_shape(opt_state_init(optax.sgd(0.1)), {"w": jnp.ones(2)})
    (EmptyState(), EmptyState())
  """
  if master_dtype is None:
    return lambda param_state: to_opt_state(tx.init(param_state))
  return lambda param_state: to_opt_state(tx.init(optax.tree.cast(param_state, master_dtype)))


def init_sharded_state(tx: optax.GradientTransformation, param_state: Any, plan: Zero1Plan) -> Any:
  """``to_opt_state(tx.init(param_state))``, created directly on the Zero-1 layout, as stored.

  The state is built inside one jit whose output shardings are the plan's (memory
  kind included), narrowed to the stored dtypes, so no full-size replicated copy of
  the moments ever exists. Parameter-derived ``OptVariable``s record their Zero-1
  layout in ``out_sharding`` metadata, so code that re-places optimizer state from
  metadata keeps it.

  Example::

    >>> import jax, optax
    >>> from flax import nnx
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> state = nnx.state(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), nnx.Param)
    >>> plan = build_plan(optax.sgd(0.1), state, mesh, Zero1Options())
    >>> init_sharded_state(optax.sgd(0.1), state, plan)
    (EmptyState(), EmptyState())
  """
  init = opt_state_init(tx, plan.master_dtype)
  stored_init = lambda param_state: narrowed(init(param_state), plan)
  abstract = jax.eval_shape(init, param_state)  # no new trace: `init` has traced param_state before
  targets = jax.tree.unflatten(jax.tree.structure(abstract), [leaf.sharding for leaf in plan.state_leaves])
  state = jax.jit(stored_init, out_shardings=targets)(param_state)
  if traced(state):
    # Built under a trace (nnx.eval_shape, inside jit): an inner jit's out_shardings do not
    # reach the traced types, so give them the Zero-1 layout (and memory kind) explicitly.
    state, _ = store(plan, place_tree(state, compute_shardings(plan)))
  variables = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  variables = [v for v in variables if jax.tree.leaves(v)]  # not masked-out (MaskedNode) ones
  for var, leaf in zip(variables, plan.state_leaves, strict=True):
    assert isinstance(leaf.sharding, NamedSharding)  # single-device plans never get here
    if var.has_metadata("out_sharding") or leaf.reason is None:
      var.set_metadata(out_sharding=spec_entries(leaf.sharding.spec))
  return state


def init_masters(param_state: Any, plan: Zero1Plan) -> Any:
  """The master copies of ``param_state`` (an ``nnx.State`` of parameters), born on the Zero-1 layout.

  One jit casts each parameter to the master dtype with the Zero-1 layout as its
  output sharding (host memory when the state is offloaded): no full-size float32
  copy exists. ``OptVariable``s, carrying the parameters' metadata with the Zero-1
  layout as their ``out_sharding``, as the optimizer state's leaves do.

  Example::

    >>> import jax, jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> model = nnx.Linear(2, 2, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    >>> state = nnx.state(model, nnx.Param)
    >>> plan = build_plan(optax.sgd(0.1), state, jax.make_mesh((1,), ("data",)),
    ...                      Zero1Options(master_dtype=jnp.float32))
    >>> init_masters(state, plan)["kernel"][...].dtype
    dtype('float32')
  """
  storage = master_shardings(plan)
  targets = jax.tree.unflatten(jax.tree.structure(param_state), storage)
  cast = jax.jit(lambda state: optax.tree.cast(state, plan.master_dtype), out_shardings=targets)
  masters = cast(param_state)
  if traced(masters):  # built under a trace
    masters = move_tree(place_tree(masters, master_shardings(plan, DEVICE)), storage)
  masters = to_opt_state(masters)
  variables = jax.tree.leaves(masters, is_leaf=lambda x: isinstance(x, nnx.Variable))
  for var, sharding in zip(variables, storage, strict=True):
    var.set_metadata(out_sharding=spec_entries(sharding.spec))
  return masters



