"""Stored vs computed state: how the optimizer keeps its state between steps, and ``update``'s two moves.

Between steps every state leaf is *stored*: on its Zero-1 layout, in host memory
(``pinned_host``) with ``offload_state_to_host``, and in ``state_dtype`` when that is
narrower than ``tx`` makes it. With ``master_dtype`` the parameters' master copies
are stored the same way. ``tx`` runs on the *computed* form: device memory, the
dtypes ``tx`` made. ``update`` calls :func:`load` before ``tx`` and :func:`store`
after it; with none of these options both return what they are given. Which
device holds which slice never changes, only the memory kind and the dtype, so
offloaded state is bit-identical to state kept on device, and ``nnx.state(opt)``
keeps its tree (checkpoints cross).

Narrowing is stochastic by default. Round-to-nearest loses every change smaller
than half a bfloat16 spacing (2**-9 relative): Adam's second moment moves by at
most ``1 - b2`` = 0.1% a step when it decays, so rounded to nearest it can only grow.
Stochastic rounding keeps the expected value of each change; its random bits come
from the step count and the leaf's index, generated where each slice lives (no
collective), and equal whatever the data-parallel size.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from nnx_zero1._src.errors import Zero1Error, describe_mesh
from nnx_zero1._src.layout import Reason
from nnx_zero1._src.layout_plan import LeafPlan, Zero1Plan
from nnx_zero1._src.options import Zero1Options
from nnx_zero1._src.placement import move_tree, place_tree

__all__ = [
    "DEVICE", "HOST", "check_host_memory", "compute_shardings", "load", "master_shardings", "narrowed",
    "offloaded_leaves", "stochastic_round", "storage_plan", "store",
]

HOST = "pinned_host"  # page-locked: the transfer engine reads it without a staging copy
DEVICE = "device"
_UNTIED = (Reason.SCALAR, Reason.NOT_PARAM_SHAPED)
_LOW_BITS = 16  # what float32 has beyond bfloat16's mantissa


def storage_plan(plan: Zero1Plan, options: Zero1Options, params: Any) -> Zero1Plan:
  """``plan`` with each leaf's stored dtype and memory kind, and the master dtype, as ``options`` ask.

  Args:
    plan: a plan from ``make_plan`` (or ``single_device_plan``).
    options: the checked options.
    params: the pure parameters (arrays or ``ShapeDtypeStruct``s), for ``master_dtype``.

  Returns:
    The plan; unchanged when no storage option is set.

  Raises:
    Zero1Error: any storage option with no mesh; a ``state_dtype`` that would change
      no leaf; a ``master_dtype`` narrower than a parameter, for a parameter that is not
      floating, or for a model already in it (unless ``params_across_dtype`` rounds the model's
      copy); host offload on a device without host memory.

  Example::

    >>> import jax, jax.numpy as jnp, optax
    >>> from nnx_zero1._src.layout_plan import make_plan
    >>> params = {"w": jnp.ones(8)}
    >>> plan = make_plan(optax.adam(1e-3), params, jax.make_mesh((1,), ("data",)), ("data",))
    >>> stored = storage_plan(plan, Zero1Options(offload_state_to_host=True, state_dtype="bfloat16"), params)
    >>> [(leaf.dtype, leaf.sharding.memory_kind) for leaf in stored.state_leaves][1:]
    [('bfloat16', 'pinned_host'), ('bfloat16', 'pinned_host')]
  """
  asked = {"state_dtype": options.state_dtype, "master_dtype": options.master_dtype}
  asked["offload_state_to_host"] = options.offload_state_to_host or None
  if plan.single_device:
    for name, value in asked.items():
      if value is not None:
        raise Zero1Error(
            f"{name}={value} needs a mesh: the model is on one device ({plan.mesh.devices.flat[0]}) and "
            "no mesh is set (data-parallel size 1); build the model and the optimizer under "
            "jax.set_mesh(mesh)"
        )
    return plan
  plan = _narrowed_plan(plan, options.state_dtype, options.state_rounding)
  master_dtype = _checked_master_dtype(options.master_dtype, params, plan.mesh,
                                      rounded_gather=options.params_across_dtype is not None)
  if master_dtype is not None:
    plan = dataclasses.replace(plan, master_dtype=str(master_dtype))
  return _offloaded_plan(plan, options.offload_fraction) if options.offload_state_to_host else plan


def _narrowable(leaf: LeafPlan, dtype: np.dtype) -> bool:
  floating = jnp.issubdtype(leaf.dtype, jnp.floating) and np.dtype(leaf.dtype) != dtype
  return bool(leaf.shape) and leaf.reason not in _UNTIED and floating


def _narrowed_plan(plan: Zero1Plan, state_dtype: np.dtype | None, rounding: str) -> Zero1Plan:
  """Each floating, parameter-tied, non-scalar leaf stored in ``state_dtype``, computed in its own."""
  if state_dtype is None:
    return plan
  dtype = np.dtype(state_dtype)
  if not any(_narrowable(leaf, dtype) for leaf in plan.state_leaves):
    kept = sorted({leaf.dtype for leaf in plan.state_leaves if leaf.shape and leaf.reason not in _UNTIED})
    raise Zero1Error(
        f"state_dtype={dtype} changes nothing: the optimizer has no floating state tied to a parameter "
        f"in another dtype (its parameter-tied state is {kept or 'empty'}); drop state_dtype; "
        f"{describe_mesh(plan.mesh)}"
    )
  leaves = tuple(
      dataclasses.replace(leaf, dtype=str(dtype), compute_dtype=leaf.dtype)
      if _narrowable(leaf, dtype) else leaf
      for leaf in plan.state_leaves
  )
  return dataclasses.replace(plan, state_leaves=leaves, state_rounding=rounding)


def _checked_master_dtype(master_dtype: np.dtype | None, params: Any, mesh: Any,
                          rounded_gather: bool = False) -> np.dtype | None:
  """``master_dtype``, refused unless every parameter is floating, no wider, and some narrower; or, where
  the parameters are gathered rounded (``rounded_gather``: ``params_across_dtype``), all in it: the
  masters then keep the exact values the model's copy has lost."""
  if master_dtype is None:
    return None
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  for path, x in flat:
    name = jax.tree_util.keystr(path)
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise Zero1Error(
          f"master_dtype={master_dtype}: parameter {name} is {x.dtype}, not floating; leave it out of wrt "
          f"(master weights are for floating parameters); {describe_mesh(mesh)}"
      )
    if np.dtype(x.dtype).itemsize > master_dtype.itemsize:
      raise Zero1Error(
          f"master_dtype={master_dtype} is narrower than parameter {name} ({x.dtype}): the masters would "
          f"lose precision; pass one at least as wide (jnp.float32); {describe_mesh(mesh)}"
      )
  if not rounded_gather and all(np.dtype(x.dtype) == master_dtype for _, x in flat):
    raise Zero1Error(
        f"master_dtype={master_dtype}, but every parameter is {master_dtype} already: master copies would "
        f"change nothing (they are for bfloat16 or float16 models); drop master_dtype; {describe_mesh(mesh)}"
    )
  return master_dtype


