"""Loud checks: every way Zero-1 can fail to apply becomes a ``Zero1Error``
raised before any state is changed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from nnx_zero1._src.errors import Zero1Error, describe_mesh
from nnx_zero1._src.layout import Reason
from nnx_zero1._src.layout_plan import Zero1Plan
from nnx_zero1._src.mesh import mesh_of
from nnx_zero1._src.placement import off_mesh

__all__ = [
    "check_params", "check_model", "check_grads", "check_state", "check_strict", "first_mismatch",
]


def _check_devices(tree: Any, mesh: Mesh, what: str, fix: str) -> None:
  # Tracers have no devices; jit refuses mixed device sets itself.
  mesh_devices = set(mesh.devices.flat)
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if isinstance(leaf, jax.core.Tracer):
      continue
    devices: set[jax.Device] = getattr(getattr(leaf, "sharding", None), "device_set", set())
    outside = devices - mesh_devices
    if outside:
      raise Zero1Error(
          f"{what} {jax.tree_util.keystr(path)} lives on devices {sorted(d.id for d in outside)} "
          f"that are not in the mesh ({describe_mesh(mesh)}); {fix}"
      )


# What gradients update() takes.
_GRADS = "pass the gradients nnx.grad takes of the parameters the optimizer was built for (its wrt)"
# How to put a model built outside any mesh onto one, each parameter keeping its declared spec.
PLACE_MODEL = ("build the model under jax.set_mesh(mesh), or place it on the mesh first: nnx.update(model, "
               "jax.device_put(nnx.state(model), nnx.get_named_sharding(nnx.state(model), mesh)))")


def _check_on_mesh(params: Any, mesh: Mesh) -> None:
  """Refuses a concrete parameter left on one device of a mesh with more devices.

  jit would choose its placement in the step while the optimizer state is laid out
  on the mesh, and the step would no longer be the one ``nnx.Optimizer`` runs on a
  placed model. Placing it here instead would move the user's model behind their back.
  """
  mesh_devices = set(mesh.devices.flat)
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    if off_mesh(leaf) and set(leaf.sharding.device_set) != mesh_devices:
      device = next(iter(leaf.sharding.device_set))
      raise Zero1Error(
          f"parameter {jax.tree_util.keystr(path)} is on one device ({device}), not on the mesh "
          f"({describe_mesh(mesh)}): jit would place it in the step as it likes, and the step would not "
          f"be nnx.Optimizer's on a placed model; {PLACE_MODEL}"
      )


def _check_placed(params: Any, mesh: Mesh) -> None:
  """Refuses parameters on devices outside the mesh, and parameters left on one of its devices."""
  _check_devices(params, mesh, "parameter", "place the model on the mesh first")
  _check_on_mesh(params, mesh)


def check_params(params: Any, wrt, mesh: Mesh) -> None:
  """Refuses a ``wrt`` that selects nothing, parameters on devices outside the mesh and parameters
  left on one of its devices."""
  leaves = jax.tree.leaves(params)
  if not leaves:
    raise Zero1Error(
        f"wrt={wrt!r} selects no parameters of the model, so there is no optimizer "
        f"state to shard; pass wrt= a filter that selects the variables to train (nnx.Param by default); "
        f"{describe_mesh(mesh)}"
    )
  _check_placed(params, mesh)


def check_model(params: Any, plan: Zero1Plan) -> None:
  """Refuses a model whose parameters are not the ones the optimizer was built for."""
  leaves, treedef = jax.tree.flatten(params)
  shapes = tuple(tuple(x.shape) for x in leaves)
  if treedef != plan.param_treedef or shapes != plan.param_shapes:
    raise Zero1Error(
        "update() got a model whose parameters differ from the ones this Zero1Optimizer "
        f"was built for ({len(leaves)} leaves vs {len(plan.param_shapes)}); pass that model, or build an "
        f"optimizer for this one; {describe_mesh(plan.mesh)}"
    )
  _check_placed(params, plan.mesh)


def first_mismatch(
    reference: Any, leaves: Sequence[Any], *, dtype: bool = True
) -> tuple[str, Any, Any] | None:
  """The first of ``leaves`` whose shape (or, with ``dtype``, dtype) differs from the leaf
  of ``reference`` at its place (the trees already match): ``(path, reference leaf, leaf)``,
  else None.

  Example::

    >>> import jax.numpy as jnp
    >>> first_mismatch({"a": jnp.ones(2), "b": jnp.ones(3)}, [jnp.ones(2), jnp.ones(4)])[0]
    "['b']"
    >>> first_mismatch({"a": jnp.ones(2)}, [jnp.zeros(2, jnp.bfloat16)], dtype=False) is None
    True
  """
  for (path, ref), leaf in zip(jax.tree_util.tree_flatten_with_path(reference)[0], leaves):
    if tuple(leaf.shape) != tuple(ref.shape) or (dtype and leaf.dtype != ref.dtype):
      return jax.tree_util.keystr(path), ref, leaf
  return None


def check_grads(grads: Any, params: Any, plan: Zero1Plan) -> None:
  """Refuses gradients whose tree or shapes do not match the parameters.

  Their dtype may differ (bfloat16 gradients of float32 parameters): optax
  promotes, as it does under ``nnx.Optimizer``.
  """
  g_leaves, g_def = jax.tree.flatten(grads)
  if g_def != plan.param_treedef:
    raise Zero1Error(
        "gradients do not match the parameters: tree "
        f"{g_def} is not {plan.param_treedef}; {_GRADS}; {describe_mesh(plan.mesh)}"
    )
  mismatch = first_mismatch(params, g_leaves, dtype=False)
  if mismatch is not None:
    path, p, g = mismatch
    raise Zero1Error(
        f"gradient for {path} is {g.dtype}{list(g.shape)} but the "
        f"parameter is {p.dtype}{list(p.shape)}; {_GRADS}; {describe_mesh(plan.mesh)}"
    )
  _check_devices(grads, plan.mesh, "gradient", "compute the gradients on the mesh")


def check_state(opt_state: Any, plan: Zero1Plan) -> None:
  """Refuses optimizer state that lives on another mesh than the optimizer's.

  State on the right mesh but another layout (e.g. restored replicated) is
  fine: ``update`` re-places it onto the plan. State from another mesh must be
  restored onto this one, e.g. with ``nnx_zero1.abstract_state(opt)`` as the
  orbax target.
  """
  fix = "restore it onto this mesh, e.g. with nnx_zero1.abstract_state(optimizer) as the orbax target"
  _check_devices(opt_state, plan.mesh, "optimizer state", fix)
  expected = (tuple(plan.mesh.axis_names), tuple(plan.mesh.axis_sizes))
  for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
    mesh = mesh_of(leaf)
    if mesh is not None and (tuple(mesh.axis_names), tuple(mesh.axis_sizes)) != expected:
      raise Zero1Error(
          f"optimizer state {jax.tree_util.keystr(path)} lives on a mesh with shape "
          f"{dict(mesh.shape)}, but this optimizer was built for {describe_mesh(plan.mesh)}; {fix}"
      )


def check_strict(plan: Zero1Plan) -> None:
  """With ``strict=True``: refuses any parameter-shaped leaf that stays replicated.

  Those are the leaves no dimension of which divides by the data-axis size.
  State that does not follow a parameter's shape (step counters, Muon's
  Newton-Schulz coefficients, adafactor's factored statistics) is not counted;
  ``report`` lists it with its reason.
  """
  left = [leaf for leaf in plan.state_leaves if leaf.reason == Reason.NOT_DIVISIBLE]
  if left:
    names = ", ".join(f"{leaf.path} {leaf.dtype}{list(leaf.shape)} ({leaf.reason})" for leaf in left)
    raise Zero1Error(
        f"strict=True, but these optimizer leaves cannot be split over "
        f"{plan.data_axis}: {names}; drop strict=True to keep them whole (report() lists them), or choose a "
        f"data-parallel size that divides them; {describe_mesh(plan.mesh)}"
    )
