"""Whether a Tunix trainer splits its batch over the mesh's data axes, in its inputs and in its activations.

Two Tunix defaults are right on Tunix's own ``("fsdp", "tp")`` mesh and wrong, without any error, on a
mesh with a ``data`` axis: ``TrainingConfig.data_sharding_axis`` (``("fsdp",)``: each data replica
would train on the whole batch, and Zero-1 would split the optimizer state over nothing) and the model
config's ``ShardingConfig``, whose activations' batch entry names ``fsdp`` only (on accelerators each
data replica would compute its ``fsdp`` group's whole batch; Tunix applies these constraints on
accelerators only, so a CPU run shows neither). Both are refused here, before the trainer is built.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from nnx_zero1._src.errors import Zero1Error, describe_mesh
from nnx_zero1._src.mesh import current_mesh, mesh_of

__all__ = ["DATA_PARALLEL_AXES", "batch_axis_names", "batch_mesh", "check_activations_follow_the_batch",
           "check_batch_over_data_axes", "check_trained_batch"]

# The mesh axes that split the batch wherever they are: a pod's replicas, Zero-1's default data axis, and
# FSDP's axis (FSDP is data parallelism with the weights split too; Tunix's own default batch axis).
DATA_PARALLEL_AXES = ("replica", "data", "fsdp")
# The ShardingConfig fields whose first entry is the activations' batch (Tunix's llama3, qwen3, gemma...).
ACTIVATION_FIELDS = ("act_btd", "act_btf", "act_btnh")


def _names(entry: Any) -> tuple[str, ...]:
  """The axis names of one PartitionSpec-style entry: a name, a tuple of names, or None."""
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(a for a in entry if a is not None)


def batch_axis_names(data_sharding_axis: Any) -> tuple[str, ...]:
  """Every axis name in Tunix's ``data_sharding_axis``, in order, each once (none: an empty tuple).

  Example::

    >>> batch_axis_names(("fsdp",)), batch_axis_names((("data", "fsdp"),)), batch_axis_names(None)
    (('fsdp',), ('data', 'fsdp'), ())
  """
  entries = (data_sharding_axis,) if isinstance(data_sharding_axis, str) else tuple(data_sharding_axis or ())
  return tuple(dict.fromkeys(a for e in entries for a in _names(e)))


def _in_mesh_order(mesh: Mesh, names: Any) -> tuple[str, ...]:
  return tuple(a for a in mesh.axis_names if a in set(names))


def check_batch_over_data_axes(mesh: Mesh, data_sharding_axis: Any) -> None:
  """Refuses a mesh whose data-parallel axes of size > 1 the batch is not split over.

  Raises:
    Zero1Error: an axis of ``DATA_PARALLEL_AXES`` on ``mesh``, of size > 1, is not in
      ``data_sharding_axis``; the message gives the ``data_sharding_axis`` that splits the batch over it.

  Example::

    >>> import jax
    >>> mesh = jax.sharding.Mesh(jax.devices()[:1], ("fsdp",))
    >>> check_batch_over_data_axes(mesh, ("fsdp",))  # Tunix's own mesh and default: nothing to say
  """
  batch = batch_axis_names(data_sharding_axis)
  missing = [a for a in DATA_PARALLEL_AXES if mesh.shape.get(a, 1) > 1 and a not in batch]
  if not missing:
    return
  fix = (_in_mesh_order(mesh, (*missing, *batch)),)
  raise Zero1Error(
      f"training_config.data_sharding_axis={data_sharding_axis!r} does not split the batch over the "
      f"data-parallel axis {missing[0]!r} (size {mesh.shape[missing[0]]}) of the {describe_mesh(mesh)}: each "
      f"replica along it would train on the whole batch, and Zero-1, which splits the optimizer state over "
      f"the batch's axes, would save nothing there; set data_sharding_axis={fix!r}"
  )


def _sharding_configs(model: Any) -> list[Any]:
  """The ``ShardingConfig`` s with activation fields that ``model`` (or a module in it) carries: Tunix's
  models keep one as ``config.shd_config`` and in each layer as ``shd_config`` (qwix's LoRA keeps both)."""
  found: list[Any] = []
  owners = [model] if not isinstance(model, nnx.Module) else [m for _, m in nnx.iter_graph(model)
                                                              if isinstance(m, nnx.Module)]
  for owner in owners:
    model_config = getattr(owner, "config", None)
    for config in (getattr(model_config, "shd_config", None), getattr(owner, "shd_config", None)):
      if any(hasattr(config, f) for f in ACTIVATION_FIELDS) and all(config is not c for c in found):
        found.append(config)
  return found


def check_activations_follow_the_batch(model: Any, mesh: Mesh, data_sharding_axis: Any) -> None:
  """Refuses a model whose ``ShardingConfig`` puts the activations' batch without an axis of size > 1 that
  the batch is split over.

  On Tunix's own mesh with its defaults (batch and activations over ``fsdp``) this says nothing; a model
  with no ``ShardingConfig`` (any non-Tunix model) is not checked.

  Raises:
    Zero1Error: an ``act_btd``, ``act_btf`` or ``act_btnh`` batch entry lacks such an axis; the message
      gives the entry that has them.

  Example::

    >>> import jax
    >>> from flax import nnx
    >>> mesh = jax.sharding.Mesh(jax.devices()[:1], ("data",))
    >>> check_activations_follow_the_batch(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), mesh, ("data",))
  """
  split = [a for a in batch_axis_names(data_sharding_axis) if mesh.shape.get(a, 1) > 1]
  for config in _sharding_configs(model):
    for field in ACTIVATION_FIELDS:
      spec = getattr(config, field, None)
      entry = spec[0] if spec else None
      missing = [a for a in split if a not in _names(entry)]
      if not missing:
        continue
      batch = _in_mesh_order(mesh, (*split, *_names(entry)))
      raise Zero1Error(
          f"{type(model).__name__}'s ShardingConfig puts the activations' batch over {entry!r} "
          f"({field}={spec!r}), without {missing[0]!r}, which the batch is split over "
          f"(training_config.data_sharding_axis={data_sharding_axis!r}) on the {describe_mesh(mesh)}: "
          f"on accelerators each replica along {missing[0]!r} would compute the rows of all "
          f"{mesh.shape[missing[0]]}. Build "
          f"the model with a config whose act_btd, act_btf and act_btnh batch entry is {batch!r}: "
          f"shd_config=dataclasses.replace(shd, act_btd=({batch!r}, *shd.act_btd[1:]), "
          f"act_btf=({batch!r}, *shd.act_btf[1:]), act_btnh=({batch!r}, *shd.act_btnh[1:]))"
      )


def batch_mesh(models: list[Any]) -> Mesh | None:
  """The mesh a trainer splits its batch over: the current one, else the one the models' arrays are placed
  on (None: neither, or several)."""
  modules = [m for m in models if isinstance(m, nnx.Module)]
  placed = {mesh_of(x) for m in modules for x in jax.tree.leaves(nnx.as_pure(nnx.state(m)))} - {None}
  mesh = current_mesh() or (placed.pop() if len(placed) == 1 else None)
  return mesh if isinstance(mesh, Mesh) else None


def check_trained_batch(trained: list[tuple[Mesh, list[Any]]], data_sharding_axis: Any) -> None:
  """Both refusals, for each mesh and the models that compute on its batch."""
  for mesh, models in trained:
    check_batch_over_data_axes(mesh, data_sharding_axis)
    for model in models:
      check_activations_follow_the_batch(model, mesh, data_sharding_axis)