def check_host_memory(kinds_by_device: Mapping[str, Iterable[str]], mesh_words: str = "",
                      asked: bool | float = True) -> None:
  """Refuses host offload when some device cannot address ``pinned_host`` memory.

  A pure function of each device's memory kinds (``device.addressable_memories()``),
  so the refusal does not depend on which backend the caller runs.

  Args:
    kinds_by_device: device name to the memory kinds it can address.
    mesh_words: how the error names the mesh.
    asked: the ``offload_state_to_host`` the user passed (``True`` or a fraction), as the error names it.

  Raises:
    Zero1Error: a device lacks ``pinned_host`` (never a silent copy to device memory).

  Example::

    >>> check_host_memory({"TPU_0": ("device", "pinned_host")})
  """
  lacking = sorted(name for name, kinds in kinds_by_device.items() if HOST not in set(kinds))
  if lacking:
    have = sorted(set(kinds_by_device[lacking[0]]))
    raise Zero1Error(
        f"offload_state_to_host={asked!r} needs host memory ({HOST!r}) on every device, but "
        f"{', '.join(lacking[:3])} can address only {have}; keep the state on device "
        f"(offload_state_to_host=False){'; ' + mesh_words if mesh_words else ''}"
    )


def offloaded_leaves(leaf_bytes: Sequence[int], fraction: float) -> tuple[bool, ...]:
  """Which leaves live in host memory for ``offload_state_to_host=fraction``: the largest first.

  Largest bytes per device first (ties: tree order), until those taken hold at least
  ``fraction`` of the bytes: device memory keeps at most ``1 - fraction``, less by under
  one leaf. Few, large copies; the small ones (the count) go last.

  Args:
    leaf_bytes: each leaf's bytes per device, in tree-leaf order.
    fraction: the share of the bytes to put in host memory, in (0, 1].

  Returns:
    One bool per leaf: True where it lives in host memory.

  Example::

    >>> offloaded_leaves([4, 400, 400, 100], 0.25)
    (False, True, False, False)
  """
  if fraction >= 1:
    return (True,) * len(leaf_bytes)
  target = fraction * sum(leaf_bytes)
  taken: set[int] = set()
  held = 0
  for i in sorted(range(len(leaf_bytes)), key=lambda i: (-leaf_bytes[i], i)):
    if held >= target:
      break
    taken.add(i)
    held += leaf_bytes[i]
  return tuple(i in taken for i in range(len(leaf_bytes)))


