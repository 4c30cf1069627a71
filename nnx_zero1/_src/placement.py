"""Moving arrays between layouts, the same way eagerly, under jit, on Explicit and Auto meshes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding

from nnx_zero1._src.specs import is_explicit, keep_axes

__all__ = ["current_sharding", "move_tree", "off_mesh", "place", "place_tree"]


def _already_on(x: Any, sharding: NamedSharding) -> bool:
  have = getattr(x, "sharding", None)
  return (
      isinstance(have, NamedSharding) and have.mesh == sharding.mesh
      and have.memory_kind == sharding.memory_kind and have.is_equivalent_to(sharding, x.ndim)
  )


def _on_the_traces_mesh(sharding: NamedSharding) -> NamedSharding:
  """``sharding`` on the trace's mesh when that mesh is this one with other axis types, else as it is.

  A tracer that sets a stand-in of the same axes around its trace (MaxText's
  ahead-of-time engine traces the state under an all-Explicit copy of an Auto
  mesh) decides there how each axis moves; a constraint naming the other mesh's
  types would be refused.
  """
  ambient = jax.sharding.get_abstract_mesh()
  mesh = sharding.mesh
  if ambient.empty or tuple(ambient.axis_types) == tuple(mesh.axis_types):
    return sharding
  shape = lambda m: (tuple(m.axis_names), tuple(m.axis_sizes))
  if shape(ambient) != shape(mesh):
    return sharding
  return NamedSharding(ambient, sharding.spec)  # memory kinds move by move_tree, never here


def place(x: Any, sharding: NamedSharding) -> Any:
  """Puts one array onto ``sharding``, deciding per mesh axis: ``jax.reshard`` moves
  Explicit axes, a sharding constraint under jit (``device_put`` eagerly) moves Auto ones.

  A concrete array already on ``sharding`` is returned as it is (no dispatch).

  Example::

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> s = NamedSharding(jax.make_mesh((1,), ("data",)), P("data"))
    >>> place(jnp.ones(4), s).sharding == s
    True
  """
  if not isinstance(sharding, NamedSharding):
    return jax.device_put(x, sharding)
  traced = isinstance(x, jax.core.Tracer)
  if not traced and _already_on(x, sharding):
    return x
  if traced:
    sharding = _on_the_traces_mesh(sharding)
  mesh = sharding.mesh
  auto = [a for a in mesh.axis_names if not is_explicit(mesh, (a,))]
  if not auto:
    return jax.reshard(x, sharding)
  if is_explicit(sharding):  # a mixed mesh: the Explicit axes by reshard, then the Auto ones
    x = jax.reshard(x, keep_axes(sharding, lambda a: a not in auto))
    if traced:
      return jax.lax.with_sharding_constraint(x, keep_axes(sharding, lambda a: a in auto))
  elif traced:
    return jax.lax.with_sharding_constraint(x, sharding)
  return jax.device_put(x, sharding)


def place_tree(tree: Any, shardings: Sequence, *, only: Callable[[Any], bool] | None = None) -> Any:
  """Puts every array of ``tree`` onto its sharding (in leaf order) with :func:`place`.

  Args:
    tree: a pytree of arrays (concrete or traced).
    shardings: one target per leaf of ``tree``.
    only: when given, only the leaves it accepts move; the others stay as they are.

  Returns:
    ``tree`` with its leaves placed.

  Example::

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> s = NamedSharding(jax.make_mesh((1,), ("data",)), P())
    >>> place_tree({"w": jnp.ones(2)}, [s])["w"].sharding.is_equivalent_to(s, 1)
    True
  """
  leaves, treedef = jax.tree.flatten(tree)
  placed = [x if only and not only(x) else place(x, s) for x, s in zip(leaves, shardings, strict=True)]
  return jax.tree.unflatten(treedef, placed)


def move_tree(tree: Any, shardings: Sequence) -> Any:
  """Moves every array of ``tree`` to its sharding, memory kind included (device <-> host).

  ``jax.device_put`` is the one call that changes memory kind the same way eagerly
  and under jit, on Auto and Explicit meshes (``jax.reshard`` and sharding
  constraints keep it), so host offload moves its state with this.

  Example::

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> s = NamedSharding(jax.make_mesh((1,), ("data",)), P(), memory_kind="pinned_host")
    >>> move_tree([jnp.ones(2)], [s])[0].sharding.memory_kind
    'pinned_host'
  """
  leaves, treedef = jax.tree.flatten(tree)
  return jax.tree.unflatten(treedef, [jax.device_put(x, s) for x, s in zip(leaves, shardings, strict=True)])


def off_mesh(x: Any) -> bool:
  """True for a concrete array not placed on any mesh (on one device, as a model built
  outside ``jax.set_mesh`` is); tracers and mesh-placed arrays are False.

  Example::

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> placed = NamedSharding(jax.make_mesh((1,), ("data",)), P())
    >>> off_mesh(jnp.ones(2)), off_mesh(jax.device_put(jnp.ones(2), placed))
    (True, False)
  """
  if isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array):
    return False
  return not isinstance(x.sharding, NamedSharding)


def current_sharding(x: Any, recorded: NamedSharding) -> Any:
  """The sharding ``x`` has now, so it can be put back there after the update.

  Concrete arrays know it; on an Explicit mesh a traced array's type carries
  it; on an Auto (or mixed) mesh under jit the layout recorded at construction
  stands in (the type does not carry the Auto axes).

  Example::

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> s = NamedSharding(jax.make_mesh((1,), ("data",)), P())
    >>> current_sharding(jnp.ones(2), s) == jnp.ones(2).sharding
    True
  """
  if not isinstance(x, jax.core.Tracer):
    return x.sharding
  if is_explicit(recorded) and all(is_explicit(recorded.mesh, (a,)) for a in recorded.mesh.axis_names):
    spec = jax.typeof(x).sharding.spec
    return NamedSharding(recorded.mesh, spec, memory_kind=recorded.memory_kind)
  return recorded
