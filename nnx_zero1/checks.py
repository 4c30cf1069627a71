"""Loud checks: every way Zero-1 can fail to apply becomes a ``Zero1Error``
raised before any state is changed."""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh

from nnx_zero1.errors import Zero1Error
from nnx_zero1.plan import Zero1Plan

__all__ = ["resolve_mesh", "check_params", "check_model", "check_grads", "check_strict"]


def _axes(mesh: Mesh) -> str:
  return f"mesh axes {tuple(mesh.axis_names)} (shape {dict(mesh.shape)})"


def resolve_mesh(mesh: Mesh | None) -> Mesh:
  """The mesh to use: the argument, else ``jax.set_mesh``'s, else a legacy ``with mesh:``.

  Example::

    >>> import jax
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> with jax.set_mesh(mesh):
    ...   resolve_mesh(None) == mesh
    True
  """
  if mesh is not None:
    if not isinstance(mesh, Mesh):
      raise Zero1Error(f"mesh must be a jax.sharding.Mesh with devices, got {type(mesh).__name__}")
    return mesh
  current = jax.sharding.get_mesh()
  if current.empty:
    from jax._src.mesh import thread_resources  # Tunix still uses `with mesh:`

    current = thread_resources.env.physical_mesh
  if current.empty:
    raise Zero1Error(
        "Zero-1 needs a device mesh: pass mesh= or call it under jax.set_mesh(mesh)"
    )
  return current


def check_params(params: Any, wrt, mesh: Mesh) -> None:
  """Refuses a ``wrt`` that selects nothing and parameters on devices outside the mesh."""
  leaves = jax.tree.leaves(params)
  if not leaves:
    raise Zero1Error(
        f"wrt={wrt!r} selects no parameters of the model, so there is no optimizer "
        f"state to shard; {_axes(mesh)}"
    )
  mesh_devices = set(mesh.devices.flat)
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    sharding = getattr(leaf, "sharding", None)
    devices = getattr(sharding, "device_set", set())
    outside = devices - mesh_devices
    if outside:
      raise Zero1Error(
          f"parameter {jax.tree_util.keystr(path)} lives on devices {sorted(d.id for d in outside)} "
          f"that are not in the mesh ({_axes(mesh)}); place the model on the mesh first"
      )


def check_model(params: Any, plan: Zero1Plan) -> None:
  """Refuses a model whose parameters are not the ones the optimizer was built for."""
  leaves, treedef = jax.tree.flatten(params)
  shapes = tuple(tuple(x.shape) for x in leaves)
  if treedef != plan.param_treedef or shapes != plan.param_shapes:
    raise Zero1Error(
        "update() got a model whose parameters differ from the ones this Zero1Optimizer "
        f"was built for ({len(leaves)} leaves vs {len(plan.param_shapes)}); "
        f"{_axes(plan.mesh)}"
    )


def check_grads(grads: Any, params: Any, plan: Zero1Plan) -> None:
  """Refuses gradients whose tree, shapes or dtypes do not match the parameters."""
  g_leaves, g_def = jax.tree.flatten(grads)
  if g_def != plan.param_treedef:
    raise Zero1Error(
        "gradients do not match the parameters: tree "
        f"{g_def} is not {plan.param_treedef}; {_axes(plan.mesh)}"
    )
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  for (path, p), g in zip(flat, g_leaves):
    if tuple(g.shape) != tuple(p.shape) or g.dtype != p.dtype:
      raise Zero1Error(
          f"gradient for {jax.tree_util.keystr(path)} is {g.dtype}{list(g.shape)} but the "
          f"parameter is {p.dtype}{list(p.shape)}; {_axes(plan.mesh)}"
      )


def check_strict(plan: Zero1Plan) -> None:
  """With ``strict=True``: refuses any non-scalar leaf that stays replicated."""
  left = [row for row in plan.state_leaves if row.reason is not None and row.shape]
  if left:
    names = ", ".join(f"{row.path} {list(row.shape)} ({row.reason})" for row in left)
    raise Zero1Error(
        f"strict=True, but these optimizer leaves cannot be split over "
        f"{plan.data_axis}: {names}; {_axes(plan.mesh)}"
    )