def _leaf_bytes(leaf: LeafPlan) -> int:
  """One leaf's stored bytes on one device (its Zero-1 shard)."""
  return math.prod(leaf.sharding.shard_shape(leaf.shape)) * np.dtype(leaf.dtype).itemsize


def _offloaded_plan(plan: Zero1Plan, fraction: float) -> Zero1Plan:
  """The chosen state leaves (and, for the whole state, the master copies) in host memory, same
  layout; this process's devices checked first."""
  # Only this process's devices (each process checks its own): another host's devices may expose
  # no memories here, as a multi-host TPU topology compiled ahead of time does.
  local = [d for d in plan.mesh.devices.flat if d.process_index == jax.process_index()]
  check_host_memory({str(d): tuple(m.kind for m in d.addressable_memories()) for d in local},
                    describe_mesh(plan.mesh), True if fraction == 1 else fraction)
  on_host = offloaded_leaves([_leaf_bytes(leaf) for leaf in plan.state_leaves], fraction)
  leaves = tuple(
      dataclasses.replace(leaf, sharding=_with_kind(leaf.sharding, HOST)) if host else leaf
      for leaf, host in zip(plan.state_leaves, on_host, strict=True)
  )
  return dataclasses.replace(plan, state_leaves=leaves, offload_state=any(on_host),
                             offload_masters=fraction >= 1 and plan.master_dtype is not None)


def _on_host(leaf: LeafPlan) -> bool:
  return leaf.sharding.memory_kind == HOST


def _with_kind(sharding: Any, kind: str) -> Any:
  assert isinstance(sharding, NamedSharding)  # mesh plans only: single-device plans store nothing apart
  return sharding.with_memory_kind(kind)


def compute_shardings(plan: Zero1Plan) -> list:
  """Where ``tx.update`` reads and writes each state leaf: the plan's layout in device memory.

  Example::

    >>> import jax, jax.numpy as jnp, optax
    >>> from nnx_zero1._src.layout_plan import make_plan
    >>> params = {"w": jnp.ones(8)}
    >>> plan = make_plan(optax.sgd(0.1, 0.9), params, jax.make_mesh((1,), ("data",)), ("data",))
    >>> [s.memory_kind for s in compute_shardings(storage_plan(plan, Zero1Options(offload_state_to_host=True),
    ...                                                        params))]
    ['device']
  """
  return [_with_kind(leaf.sharding, DEVICE) if _on_host(leaf) else leaf.sharding
          for leaf in plan.state_leaves]


def master_shardings(plan: Zero1Plan, kind: str = HOST) -> list:
  """Where each master copy lives between steps (``kind=HOST``): its parameter's Zero-1 layout,
  in host memory when the whole state is (``True``); ``kind=DEVICE``: where ``tx`` reads it.

  Example::

    >>> import jax, jax.numpy as jnp, optax
    >>> from nnx_zero1._src.layout_plan import make_plan
    >>> plan = make_plan(optax.sgd(0.1), {"w": jnp.ones(4)}, jax.make_mesh((1,), ("data",)), ("data",))
    >>> from jax.sharding import PartitionSpec as P
    >>> master_shardings(plan)[0].spec == P("data")
    True
  """
  kind = HOST if plan.offload_masters and kind == HOST else DEVICE
  return [s.with_memory_kind(kind) for s in plan.zero1_param_shardings]


def load(plan: Zero1Plan, state: Any, masters: Any = None) -> tuple[Any, Any]:
  """The stored state (and master copies) as ``tx`` computes on them.

  Args:
    plan: the optimizer's plan.
    state: the stored state, pure arrays in the plan's tree-leaf order.
    masters: the stored master copies (pure), or None.

  Returns:
    ``(state, masters)`` on the plan's layout in device memory, the state in the
    dtypes ``tx`` made it in (see :func:`store`'s example). State restored onto another
    layout is re-placed.
  """
  shardings = compute_shardings(plan)
  state = _move_offloaded(state, shardings, plan)
  state = _map_narrowed(place_tree(state, shardings), plan, lambda i, x, leaf: x.astype(leaf.compute_dtype))
  if masters is not None:
    on_device = master_shardings(plan, DEVICE)
    masters = place_tree(move_tree(masters, on_device) if plan.offload_masters else masters, on_device)
  return state, masters


