"""Host offload: the optimizer state's Zero-1 shards kept in host memory between steps.

The plan's leaf shardings carry ``memory_kind="pinned_host"``; ``update`` brings
the shards to device memory for ``tx.update`` and sends the new state back. The
layout (which device holds which slice) never changes, only the memory kind, so
values are bit-identical to the state kept on device and ``nnx.state(opt)`` has
the same tree, shapes and dtypes (checkpoints cross).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import jax
from jax.sharding import NamedSharding

from nnx_zero1._src.errors import Zero1Error, describe_mesh
from nnx_zero1._src.layout_plan import Zero1Plan
from nnx_zero1._src.placement import move_tree

__all__ = [
    "DEVICE", "HOST", "check_host_memory", "compute_shardings", "offload_plan", "to_compute", "to_storage",
]

HOST = "pinned_host"  # page-locked: the transfer engine reads it without a staging copy
DEVICE = "device"


def check_host_memory(kinds_by_device: Mapping[str, Iterable[str]], mesh_words: str = "") -> None:
  """Refuses host offload when some device cannot address ``pinned_host`` memory.

  A pure function of each device's memory kinds (``device.addressable_memories()``),
  so the refusal does not depend on which backend the caller runs.

  Args:
    kinds_by_device: device name to the memory kinds it can address.
    mesh_words: how the error names the mesh.

  Raises:
    Zero1Error: a device lacks ``pinned_host`` (never a silent copy to device memory).

  Example::

    >>> check_host_memory({"TPU_0": ("device", "pinned_host")})
  """
  lacking = sorted(name for name, kinds in kinds_by_device.items() if HOST not in set(kinds))
  if lacking:
    have = sorted(set(kinds_by_device[lacking[0]]))
    raise Zero1Error(
        f"offload_state_to_host=True needs host memory ({HOST!r}) on every device, but "
        f"{', '.join(lacking[:3])} can address only {have}; keep the state on device "
        f"(offload_state_to_host=False){'; ' + mesh_words if mesh_words else ''}"
    )


def _kinds(devices: Iterable[jax.Device]) -> dict[str, tuple[str, ...]]:
  # Only this process's devices (each process checks its own): another host's devices may expose
  # no memories here, as a multi-host TPU topology compiled ahead of time does.
  local = [d for d in devices if d.process_index == jax.process_index()]
  return {str(d): tuple(m.kind for m in d.addressable_memories()) for d in local}


def offload_plan(plan: Zero1Plan) -> Zero1Plan:
  """``plan`` with every state leaf in host memory (same layout), checked first.

  Args:
    plan: a mesh plan from ``make_plan``.

  Returns:
    The plan with each ``LeafPlan.sharding`` on ``memory_kind="pinned_host"``.

  Raises:
    Zero1Error: a single-device plan (no mesh) or a device without host memory.

  Example::

    >>> import jax, jax.numpy as jnp, optax
    >>> from nnx_zero1._src.layout_plan import make_plan
    >>> plan = make_plan(optax.adam(1e-3), {"w": jnp.ones(8)}, jax.make_mesh((1,), ("data",)), ("data",))
    >>> {leaf.sharding.memory_kind for leaf in offload_plan(plan).state_leaves}
    {'pinned_host'}
  """
  if plan.single_device:
    raise Zero1Error(
        "offload_state_to_host=True needs a mesh: the model is on one device and no mesh is set "
        "(data-parallel size 1); pass mesh= or call it under jax.set_mesh(mesh)"
    )
  check_host_memory(_kinds(plan.mesh.devices.flat), describe_mesh(plan.mesh))
  on_host = tuple(
      dataclasses.replace(leaf, sharding=_with_kind(leaf.sharding, HOST)) for leaf in plan.state_leaves
  )
  return dataclasses.replace(plan, state_leaves=on_host, offload_state=True)


def _with_kind(sharding: Any, kind: str) -> Any:
  assert isinstance(sharding, NamedSharding)  # mesh plans only: single-device plans are refused
  return sharding.with_memory_kind(kind)


def compute_shardings(plan: Zero1Plan) -> list:
  """Where ``tx.update`` reads and writes each state leaf: the plan's layout in device memory.

  Example::

    >>> import jax, jax.numpy as jnp, optax
    >>> from nnx_zero1._src.layout_plan import make_plan
    >>> plan = offload_plan(make_plan(optax.sgd(0.1, 0.9), {"w": jnp.ones(8)},
    ...                               jax.make_mesh((1,), ("data",)), ("data",)))
    >>> [s.memory_kind for s in compute_shardings(plan)]
    ['device']
  """
  storage = [leaf.sharding for leaf in plan.state_leaves]
  return [_with_kind(s, DEVICE) for s in storage] if plan.offload_state else storage


def to_compute(state: Any, plan: Zero1Plan) -> Any:
  """The state (pure arrays) into device memory for the update; as it is when not offloaded.

  Example::

    >>> import jax, jax.numpy as jnp, optax
    >>> from nnx_zero1._src.layout_plan import make_plan
    >>> plan = make_plan(optax.sgd(0.1), {"w": jnp.ones(2)}, jax.make_mesh((1,), ("data",)), ("data",))
    >>> to_compute((), plan)
    ()
  """
  return move_tree(state, compute_shardings(plan)) if plan.offload_state else state


def to_storage(state: Any, plan: Zero1Plan) -> Any:
  """The new state (pure arrays) back where the plan keeps it between steps (host memory if offloaded).

  Example::

    >>> import jax, jax.numpy as jnp, optax
    >>> from nnx_zero1._src.layout_plan import make_plan
    >>> plan = make_plan(optax.sgd(0.1), {"w": jnp.ones(2)}, jax.make_mesh((1,), ("data",)), ("data",))
    >>> to_storage((), plan)
    ()
  """
  return move_tree(state, [leaf.sharding for leaf in plan.state_leaves]) if plan.offload_state else state
