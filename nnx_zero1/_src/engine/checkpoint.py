"""The engine's checkpoint: one orbax tree, the same for ``Engine`` and ``Zero1Engine``.

``{"params", "optimizer", "grad_acc", "micro_steps"}``: parameters and optimizer
state as pure dicts (the same paths, shapes and dtypes with and without Zero-1),
the per-replica gradient accumulator and the number of micro-batches in it.
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
from nnx_zero1._src.engine import rows as replica_rows

__all__ = ["make_manager", "restore", "fold_rows"]


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


def restore(manager: ocp.CheckpointManager, step: int, live: dict, mesh: Mesh) -> tuple[dict, int]:
  """Reads ``step`` onto the layouts of the ``live`` tree; returns it and the saved accumulator's rows.

  When the checkpoint was written at another data-parallel size its
  accumulator has another number of rows; it is then read replicated, for
  ``fold_rows``.

  Example::

    tree, saved_rows = restore(manager, step, live_tree, mesh)
  """
  target = abstract_arrays(live, mesh)
  saved_rows = jax.tree.leaves(manager.item_metadata(step)["grad_acc"])[0].shape[0]
  live_rows = jax.tree.leaves(live["grad_acc"])[0].shape[0]
  if saved_rows != live_rows:
    replicated = NamedSharding(mesh, P())
    target["grad_acc"] = jax.tree.map(
        lambda t: jax.ShapeDtypeStruct((saved_rows, *t.shape[1:]), t.dtype, sharding=replicated),
        target["grad_acc"],
    )
  return manager.restore(step, args=ocp.args.StandardRestore(target)), saved_rows


def fold_rows(grad_acc: Any, params: Any, mesh: Mesh, axes: tuple[str, ...]) -> Any:
  """An accumulator with any number of rows, summed into row 0 of one with this mesh's rows.

  Example::

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> w = {"w": jax.device_put(jnp.ones(2), NamedSharding(mesh, P()))}
    >>> fold_rows({"w": jnp.ones((3, 2))}, w, mesh, ("data",))["w"].tolist()
    [[3.0, 3.0]]
  """
  zeros = replica_rows.zeros_accumulator(params, mesh, axes)
  summed = jax.tree.map(lambda a: a.sum(0), grad_acc)
  homes = [x.sharding for x in jax.tree.leaves(params)]
  return replica_rows.add_to_first_row(zeros, summed, homes, mesh, axes)
