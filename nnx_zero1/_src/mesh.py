"""Which mesh: the one function every entry point asks, and what an unplaced array means on it."""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from nnx_zero1._src.compat import context_mesh, legacy_context_mesh
from nnx_zero1._src.errors import Zero1Error, describe_mesh
from nnx_zero1._src.specs import is_explicit, spec_axes

__all__ = ["current_mesh", "mesh_of", "sharding_on_mesh", "resolve_mesh", "traced", "variable_shardings"]

_FIX = "pass mesh= or call it under jax.set_mesh(mesh)"


def current_mesh() -> Mesh | None:
  """The mesh set by ``jax.set_mesh``, else by a legacy ``with mesh:`` block, else None.

  Returns:
    The concrete mesh, also while tracing; None outside any mesh context.

  Example::

    >>> import jax
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> with mesh:
    ...   current_mesh() == mesh
    True
    >>> current_mesh() is None
    True
  """
  current = context_mesh()
  if current.empty:
    current = legacy_context_mesh()  # Tunix still uses `with mesh:`
  return None if current.empty else current


def mesh_of(x: Any) -> Mesh | AbstractMesh | None:
  """The mesh an array says it lives on: a concrete array's ``NamedSharding``, or the
  mesh in a traced array's type (Explicit axes only); None when it names none.

  Example::

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> mesh_of(jax.device_put(jnp.ones(2), NamedSharding(mesh, P()))) == mesh, mesh_of(jnp.ones(2))
    (True, None)
  """
  if isinstance(x, jax.core.Tracer):
    mesh = jax.typeof(x).sharding.mesh
    return None if mesh.empty else mesh
  sharding = getattr(x, "sharding", None)
  return sharding.mesh if isinstance(sharding, NamedSharding) else None


def sharding_on_mesh(x: Any, mesh: Mesh, declared: PartitionSpec | None = None) -> NamedSharding:
  """The sharding ``x`` has on ``mesh``: its own spec, or replicated when it is not placed on a mesh.

  An array built outside any mesh sits on one device; on ``mesh`` it counts as
  replicated (as jit would place it). A traced ``x`` (an optimizer built under
  ``nnx.eval_shape``, ``jax.eval_shape`` or jit) has its type's spec, which
  carries Explicit mesh axes only; where ``declared`` (the spec its Variable's
  sharding metadata declares, :func:`variable_shardings`) names an axis the type
  cannot carry (an Auto axis, or no mesh in the type), ``declared`` stands.

  Example::

    >>> import jax, jax.numpy as jnp
    >>> sharding_on_mesh(jnp.ones(3), jax.make_mesh((1,), ("data",))).spec
    P()
  """
  if isinstance(x, jax.core.Tracer):
    typed = getattr(jax.typeof(x), "sharding", None)
    if declared is not None and _names_axes_of(declared, mesh) and not (
        set(spec_axes(declared)) <= _explicit_axes(getattr(typed, "mesh", None))):
      return NamedSharding(mesh, PartitionSpec(*declared))
    spec = getattr(typed, "spec", None)
    if spec is not None and _names_axes_of(spec, mesh):
      return NamedSharding(mesh, PartitionSpec(*spec))
    return NamedSharding(mesh, PartitionSpec())
  sharding = getattr(x, "sharding", None)
  if isinstance(sharding, NamedSharding):
    return NamedSharding(mesh, sharding.spec, memory_kind=sharding.memory_kind)
  return NamedSharding(mesh, PartitionSpec())


def _names_axes_of(spec: PartitionSpec, mesh: Mesh) -> bool:
  return set(spec_axes(spec)) <= set(mesh.axis_names)


def _explicit_axes(mesh: Any) -> set[str]:
  """The axes a traced array's type carries: its mesh's Explicit ones (none without a mesh)."""
  if mesh is None or mesh.empty:
    return set()
  return {name for name in mesh.axis_names if is_explicit(mesh, (name,))}


def traced(tree: Any) -> bool:
  """Whether any array of ``tree`` is a tracer (the code runs under ``jit``, ``eval_shape``, ...).

  Example::

    >>> import jax, jax.numpy as jnp
    >>> seen = [traced({"w": jnp.ones(2)})]
    >>> _ = jax.eval_shape(lambda x: seen.append(traced(x)) or x, jnp.ones(2))
    >>> seen
    [False, True]
  """
  return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(tree))