def store(plan: Zero1Plan, state: Any, masters: Any = None, *, step: Any = None) -> tuple[Any, Any]:
  """The state (and master copies) ``tx`` computed, as the plan keeps them between steps.

  Args:
    plan: the optimizer's plan.
    state: the new state on the plan's layout, pure arrays in its tree-leaf order.
    masters: the parameters ``tx`` computed (pure): the new master copies when the plan keeps
      them, else ignored; or None.
    step: the step count, which seeds stochastic rounding; None rounds to nearest.

  Returns:
    ``(state, masters)``: the state narrowed to its stored dtypes, both in host
    memory when offloaded; masters None when the plan keeps none.

  Example::

    >>> import jax, jax.numpy as jnp, optax
    >>> from nnx_zero1._src.layout_plan import make_plan
    >>> params = {"w": jnp.ones(8)}
    >>> plan = make_plan(optax.sgd(0.1, 0.9), params, jax.make_mesh((1,), ("data",)), ("data",))
    >>> plan = storage_plan(plan, Zero1Options(offload_state_to_host=True), params)
    >>> stored, _ = store(plan, (optax.TraceState(trace=params), optax.EmptyState()))
    >>> stored[0].trace["w"].sharding.memory_kind, load(plan, stored)[0][0].trace["w"].sharding.memory_kind
    ('pinned_host', 'device')
  """
  stored = [leaf.sharding for leaf in plan.state_leaves]
  state = _move_offloaded(narrowed(state, plan, step=step), stored, plan)
  if plan.master_dtype is None:
    return state, None
  if masters is not None and plan.offload_masters:
    masters = move_tree(masters, master_shardings(plan))
  return state, masters


def _move_offloaded(state: Any, shardings: list, plan: Zero1Plan) -> Any:
  """The offloaded leaves of ``state`` moved to ``shardings``' memory kinds; the others as they are."""
  if not plan.offload_state:
    return state
  leaves, treedef = jax.tree.flatten(state)
  return jax.tree.unflatten(treedef, [
      move_tree([x], [s])[0] if _on_host(leaf) else x
      for x, s, leaf in zip(leaves, shardings, plan.state_leaves, strict=True)
  ])


def stochastic_round(x: jax.Array, key: jax.Array) -> jax.Array:
  """``x`` (float32) to bfloat16, rounded up with probability equal to the discarded fraction.

  Adds 16 random bits to the 16 low bits of each float's pattern and drops them:
  the result is one of the two nearest bfloat16 values, unbiased in expectation.

  Example::

    >>> import jax, jax.numpy as jnp
    >>> x = jnp.full((4096,), 1.0 + 2.0**-10)  # a quarter of the way from 1.0 to the next bfloat16
    >>> float(stochastic_round(x, jax.random.key(0)).astype(jnp.float32).mean())  # doctest: +ELLIPSIS
    1.00...
  """
  bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
  noise = jax.random.bits(key, x.shape, jnp.uint32) >> (32 - _LOW_BITS)
  kept = (bits + noise) & jnp.uint32(0xFFFFFFFF << _LOW_BITS & 0xFFFFFFFF)
  return jax.lax.bitcast_convert_type(kept, jnp.float32).astype(jnp.bfloat16)  # exact: low bits are 0


def _map_narrowed(state: Any, plan: Zero1Plan, cast: Callable[[int, Any, LeafPlan], Any]) -> Any:
  if plan.state_rounding is None:  # no state_dtype: nothing is narrowed, every update skips this
    return state
  leaves, treedef = jax.tree.flatten(state)
  return jax.tree.unflatten(treedef, [
      cast(i, x, leaf) if leaf.compute_dtype is not None else x
      for i, (x, leaf) in enumerate(zip(leaves, plan.state_leaves, strict=True))
  ])


def narrowed(state: Any, plan: Zero1Plan, step: Any = None) -> Any:
  """The state computed by ``tx`` in the dtypes the plan stores it in (no move).

  Args:
    state: pure arrays in the plan's tree-leaf order.
    plan: a plan from :func:`storage_plan`.
    step: the optimizer's step count, which seeds stochastic rounding (with the
      leaf's index); ``None`` rounds to nearest (the initial state).

  Example::

    >>> import jax, jax.numpy as jnp, optax
    >>> from nnx_zero1._src.layout_plan import make_plan
    >>> params = {"w": jnp.ones(4)}
    >>> plan = make_plan(optax.sgd(0.1, 0.9), params, jax.make_mesh((1,), ("data",)), ("data",))
    >>> plan = storage_plan(plan, Zero1Options(state_dtype=jnp.bfloat16), params)
    >>> state = (optax.TraceState(trace={"w": jnp.ones(4)}), ())
    >>> narrowed(state, plan, step=jnp.uint32(3))[0].trace["w"].dtype
    dtype(bfloat16)
  """
  if plan.state_rounding is None:
    return state
  if step is None or plan.state_rounding == "nearest":
    return _map_narrowed(state, plan, lambda i, x, leaf: x.astype(leaf.dtype))
  key = jax.random.fold_in(jax.random.key(0), step)
  return _map_narrowed(state, plan, lambda i, x, leaf: stochastic_round(x, jax.random.fold_in(key, i)))
