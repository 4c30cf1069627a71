"""The engine's checkpoint: one orbax tree, the same for ``Engine`` and ``Zero1Engine``.

``{"params", "optimizer", "grad_acc", "micro_steps"}``: parameters and optimizer
state as pure dicts (the same paths, shapes and dtypes with and without Zero-1),
the gradient accumulator and the number of micro-batches in it. The
accumulator is one row per replica, or (``shard_accumulator=True``, ZeRO-2) the
summed gradients shaped like the parameters; either restores into the other.
Orbax restores every array onto the layout of the engine's live one.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_zero1._src.checkpoint import abstract_arrays
from tests.support.reference_engine import rows as replica_rows

__all__ = [
    "make_manager", "restore", "fold_rows", "summed_accumulator", "rows_of", "converted_accumulator",
    "conversion",
]


def make_manager(directory: str | os.PathLike) -> ocp.CheckpointManager:
  """An orbax ``CheckpointManager`` for the engine tree, creating ``directory``.

  Example::

    >>> import tempfile
    >>> manager = make_manager(tempfile.mkdtemp())
    >>> manager.latest_step() is None
    True
  """
  return ocp.CheckpointManager(
      os.fspath(os.path.abspath(directory)), options=ocp.CheckpointManagerOptions(create=True),
      item_handlers=ocp.StandardCheckpointHandler(),
  )


def rows_of(accumulator: Any, params: Any) -> int | None:
  """How many per-replica rows an accumulator has; None for a summed (ZeRO-2) one.

  Example::

    >>> import jax.numpy as jnp
    >>> rows_of({"w": jnp.ones((4, 3))}, {"w": jnp.ones(3)}), rows_of({"w": jnp.ones(3)}, {"w": jnp.ones(3)})
    (4, None)
  """
  a, p = jax.tree.leaves(accumulator)[0], jax.tree.leaves(params)[0]
  return a.shape[0] if len(a.shape) == len(p.shape) + 1 else None


def restore(manager: ocp.CheckpointManager, step: int, live: dict, mesh: Mesh) -> tuple[dict, bool]:
  """Reads ``step`` onto the layouts of the ``live`` tree; returns it and whether its accumulator
  needs converting (then it is read replicated, as saved).

  An accumulator saved at another data-parallel size (another number of rows),
  or as rows where the engine keeps it summed (ZeRO-2) or the other way round,
  has other shapes than the live one.

  Example::

    tree, convert = restore(manager, step, live_tree, mesh)
  """
  target = abstract_arrays(live, mesh)
  saved = manager.item_metadata(step)["grad_acc"]
  saved_shapes = [tuple(m.shape) for m in jax.tree.leaves(saved)]
  convert = saved_shapes != [t.shape for t in jax.tree.leaves(target["grad_acc"])]
  if convert:
    replicated = NamedSharding(mesh, P())
    leaves, treedef = jax.tree.flatten(target["grad_acc"])
    target["grad_acc"] = jax.tree.unflatten(treedef, [
        jax.ShapeDtypeStruct(shape, t.dtype, sharding=replicated)
        for t, shape in zip(leaves, saved_shapes, strict=True)
    ])
  return manager.restore(step, args=ocp.args.StandardRestore(target)), convert


def summed_accumulator(grad_acc: Any, params: Any) -> Any:
  """The accumulated gradient sum, from rows (summed over them) or from a summed accumulator.

  Example::

    >>> import jax.numpy as jnp
    >>> summed_accumulator({"w": jnp.ones((3, 2))}, {"w": jnp.ones(2)})["w"].tolist()
    [3.0, 3.0]
  """
  return jax.tree.map(lambda a, p: a.sum(0) if a.ndim == p.ndim + 1 else a, grad_acc, params)


def fold_rows(grad_acc: Any, params: Any, mesh: Mesh, axes: tuple[str, ...]) -> Any:
  """An accumulator with any number of rows (or summed), into row 0 of one with this mesh's rows.

  Example::

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> w = {"w": jax.device_put(jnp.ones(2), NamedSharding(mesh, P()))}
    >>> fold_rows({"w": jnp.ones((3, 2))}, w, mesh, ("data",))["w"].tolist()
    [[3.0, 3.0]]
  """
  zeros = replica_rows.zeros_accumulator(params, mesh, axes)
  summed = summed_accumulator(grad_acc, params)
  homes = [x.sharding for x in jax.tree.leaves(params)]
  return replica_rows.add_to_first_row(zeros, summed, homes, mesh, axes)


def converted_accumulator(saved: Any, params: Any, mesh: Mesh, axes: tuple[str, ...], targets: Any) -> Any:
  """A saved accumulator of another shape as this engine's: the same sum, not the same reduction order.

  Rows saved at another data-parallel size, or a summed (ZeRO-2) accumulator,
  are summed; the sum goes onto ``targets`` (a ZeRO-2 engine's Zero-1 layout,
  shaped like ``params``) or, with ``targets=None``, into row 0 of this mesh's rows.

  Example::

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> w = {"w": jax.device_put(jnp.ones(2), NamedSharding(mesh, P()))}
    >>> converted_accumulator({"w": jnp.ones((3, 2))}, w, mesh, ("data",), None)["w"].tolist()
    [[3.0, 3.0]]
  """
  with jax.set_mesh(mesh):
    if targets is not None:
      return jax.tree.map(jax.device_put, summed_accumulator(saved, params), targets)
    return fold_rows(saved, params, mesh, axes)


def conversion(saved: Any, params: Any, targets: Any, data_size: int) -> str:
  """What :func:`converted_accumulator` does to ``saved``, in words for the log.

  Example::

    >>> import jax.numpy as jnp
    >>> conversion({"w": jnp.ones((4, 2))}, {"w": jnp.ones(2)}, None, 2)
    'accumulator saved with 4 rows, restored with 2; summed into row 0'
  """
  summed = "one summed accumulator (shard_accumulator)"
  saved_rows = rows_of(saved, params)
  was = f"{saved_rows} rows" if saved_rows else summed
  now = summed if targets is not None else f"{data_size}"
  into = "its Zero-1 slices" if targets is not None else "row 0"
  return f"accumulator saved with {was}, restored with {now}; summed into {into}"
