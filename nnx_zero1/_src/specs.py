"""PartitionSpec handling: the one place that reads, pads and spells sharding specs.

A spec entry is ``None``, one mesh axis name, or a tuple of names. A
``PartitionSpec`` is a pytree *leaf*, so ``jax.tree.leaves(spec)`` never looks
inside it: walk :func:`spec_entries` and each entry's :func:`entry_axes`.

**The canonical form** every spec nnx-zero1 builds is written in:

- one entry per dimension, *without trailing* ``None`` (``P('data')``, not
  ``P('data', None)``): that is how users and ``zero1_sharding`` spell a layout;
- an entry of one axis is that axis's name (``'data'``, not ``('data',)``);
- an entry of no axes is ``None`` (never ``()``).

``PartitionSpec`` equality sees trailing ``None``s (``P('data', None) !=
P('data')``), and on an Explicit mesh a jitted step returns its arrays with one
entry per dimension. State that must not cost a second dispatch-cache entry on
the next step is therefore placed with :func:`full_rank_sharding`, which pads
the canonical spec to the array's rank on Explicit meshes (and leaves Auto
meshes alone).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from jax.sharding import AxisType, NamedSharding, PartitionSpec

from nnx_zero1._src.errors import Zero1Error

__all__ = [
    "DataAxis",
    "axes_entry",
    "canonical_spec",
    "check_data_axes_on_mesh",
    "data_axes",
    "data_axis_size",
    "entry_axes",
    "full_rank_sharding",
    "is_explicit",
    "padded_entries",
    "spec_axes",
    "spec_entries",
]

DataAxis = str | Sequence[str]


def spec_entries(spec: PartitionSpec) -> tuple:
  """The per-dimension entries of a spec, also when it carries unreduced/reduced axes.

  (``tuple(spec)`` raises for a spec with ``unreduced=`` or ``reduced=`` axes.)

  Example::

    >>> from jax.sharding import PartitionSpec as P
    >>> spec_entries(P("data", None, unreduced={"tp"}))
    ('data', None)
  """
  return tuple(spec.partitions)


def entry_axes(entry: Any) -> tuple[str, ...]:
  """The mesh axes of one spec entry: ``None`` -> ``()``, a name -> ``(name,)``.

  Example::

    >>> entry_axes(None), entry_axes("data"), entry_axes(("replica", "data"))
    ((), ('data',), ('replica', 'data'))
  """
  if entry is None:
    return ()
  if isinstance(entry, str):
    return (entry,)
  return tuple(entry)


def axes_entry(axes: Sequence[str]) -> Any:
  """The canonical spec entry for a tuple of axes: ``None``, one name, or a tuple.

  Example::

    >>> axes_entry(()), axes_entry(("data",)), axes_entry(("replica", "data"))
    (None, 'data', ('replica', 'data'))
  """
  axes = tuple(axes)
  if not axes:
    return None
  return axes[0] if len(axes) == 1 else axes


def spec_axes(spec: PartitionSpec) -> tuple[str, ...]:
  """Every mesh axis a spec partitions over, in order of its entries.

  Example::

    >>> from jax.sharding import PartitionSpec as P
    >>> spec_axes(P(("replica", "data"), None, "tp"))
    ('replica', 'data', 'tp')
  """
  return tuple(a for e in spec_entries(spec) for a in entry_axes(e))


def padded_entries(spec: PartitionSpec, ndim: int) -> list:
  """The spec's entries padded with ``None`` to ``ndim`` (one per dimension).

  A spec with more entries than ``ndim`` is returned whole; callers that must
  refuse it compare lengths themselves.

  Example::

    >>> from jax.sharding import PartitionSpec as P
    >>> padded_entries(P("data"), 3)
    ['data', None, None]
  """
  entries = list(spec_entries(spec))
  return entries + [None] * (ndim - len(entries))


def canonical_spec(entries: Sequence[Any]) -> PartitionSpec:
  """The canonical spec of ``entries``: no trailing ``None``, 1-tuples unwrapped, ``()`` -> ``None``.

  Example::

    >>> canonical_spec([("data",), (), None])
    P('data',)
    >>> canonical_spec([None, ("tp", "data")])
    P(None, ('tp', 'data'))
  """
  out = [axes_entry(entry_axes(e)) for e in entries]
  while out and out[-1] is None:
    out.pop()
  return PartitionSpec(*out)


def keep_axes(sharding: NamedSharding, keep: Callable[[str], bool]) -> NamedSharding:
  """``sharding`` with only the mesh axes ``keep`` accepts left in its spec (same mesh, memory kind).

  Example::

    >>> import jax
    >>> mesh = jax.make_mesh((1, 1), ("data", "tp"))
    >>> keep_axes(NamedSharding(mesh, PartitionSpec(("data", "tp"), None)), lambda a: a != "data").spec
    P('tp',)
  """
  entries = [tuple(a for a in entry_axes(e) if keep(a)) for e in spec_entries(sharding.spec)]
  return NamedSharding(sharding.mesh, canonical_spec(entries), memory_kind=sharding.memory_kind)


def is_explicit(mesh_or_sharding: Any, axes: Sequence[str] | None = None) -> bool:
  """True when the mesh (of a sharding, or the mesh itself) has an Explicit axis.

  With ``axes``, only those axes are looked at.

  Example::

    >>> import jax
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> is_explicit(mesh), is_explicit(NamedSharding(mesh, P()))
    (True, True)
    >>> auto = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> is_explicit(auto, ("data",))
    False
  """
  mesh = getattr(mesh_or_sharding, "mesh", mesh_or_sharding)
  types = dict(zip(mesh.axis_names, mesh.axis_types))
  names = mesh.axis_names if axes is None else axes
  return any(types[a] == AxisType.Explicit for a in names)


def full_rank_sharding(sharding: NamedSharding, ndim: int) -> NamedSharding:
  """``sharding`` as a jitted step hands an array back: one spec entry per dimension
  on Explicit meshes (``P('data', None)``); unchanged on Auto meshes.

  Example::

    >>> import jax
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> full_rank_sharding(NamedSharding(mesh, P("data")), 2).spec
    P('data', None)
  """
  if not is_explicit(sharding):
    return sharding
  spec = PartitionSpec(*padded_entries(sharding.spec, ndim))
  return NamedSharding(sharding.mesh, spec, memory_kind=sharding.memory_kind)


def data_axes(data_axis: DataAxis | None, default: DataAxis = "data") -> tuple[str, ...]:
  """Normalises ``"data"`` or ``("replica", "data")`` to a tuple of axis names.

  ``None`` means the same everywhere a ``data_axis`` is taken: the data axes the
  context already knows (``default``: a ``Zero1Optimizer``'s own, a trainer
  config's batch axes), else ``"data"``.

  Example::

    >>> data_axes("data"), data_axes(("replica", "data")), data_axes(None), data_axes(None, ("fsdp",))
    (('data',), ('replica', 'data'), ('data',), ('fsdp',))
  """
  data_axis = default if data_axis is None else data_axis
  axes = (data_axis,) if isinstance(data_axis, str) else tuple(data_axis)
  if not axes or not all(isinstance(a, str) for a in axes):
    raise Zero1Error(f"data_axis must be a mesh axis name or a tuple of names, got {data_axis!r}; pass "
                     "e.g. data_axis=\"data\" or (\"replica\", \"data\")")
  if len(set(axes)) != len(axes):
    raise Zero1Error(f"data_axis {data_axis!r} names an axis twice; list each axis once")
  return axes


def check_data_axes_on_mesh(mesh: Any, data_axis: DataAxis) -> None:
  """Raises ``Zero1Error`` naming the mesh's axes unless every data axis is one of them.

  Example::

    >>> import jax
    >>> check_data_axes_on_mesh(jax.make_mesh((1,), ("data",)), "data")
  """
  data_axis_size(mesh, data_axis)


def data_axis_size(mesh: Any, data_axis: DataAxis) -> int:
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
