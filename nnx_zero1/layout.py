"""The Zero-1 layout rule: where a parameter-shaped optimizer leaf lives.

A pure function of (shape, sharding, data axis). It keeps the leaf's existing
partitioning and adds the data axis to the first dimension that can take it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from jax.sharding import NamedSharding, PartitionSpec

from nnx_zero1.errors import Zero1Error

__all__ = ["DataAxis", "data_axes", "data_axis_size", "spec_entries", "zero1_layout", "zero1_sharding"]

DataAxis = str | Sequence[str]

# Reasons a leaf keeps its layout; `report` shows them.
SCALAR = "scalar"
ALREADY_SHARDED = "already sharded over the data axis"
NOT_DIVISIBLE = "no dimension divisible by the data-axis size"


def data_axes(data_axis: DataAxis) -> tuple[str, ...]:
  """Normalises ``"data"`` or ``("replica", "data")`` to a tuple of axis names.

  Example::

    >>> data_axes("data"), data_axes(("replica", "data"))
    (('data',), ('replica', 'data'))
  """
  axes = (data_axis,) if isinstance(data_axis, str) else tuple(data_axis)
  if not axes or not all(isinstance(a, str) for a in axes):
    raise Zero1Error(f"data_axis must be a mesh axis name or a tuple of names, got {data_axis!r}")
  if len(set(axes)) != len(axes):
    raise Zero1Error(f"data_axis {data_axis!r} names an axis twice")
  return axes


def data_axis_size(mesh, data_axis: DataAxis) -> int:
  """The number of data-parallel replicas: the product of the data axes' sizes.

  Raises ``Zero1Error`` naming the mesh's axes when a data axis is missing.

  Example::

    >>> import jax
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> data_axis_size(mesh, "data")
    1
  """
  axes = data_axes(data_axis)
  missing = [a for a in axes if a not in mesh.axis_names]
  if missing:
    raise Zero1Error(
        f"Zero-1 needs data axis {missing[0]!r} but the mesh has axes "
        f"{tuple(mesh.axis_names)} (shape {dict(mesh.shape)}); pass data_axis= one of them"
    )
  return math.prod(mesh.shape[a] for a in axes)


def _entry_axes(entry) -> tuple[str, ...]:
  # A PartitionSpec entry is None, one axis name, or a tuple of names. (The spec
  # itself is a pytree leaf, so jax.tree.leaves(spec) would not look inside it.)
  if entry is None:
    return ()
  if isinstance(entry, str):
    return (entry,)
  return tuple(entry)


def spec_entries(spec: PartitionSpec) -> tuple:
  """The per-dimension entries of a spec, also when it carries unreduced/reduced axes.

  Example::

    >>> from jax.sharding import PartitionSpec as P
    >>> spec_entries(P("data", None))
    ('data', None)
  """
  return tuple(spec.partitions) if hasattr(spec, "partitions") else tuple(spec)


def zero1_layout(
    shape: Sequence[int], sharding: NamedSharding, data_axis: DataAxis = "data"
) -> tuple[NamedSharding, str | None]:
  """Like :func:`zero1_sharding`, and also says why a leaf was left as it was.

  Returns ``(sharding, reason)``; ``reason`` is ``None`` when the data axis was
  added and otherwise one of ``"scalar"``, ``"already sharded over the data
  axis"`` or ``"no dimension divisible by the data-axis size"``.

  Example::

    >>> import jax
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> zero1_layout((), NamedSharding(mesh, P()))[1]
    'scalar'
  """
  mesh = sharding.mesh
  axes = data_axes(data_axis)
  n = data_axis_size(mesh, axes)
  entries = list(spec_entries(sharding.spec))
  if len(entries) > len(shape):
    raise Zero1Error(f"sharding spec {sharding.spec} has more entries than shape {tuple(shape)}")
  entries += [None] * (len(shape) - len(entries))
  if any(a in _entry_axes(e) for e in entries for a in axes):
    return sharding, ALREADY_SHARDED
  if not shape:
    return sharding, SCALAR
  for dim, (size, entry) in enumerate(zip(shape, entries)):
    existing = _entry_axes(entry)
    if size % (math.prod(mesh.shape[a] for a in existing) * n) == 0:
      entries[dim] = existing + axes if len(existing + axes) > 1 else axes[0]
      while entries and entries[-1] is None:
        entries.pop()
      # Optimizer state holds whole values: never partial sums (unreduced) or reduced copies.
      spec = PartitionSpec(*entries)
      return NamedSharding(mesh, spec, memory_kind=sharding.memory_kind), None
  return sharding, NOT_DIVISIBLE


def zero1_sharding(
    shape: Sequence[int], sharding: NamedSharding, data_axis: DataAxis = "data"
) -> NamedSharding:
  """The Zero-1 layout of an optimizer leaf whose parameter has ``sharding``.

  Keeps every axis already in the spec and adds the data axis (or axes) to the
  first dimension whose size divides by (the product of the axes already on it)
  x (the data-axis size). A spec that already uses a data axis, a scalar, or a
  leaf with no such dimension is returned unchanged. The rule is idempotent.

  Example::

    >>> import jax
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((1, 1), ("data", "tp"))
    >>> zero1_sharding((8, 6), NamedSharding(mesh, P(None, "tp"))).spec
    P('data', 'tp')
  """
  return zero1_layout(shape, sharding, data_axis)[0]
