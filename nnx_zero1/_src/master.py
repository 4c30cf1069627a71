"""Master weights: a float32 copy of every parameter, split over the data axis (``master_dtype``).

For a model whose parameters are bfloat16, ``Zero1Optimizer(..., master_dtype=jnp.float32)``
keeps a float32 copy of each trained parameter on its Zero-1 layout (1/dp per device,
whole for a parameter no dimension of which divides) in the optimizer's ``master_params``,
which checkpoints with the rest of ``nnx.state(opt)``. ``tx`` runs on the master slices
and the float32 gradient slices, as an ``nnx.Optimizer`` on a float32 model would; the
model receives the new masters cast to its dtype, so the all-gather carries bfloat16:
half the bytes of a float32 parameter's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnx_zero1._src.compat import to_opt_state
from nnx_zero1._src.errors import Zero1Error, describe_mesh
from nnx_zero1._src.layout_plan import Zero1Plan
from nnx_zero1._src.offload import DEVICE, HOST
from nnx_zero1._src.placement import move_tree, place_tree
from nnx_zero1._src.precision import as_dtype
from nnx_zero1._src.specs import spec_entries

__all__ = [
    "check_master_dtype", "init_masters", "master_plan", "master_shardings", "masters_to_compute",
    "masters_to_storage", "on_masters", "slices_on_masters", "to_master_dtype", "to_param_dtypes",
    "write_masters",
]


def check_master_dtype(master_dtype: Any, params: Any, mesh: jax.sharding.Mesh) -> np.dtype | None:
  """The master dtype asked for, checked against the parameters before any state exists.

  Args:
    master_dtype: ``None`` (no master copies) or a floating dtype.
    params: the pure parameters (arrays or ``ShapeDtypeStruct``s).
    mesh: for the error messages.

  Returns:
    ``master_dtype`` as a numpy dtype, or None.

  Raises:
    Zero1Error: a dtype that is not floating; a parameter that is not floating or
      is wider than the masters; every parameter already in ``master_dtype``
      (nothing to do).

  Example::

    >>> import jax, jax.numpy as jnp
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> check_master_dtype(jnp.float32, {"w": jnp.ones(2, jnp.bfloat16)}, mesh)
    dtype('float32')
  """
  if master_dtype is None:
    return None
  dtype = as_dtype("master_dtype", master_dtype, "jnp.float32")
  if not jnp.issubdtype(dtype, jnp.floating):
    raise Zero1Error(f"master_dtype={dtype} is not a floating dtype (use jnp.float32); {describe_mesh(mesh)}")
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  for path, x in flat:
    name = jax.tree_util.keystr(path)
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise Zero1Error(
          f"master_dtype={dtype}: parameter {name} is {x.dtype}, not floating; leave it out of wrt "
          f"(master weights are for floating parameters); {describe_mesh(mesh)}"
      )
    if np.dtype(x.dtype).itemsize > dtype.itemsize:
      raise Zero1Error(
          f"master_dtype={dtype} is narrower than parameter {name} ({x.dtype}): the masters would lose "
          f"precision; {describe_mesh(mesh)}"
      )
  if all(np.dtype(x.dtype) == dtype for _, x in flat):
    raise Zero1Error(
        f"master_dtype={dtype}, but every parameter is {dtype} already: master copies would change "
        f"nothing (they are for bfloat16 or float16 models); drop master_dtype; {describe_mesh(mesh)}"
    )
  return dtype


def master_plan(plan: Zero1Plan, master_dtype: np.dtype | None) -> Zero1Plan:
  """``plan`` recording the master dtype (None: no master copies).

  Example::

    >>> import jax, jax.numpy as jnp, optax
    >>> from nnx_zero1._src.layout_plan import make_plan
    >>> plan = make_plan(optax.sgd(0.1), {"w": jnp.ones(4)}, jax.make_mesh((1,), ("data",)), ("data",))
    >>> master_plan(plan, jnp.dtype("float32")).master_dtype
    'float32'
  """
  return plan if master_dtype is None else dataclasses.replace(plan, master_dtype=str(np.dtype(master_dtype)))


def to_master_dtype(tree: Any, dtype: Any) -> Any:
  """Every array of ``tree`` (parameters or gradients, pure or ``nnx.State``) in ``dtype``.

  Example::

    >>> import jax.numpy as jnp
    >>> to_master_dtype({"w": jnp.ones(4, jnp.bfloat16)}, "float32")["w"].dtype
    dtype('float32')
  """
  return jax.tree.map(lambda x: x.astype(dtype), tree)


def to_param_dtypes(masters: Any, params: Any) -> Any:
  """The masters cast to their parameters' dtypes, leaf by leaf (before the all-gather).

  Example::

    >>> import jax.numpy as jnp
    >>> to_param_dtypes([jnp.ones(2)], [jnp.ones(2, jnp.bfloat16)])[0].dtype
    dtype(bfloat16)
  """
  return jax.tree.map(lambda m, p: m.astype(p.dtype), masters, params)


def _storage_shardings(plan: Zero1Plan, kind: str) -> list:
  kind = HOST if plan.offload_state and kind == HOST else DEVICE
  return [s.with_memory_kind(kind) for s in plan.zero1_param_shardings]


def master_shardings(plan: Zero1Plan) -> list:
  """Where each master copy lives between steps: its parameter's Zero-1 layout, in host
  memory when the state is offloaded.

  Example::

    >>> import jax, jax.numpy as jnp, optax
    >>> from nnx_zero1._src.layout_plan import make_plan
    >>> plan = make_plan(optax.sgd(0.1), {"w": jnp.ones(4)}, jax.make_mesh((1,), ("data",)), ("data",))
    >>> from jax.sharding import PartitionSpec as P
    >>> master_shardings(plan)[0].spec == P("data")
    True
  """
  return _storage_shardings(plan, HOST)


def init_masters(param_state: Any, plan: Zero1Plan) -> Any:
  """The master copies of ``param_state`` (an ``nnx.State`` of parameters), born on the Zero-1 layout.

  One jit casts each parameter to the master dtype with the Zero-1 layout as its
  output sharding (host memory when the state is offloaded): no full-size float32
  copy exists. ``OptVariable``s, carrying the parameters' metadata with the Zero-1
  layout as their ``out_sharding``, as the optimizer state's leaves do.
  """
  storage = master_shardings(plan)
  targets = jax.tree.unflatten(jax.tree.structure(param_state), storage)
  cast = lambda state: to_master_dtype(state, plan.master_dtype)
  masters = jax.jit(cast, out_shardings=targets)(param_state)
  if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(masters)):  # built under a trace
    masters = move_tree(place_tree(masters, _storage_shardings(plan, DEVICE)), storage)
  masters = to_opt_state(masters)
  variables = jax.tree.leaves(masters, is_leaf=lambda x: isinstance(x, nnx.Variable))
  for var, sharding in zip(variables, storage, strict=True):
    var.set_metadata(out_sharding=spec_entries(sharding.spec))
  return masters


def masters_to_compute(masters: Any, plan: Zero1Plan) -> Any:
  """The masters (pure arrays) on the Zero-1 layout in device memory, for the update."""
  shardings = _storage_shardings(plan, DEVICE)
  masters = move_tree(masters, shardings) if plan.offload_state else masters
  return place_tree(masters, shardings)


def masters_to_storage(masters: Any, plan: Zero1Plan) -> Any:
  """The new masters where the plan keeps them between steps (host memory if offloaded)."""
  return move_tree(masters, master_shardings(plan)) if plan.offload_state else masters


def on_masters(init: Callable[[Any], Any], master_dtype: Any) -> Callable[[Any], Any]:
  """``init`` (parameters -> optimizer state) on the parameters cast to the master dtype:
  ``tx``'s state is made for the masters, as a float32 model's would be.

  Example::

    >>> import jax, jax.numpy as jnp
    >>> jax.eval_shape(on_masters(lambda p: p, "float32"), {"w": jnp.ones(2, jnp.bfloat16)})["w"].dtype
    dtype('float32')
  """
  return lambda param_state: init(to_master_dtype(param_state, master_dtype))


def slices_on_masters(sliced: Any, master_params: Any, plan: Zero1Plan) -> Any:
  """``update``'s slices (a NamedTuple with ``params`` and ``grads``) with the master copies as
  the parameters and the gradients in the master dtype: what ``tx`` runs on."""
  masters = masters_to_compute(nnx.as_pure(master_params), plan)
  return sliced._replace(params=masters, grads=to_master_dtype(sliced.grads, plan.master_dtype))


def write_masters(master_params: Any, new_masters: Any, updates: Any, params: Any, plan: Zero1Plan,
                  graph: bool | None = None) -> tuple[Any, Any]:
  """Stores the new masters in ``master_params``; returns the new parameters and the updates in the
  parameters' dtypes, still on the Zero-1 layout, so the all-gather that follows carries those."""
  nnx.update(master_params, nnx.state(masters_to_storage(new_masters, plan), graph=graph))
  return to_param_dtypes(new_masters, params), to_param_dtypes(updates, params)
