"""Checkpoint targets: restore a saved optimizer straight onto this mesh's Zero-1 layout.

Orbax stores global arrays; the ``jax.ShapeDtypeStruct(..., sharding=...)``
target given at restore decides where each shard is read to. Handing it the
Zero-1 layout of the *current* mesh restores a checkpoint written at any
data-parallel size (or by a plain ``nnx.Optimizer``) without ever building a
full replicated copy of the moments.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx
from jax.sharding import NamedSharding

from nnx_zero1._src.checks import first_mismatch
from nnx_zero1._src.errors import Zero1Error, describe_mesh
from nnx_zero1._src.mesh import resolve_mesh, sharding_on_mesh
from nnx_zero1._src.storage import master_shardings

__all__ = ["abstract_arrays", "abstract_state", "key_names", "restore_into", "restore_target"]

# What a restore that does not fit needs: a checkpoint of the same build.
_SAME_BUILD = ("restore a checkpoint saved from the same model and optimizer (the same tx and wrt, and the "
               "same state_dtype and master_dtype: docs/checkpoints.md)")


def key_names(path: tuple) -> tuple:
  """A pytree key path as plain names and indices, the same for pure and ``nnx.State`` trees.

  Example::

    >>> import jax
    >>> [key_names(p) for p, _ in jax.tree_util.tree_flatten_with_path({"a": [1]})[0]]
    [('a', 0)]
  """
  return tuple(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path)


def _target_shardings(obj: Any) -> dict[tuple, Any]:
  """Zero-1 target sharding of each optimizer-state array, keyed by its path in ``nnx.state(obj)``."""
  plan = getattr(obj, "zero1_plan", None)
  if plan is None:
    return {}
  flat = jax.tree_util.tree_flatten_with_path(nnx.as_pure(obj.opt_state))[0]
  targets = {
      ("opt_state", *key_names(path)): leaf.sharding
      for (path, _), leaf in zip(flat, plan.state_leaves, strict=True)
  }
  if plan.master_dtype is not None:
    masters = jax.tree_util.tree_flatten_with_path(nnx.as_pure(obj.master_params))[0]
    targets.update({
        ("master_params", *key_names(path)): sharding
        for (path, _), sharding in zip(masters, master_shardings(plan), strict=True)
    })
  return targets


def restore_target(x: Any, mesh: Any = None, sharding: Any = None) -> jax.ShapeDtypeStruct:
  """One array's orbax restore target: its shape and dtype on ``sharding`` (default: its own).

  A sharding that is not a mesh sharding (a step count created on one device)
  becomes replicated on ``mesh``: restored onto one device it would be
  committed there and clash with the mesh under jit.

  Example::

    >>> import jax, jax.numpy as jnp
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> restore_target(jnp.zeros((), jnp.int32), mesh).sharding.spec
    P()
  """
  sharding = x.sharding if sharding is None else sharding
  if not isinstance(sharding, NamedSharding) and mesh is not None:
    sharding = sharding_on_mesh(x, mesh)
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def abstract_arrays(tree: Any, mesh: Any = None) -> Any:
  """``tree`` (pure arrays) as restore targets on the arrays' own layouts (see :func:`restore_target`).

  Example::

    >>> import jax.numpy as jnp
    >>> abstract_arrays({"w": jnp.ones(2)})["w"].shape
    (2,)
  """
  return jax.tree.map(lambda x: restore_target(x, mesh), tree)


def abstract_state(obj: Any) -> nnx.State:
  """``nnx.state(obj)`` as ``jax.ShapeDtypeStruct`` leaves carrying the shardings to restore onto.

  For a ``Zero1Optimizer`` every optimizer-state leaf gets its Zero-1 layout on
  the optimizer's mesh (from ``zero1_plan``) and the step count is replicated
  on that mesh. For anything else (a model, a plain ``nnx.Optimizer``) each
  leaf keeps the sharding it has now, except that a leaf on a single device
  (such as a step count) is replicated on the mesh the other leaves are on.
  Pass the result as the orbax restore target: the tree is ``nnx.state``'s,
  the same for a plain optimizer, so checkpoints cross both ways and between
  data-parallel sizes.

  Args:
    obj: a ``Zero1Optimizer``, an ``nnx.Optimizer``, a model: anything ``nnx.state`` takes.

  Returns:
    An ``nnx.State`` of ``jax.ShapeDtypeStruct`` s with ``sharding`` set.

  Raises:
    Zero1Error: the optimizer's plan and its state disagree (never a silent fallback).

  Example::

    >>> import jax, optax, orbax.checkpoint as ocp
    >>> from flax import nnx
    >>> from nnx_zero1 import Zero1Optimizer, abstract_state
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> opt = Zero1Optimizer(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), optax.adam(1e-3), mesh)
    >>> target = abstract_state(opt)
    >>> target["step"].sharding.spec
    P()
    >>> # restored = ocp.StandardCheckpointer().restore(path, target)
    >>> # restore_into(opt, restored)
  """
  targets = _target_shardings(obj)
  state = nnx.state(obj)
  plan = getattr(obj, "zero1_plan", None)
  mesh = plan.mesh if plan is not None else resolve_mesh(None, state)
  if plan is not None and plan.single_device:
    mesh = None  # one device, no mesh: every leaf stays where nnx.Optimizer keeps it

  def target(path, variable):
    sharding = targets.get(key_names(path))
    return jax.tree.map(lambda x: restore_target(x, mesh, sharding), variable)

  is_variable = lambda x: isinstance(x, nnx.Variable)  # paths end at the variable
  flat = jax.tree_util.tree_flatten_with_path(state, is_leaf=is_variable)[0]
  unmatched = set(targets) - {key_names(path) for path, _ in flat}
  if unmatched:  # the plan and the state disagree: never fall back to the live layout silently
    raise Zero1Error(f"optimizer state has no leaf at {sorted(map(str, unmatched))[:3]}; build the optimizer "
                     f"again for this model and restore into the new one{_mesh_words(obj)}")
  return jax.tree_util.tree_map_with_path(target, state, is_leaf=is_variable)


def restore_into(obj: Any, restored: Any) -> None:
  """Loads ``restored`` (e.g. what orbax returned) into ``obj``, on ``abstract_state(obj)``'s layout.

  Leaves already on their target sharding are taken as they are; others (a
  state restored replicated, or onto another mesh) are moved there.

  Args:
    obj: what to load into (a ``Zero1Optimizer``, an ``nnx.Optimizer``, a model).
    restored: a tree like ``nnx.state(obj)`` (an ``nnx.State`` or orbax's pure dict).

  Raises:
    Zero1Error: the tree, a shape or a dtype differs from ``obj``'s; nothing is changed.

  Example::

    >>> import jax, optax
    >>> from flax import nnx
    >>> from nnx_zero1 import Zero1Optimizer
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> opt = Zero1Optimizer(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), optax.adam(1e-3), mesh)
    >>> restore_into(opt, nnx.state(opt))
    >>> int(opt.step[...])
    0
  """
  target = abstract_state(obj)
  t_leaves, t_def = jax.tree.flatten(nnx.as_pure(target))
  # Compared by key paths, not tree types: an nnx.State and a dict holding the same names match.
  t_paths = [key_names(path) for path, _ in jax.tree_util.tree_flatten_with_path(nnx.as_pure(target))[0]]
  r_flat = jax.tree_util.tree_flatten_with_path(nnx.as_pure(restored))[0]
  r_paths, r_leaves = [key_names(path) for path, _ in r_flat], [leaf for _, leaf in r_flat]
  axes = _mesh_words(obj)
  if t_paths != r_paths:
    missing = sorted(map(str, set(t_paths) - set(r_paths)))[:3]
    extra = sorted(map(str, set(r_paths) - set(t_paths)))[:3]
    raise Zero1Error(
        f"restored state does not match {type(obj).__name__}: missing {missing}, unexpected {extra}; "
        f"{_SAME_BUILD}{axes}"
    )
  mismatch = first_mismatch(nnx.as_pure(target), r_leaves)
  if mismatch is not None:
    path, t, r = mismatch
    raise Zero1Error(
        f"restored {path} is {r.dtype}{list(r.shape)} but "
        f"{type(obj).__name__} has {t.dtype}{list(t.shape)}; {_SAME_BUILD}{axes}"
    )
  placed = [
      r if getattr(r, "sharding", None) == t.sharding else jax.device_put(r, t.sharding)
      for t, r in zip(t_leaves, r_leaves)
  ]
  nnx.update(obj, jax.tree.unflatten(t_def, placed))


def _mesh_words(obj: Any) -> str:
  plan = getattr(obj, "zero1_plan", None)
  return "" if plan is None else f"; {describe_mesh(plan.mesh)}"
