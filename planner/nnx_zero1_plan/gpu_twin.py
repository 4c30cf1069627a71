"""A one-GPU step timed by its twin: the same step compiled for two GPUs of the same kind, every array
replicated over a mesh axis of size 2 that nothing shards, so each GPU does exactly the one GPU's work, with a
4-byte all-reduce beside it and one in each micro-batch's loss.

XLA's GPU scheduler prices instructions only in a computation that holds an asynchronous collective (its
latency-hiding scheduler passes over the others), so for a program on one GPU it writes no estimates. The
twin's fusions and matmuls are the one GPU's, shape for shape (docs/accuracy.md); they are timed with the
4-byte all-reduces left out. The twin's memory figures are never used.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from nnx_zero1_plan.gpu_schedule import dumped_schedule
from nnx_zero1_plan.levers import Lever
from nnx_zero1_plan.program_record import ProgramRecord
from nnx_zero1_plan.steps import StepShape, abstract_batch, lever_state, step_jit
from nnx_zero1_plan.targets import Target, gpu_devices

TWIN_AXIS = "twin"
_DIMENSIONS = re.compile(r"\[\d")


def needs_twin(target: Target) -> bool:
  """Whether ``target`` is one GPU, whose own programs XLA's scheduler leaves unpriced."""
  return len(target.devices) == 1 and not target.backend.prices_in_cycles


@functools.cache
def twin_devices(chip: str, pool: int) -> tuple[Any, ...]:
  """Two deviceless GPUs, each ``chip`` described to its compiler with the memory ``pool``, as a target's."""
  return gpu_devices(chip, 1, 2, pool)


def twin_mesh(mesh: Mesh, target: Target) -> Mesh:
  """``mesh`` (one GPU's) with :data:`TWIN_AXIS` of size 2 after its axes, on :func:`twin_devices`."""
  devices = np.array(twin_devices(target.chip, target.hbm_bytes)).reshape((*mesh.devices.shape, 2))
  return Mesh(devices, (*mesh.axis_names, TWIN_AXIS), axis_types=(*mesh.axis_types, mesh.axis_types[0]))


def compile_twin(lever: Lever, build: Callable[[], Any], loss_fn: Callable, mesh: Mesh, shape: StepShape,
                 target: Target) -> tuple[ProgramRecord, dict[str, dict[str, float]]]:
  """The one-program step's twin for ``mesh`` (one GPU of ``target``) compiled: its record, with its 4-byte
  all-reduces left out (:func:`without_twin_collective`), and its scheduler's estimates."""
  twin = twin_mesh(mesh, target)
  state = lever_state(lever, build, shape.optimizer, twin)
  tokens = abstract_batch(lever, twin, shape.batch, shape.seq_len, shape.ga)
  # in each micro-batch's loss, so that a loop over micro-batches holds a collective too
  twin_loss = lambda model, tokens: loss_fn(model, tokens) + _twin_all_reduce(tokens[0, 0])
  step = step_jit(state.graphdef, state.shardings, tokens.sharding, lever, twin_loss, shape.ga)

  def twin_step(state: Any, batch: Any) -> Any:
    state, loss = step(state, batch)
    return state, loss + _twin_all_reduce(loss)

  with dumped_schedule() as (options, read), jax.set_mesh(twin):
    compiled: Any = jax.jit(twin_step, donate_argnums=0).lower(state.state, tokens).compile(options)
    return without_twin_collective(ProgramRecord.read(compiled.as_text())), read()


def _twin_all_reduce(x: jax.Array) -> jax.Array:
  """Zero, from an all-reduce of ``x`` (a scalar, replicated) over :data:`TWIN_AXIS`: in a manual region,
  where it changes no other array's layout (XLA does not fold a float's product with zero)."""
  summed = jax.shard_map(lambda v: jax.lax.psum(jax.lax.pcast(v, TWIN_AXIS, to="varying"), TWIN_AXIS),
                         in_specs=PartitionSpec(), out_specs=PartitionSpec())
  return 0.0 * summed(x.astype(jnp.float32))


def without_twin_collective(record: ProgramRecord) -> ProgramRecord:
  """``record`` without the twin's all-reduces of a scalar and the instructions that wait for them.

  Raises:
    ValueError: ``record`` has another collective (it is not a one-GPU step's twin).
  """
  collectives = {i.name: i.shape for body in record.computations.values() for i in body if i.collective}
  if any(_DIMENSIONS.search(shape) for shape in collectives.values()):
    raise ValueError("a one-GPU step's twin holds no collective but its own all-reduces of a scalar")
  waits = lambda i: i.op.endswith("-done") and i.args.split(",")[0].strip().lstrip("%") in collectives
  kept = {name: tuple(i for i in body if i.name not in collectives and not waits(i))
          for name, body in record.computations.items()}
  return dataclasses.replace(record, computations=kept)
