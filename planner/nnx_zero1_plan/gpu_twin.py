"""A one-GPU step timed by its twin: the same step compiled for two GPUs of the same kind, every array
replicated over a mesh axis of size 2 that nothing shards, so each GPU does exactly the one GPU's work, with a
4-byte all-reduce beside it and one in each micro-batch's loss.

XLA's GPU scheduler prices instructions only in a computation that holds an asynchronous collective (its
latency-hiding scheduler passes over the others), so for a program on one GPU it writes no estimates. The
twin's kernels are the one GPU's, shape for shape (docs/accuracy.md): their estimates are given to the one
GPU's program kernel for kernel (:func:`as_scheduled`), which is walked, run and calibrated as itself. The
twin's memory figures are never used.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from nnx_zero1._src.companion import Instruction
from nnx_zero1_plan.gpu_schedule import dumped_schedule
from nnx_zero1_plan.levers import Lever
from nnx_zero1_plan.program_record import ProgramRecord
from nnx_zero1_plan.step_time import launches_kernel
from nnx_zero1_plan.steps import StepShape, abstract_batch, lever_state, step_jit
from nnx_zero1_plan.targets import Target, gpu_devices

TWIN_AXIS = "twin"
_LAYOUT = re.compile(r"\{[^}]*\}")


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
  """The one-program step's twin for ``mesh`` (one GPU of ``target``) compiled: its record and its scheduler's
  estimates (:func:`~nnx_zero1_plan.gpu_schedule.scheduled_seconds`)."""
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
    return ProgramRecord.read(compiled.as_text()), read()


def _twin_all_reduce(x: jax.Array) -> jax.Array:
  """Zero, from an all-reduce of ``x`` (a scalar, replicated) over :data:`TWIN_AXIS`: in a manual region,
  where it changes no other array's layout (XLA does not fold a float's product with zero)."""
  summed = jax.shard_map(lambda v: jax.lax.psum(jax.lax.pcast(v, TWIN_AXIS, to="varying"), TWIN_AXIS),
                         in_specs=PartitionSpec(), out_specs=PartitionSpec())
  return 0.0 * summed(x.astype(jnp.float32))


def as_scheduled(one: ProgramRecord, twin: ProgramRecord, scheduled: Mapping[str, Mapping[str, float]]
                 ) -> dict[str, dict[str, float]]:
  """The twin's estimates (``scheduled``) given to the one GPU's program ``one``, kernel for kernel:
  ``{one's module: {instruction: seconds}}``. Kernels pair by op, result and fused work, then those left by op
  and first result (a kernel of ``one`` may also write a copy of a weight that its order needs); any other is
  left unestimated."""
  own = dict(scheduled.get(twin.module or "", {}))
  priced: dict[str, float] = {}
  for key in (_kernel, _loosely):
    waiting: dict[Any, list[str]] = {}
    for i in _kernels(twin):
      if i.name in own:
        waiting.setdefault(key(twin, i), []).append(i.name)
    for i in _kernels(one):
      if i.name not in priced and waiting.get(k := key(one, i)):
        priced[i.name] = own.pop(waiting[k].pop(0))
  return {one.module or "": priced}


def _kernels(record: ProgramRecord) -> Iterator[Instruction]:
  """The instructions a step runs one by one: the entry's and its loops' and calls', but their own."""
  def walk(name: str) -> Iterator[Instruction]:
    for i in record.computations.get(name, ()):
      if i.op in ("while", "call", "conditional"):
        for call in i.calls:
          yield from walk(call.computation)
      elif launches_kernel(i):
        yield i

  return walk(record.entry or "")


def _shape(shape: str) -> str:
  return _LAYOUT.sub("", shape)


def _kernel(record: ProgramRecord, i: Instruction) -> tuple[str, ...]:
  fused = (j for c in i.calls if c.kind == "calls" for j in record.computations[c.computation])
  return (i.op, _shape(i.shape), *(f"{j.op} {_shape(j.shape)}" for j in fused))


def _loosely(record: ProgramRecord, i: Instruction) -> tuple[str, str]:
  return i.op, _shape(i.shape).lstrip("(").split(", ")[0].rstrip(")")