def variable_shardings(variables: Any, mesh: Mesh) -> tuple[NamedSharding, ...]:
  """The sharding of every Variable's value on ``mesh``, in tree-leaf order (:func:`sharding_on_mesh`).

  Concrete values say where they are. Traced ones (a model or optimizer built
  under ``nnx.eval_shape`` or ``jax.eval_shape``) also have the spec their
  Variable's ``out_sharding`` metadata declares, read as ``nnx.get_named_sharding``
  reads it (``nnx.get_partition_spec``: logical names through the logical-axis
  rules in force), for the axes their type cannot carry.

  Example::

    >>> import jax
    >>> from flax import nnx
    >>> mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> seen = []
    >>> with jax.set_mesh(mesh):
    ...   linear = nnx.eval_shape(lambda: nnx.Linear(2, 4, rngs=nnx.Rngs(0),
    ...                                              kernel_metadata={"out_sharding": ("data", None)}))
    ...   _ = jax.eval_shape(lambda state: seen.extend(variable_shardings(state, mesh)), nnx.state(linear))
    >>> [s.spec for s in seen]  # bias, kernel
    [P(None,), P('data', None)]
  """
  values = jax.tree.leaves(nnx.as_pure(variables))
  if not traced(values):
    return tuple(sharding_on_mesh(x, mesh) for x in values)
  declared = jax.tree.leaves(nnx.get_partition_spec(variables))
  return tuple(sharding_on_mesh(x, mesh, d) for x, d in zip(values, declared, strict=True))


def _concrete_meshes(tree: Any) -> tuple[list[Mesh], set[jax.Device]]:
  """The distinct concrete meshes the arrays of ``tree`` name, and all their devices."""
  meshes: list[Mesh] = []
  devices: set[jax.Device] = set()
  for leaf in jax.tree.leaves(tree):
    if isinstance(leaf, jax.core.Tracer):
      continue
    mesh = mesh_of(leaf)
    if isinstance(mesh, Mesh) and mesh not in meshes:
      meshes.append(mesh)
    devices |= set(getattr(getattr(leaf, "sharding", None), "device_set", ()))
  return meshes, devices


def resolve_mesh(mesh: Mesh | None = None, arrays: Any = None, *, traced_ok: bool = False) -> Any:
  """The mesh to use, in this order: ``mesh``; ``jax.set_mesh``'s (or a legacy ``with mesh:``);
  the one mesh the concrete ``arrays`` are placed on; with ``traced_ok``, the mesh in a
  traced array's type or ``jax.sharding.get_abstract_mesh()``.

  Args:
    mesh: the mesh the caller was given, or None.
    arrays: a pytree of the arrays that will be used on the mesh (parameters, a batch).
    traced_ok: accept an ``AbstractMesh`` read off traced arrays or the abstract mesh
      context (enough for ``shard_map`` under jit; not for placing new arrays).

  Returns:
    The mesh; None when there is none and the concrete ``arrays`` all sit on one
    device (data-parallel size 1).

  Raises:
    Zero1Error: ``mesh`` is not a ``jax.sharding.Mesh``; the arrays are placed on
      several meshes, or spread over several devices with no mesh; there is no
      mesh at all and ``arrays`` is None.

  Example::

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> with jax.set_mesh(mesh):
    ...   resolve_mesh() == mesh
    True
    >>> resolve_mesh(None, {"w": jax.device_put(jnp.ones(2), NamedSharding(mesh, P()))}) == mesh
    True
    >>> resolve_mesh(None, {"w": jnp.ones(2)}) is None  # one device, no mesh
    True
  """
  if mesh is not None:
    if not isinstance(mesh, Mesh):
      raise Zero1Error(f"mesh must be a jax.sharding.Mesh with devices, got {type(mesh).__name__}; pass "
                       "one from jax.make_mesh(...)")
    return mesh
  current = current_mesh()
  if current is not None:
    return current
  if arrays is None:
    raise Zero1Error(f"Zero-1 needs a device mesh: {_FIX}")
  meshes, devices = _concrete_meshes(arrays)
  if len(meshes) > 1:
    raise Zero1Error(
        f"the arrays live on {len(meshes)} different meshes "
        f"({'; '.join(describe_mesh(m) for m in meshes)}), so there is no one mesh to use; {_FIX}"
    )
  if meshes:
    return meshes[0]
  traced = [x for x in jax.tree.leaves(arrays) if isinstance(x, jax.core.Tracer)]
  if traced_ok:
    typed = [m for m in map(mesh_of, traced) if m is not None]
    abstract = typed[0] if typed else jax.sharding.get_abstract_mesh()
    if not abstract.empty:
      return abstract
  if len(devices) > 1 or (traced and not devices and jax.device_count() > 1):
    where = f"devices {sorted(d.id for d in devices)}" if devices else "traced arrays"
    raise Zero1Error(
        f"Zero-1 needs a device mesh: the arrays are on {where} with no NamedSharding "
        f"and no mesh is set; {_FIX}"
    )
  return None
