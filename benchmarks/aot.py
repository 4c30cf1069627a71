"""Ahead of time: the bench's train steps compiled for a TPU topology on a machine without one.

``python -m benchmarks.bench --aot v6e:2x2 --model qwen3-0.6b --dp 4 --ga 8``
builds each arm's model, optimizer and batch abstractly (``nnx.eval_shape``,
``jax.ShapeDtypeStruct`` on a mesh of the topology's devices), lowers the very
step the CPU bench runs (the planner's, :func:`benchmarks.run.train_step_jit`) and
compiles it with the real TPU compiler (libtpu). Nothing runs: the numbers are
the compiler's per-device memory plan and the collectives of the TPU HLO.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh

from benchmarks import measure
from benchmarks.model import loss_fn
from benchmarks.run import batch_sharding, state_shardings
from benchmarks.settings import OPTIMIZERS, STEP_ARMS, Settings, lever, make_optimizer, new_model, row_fields
from nnx_zero1.testing import collectives, host_transfers, loop_collectives, loop_host_transfers
from nnx_zero1_plan import (
  AbstractState,
  abstract_bytes_per_device,
  bytes_by_memory_kind,
  compile_step,
  hbm_oom,
  split_memory,
  summed,
  with_state_homes,
)
from nnx_zero1_plan import compile_split as planner_compile_split

__all__ = ["HBM_BYTES", "topology_mesh", "abstract_bytes_per_device", "AbstractArm", "compile_arm",
           "compile_split", "aot_row", "hbm_oom", "oom_row", "run_aot"]

# HBM per chip by jax's device_kind (public spec sheets); the "fits" column compares against it.
HBM_BYTES = {
    "TPU v4": 32 * 2**30,
    "TPU v5 lite": 16 * 2**30,
    "TPU v5": 95 * 2**30,
    "TPU v5p": 95 * 2**30,
    "TPU v6 lite": 32 * 2**30,
    "TPU v6e": 32 * 2**30,
}


def topology_mesh(topology: str, dp: int) -> Mesh:
  """A one-axis ``"data"`` mesh (Explicit) over ``dp`` devices of a TPU topology that compile but never run.

  Example::

    mesh = topology_mesh("v6e:2x2", 4)   # 4 TPU v6e devices, in a CPU-only process

  Raises:
    ValueError: the topology has fewer than ``dp`` devices.
  """
  from jax.experimental import topologies

  devices = topologies.get_topology_desc(topology_name=topology, platform="tpu").devices
  if len(devices) < dp:
    raise ValueError(f"--dp {dp} needs {dp} devices; topology {topology} has {len(devices)}")
  return Mesh(np.array(devices[:dp]), ("data",), axis_types=(AxisType.Explicit,))


@dataclasses.dataclass
class AbstractArm:
  """One step arm, abstract: its split (model, optimizer), the state's shardings and a batch shape."""

  name: str
  graphdef: Any
  state: Any  # ShapeDtypeStructs with shardings
  shardings: Any
  batch: jax.ShapeDtypeStruct
  opt_state_bytes: int
  param_bytes: int  # the whole model's, unsharded
  opt_state_bytes_by_memory_kind: dict[str, int] = dataclasses.field(default_factory=dict)

  @property
  def opt_state_device_bytes(self) -> int:
    """The optimizer-state bytes one device keeps in its own memory (all of it unless offloaded)."""
    return self.opt_state_bytes_by_memory_kind.get("device", self.opt_state_bytes)


def abstract_arm(name: str, settings: Settings, mesh: Mesh, ga: int) -> AbstractArm:
  """The arm's model, optimizer and one step's tokens as shapes on ``mesh``; no memory used.

  Example::

    arm = abstract_arm("zero1", Settings(model="qwen3-0.6b"), topology_mesh("v6e:2x2", 4), ga=8)
  """
  if name not in STEP_ARMS:
    raise ValueError(f"--aot compiles the single-step arms {tuple(STEP_ARMS)}; got {name!r}")

  def build():
    model = new_model(settings, mesh)
    return model, make_optimizer(name, model, OPTIMIZERS[settings.optimizer](), mesh)

  with jax.set_mesh(mesh):
    model, optimizer = nnx.eval_shape(build)
  graphdef, state = nnx.split((model, optimizer))
  shardings = with_state_homes(state_shardings(state, mesh), optimizer)
  state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)
  deferred = STEP_ARMS[name][1]
  seq = (settings.seq_len or settings.config.seq_len) + 1
  shape = (ga * settings.batch, seq) if deferred else (ga, settings.batch, seq)
  batch = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=batch_sharding(mesh, deferred))
  params = nnx.state(model, nnx.Param)
  return AbstractArm(
      name=name, graphdef=graphdef, state=state, shardings=shardings, batch=batch,
      opt_state_bytes=abstract_bytes_per_device(nnx.state(optimizer)),
      param_bytes=sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(params)),
      opt_state_bytes_by_memory_kind=bytes_by_memory_kind(state[1]),
  )


def _planner_args(arm: AbstractArm, ga: int) -> tuple[Any, ...]:
  """The planner's compile arguments for the arm: its lever, state, the bench's loss, micro-batch rows
  and tokens per sequence (the arm's batch is (ga, rows, seq + 1), or (ga * rows, seq + 1))."""
  *lead, length = arm.batch.shape
  rows = int(np.prod(lead)) // ga
  state = AbstractState(arm.graphdef, arm.state, arm.shardings, None)
  return lever(arm.name), state, loss_fn, rows, length - 1


def compile_arm(arm: AbstractArm, mesh: Mesh, ga: int) -> tuple[Any, float]:
  """Compiles the arm's train step (the planner's one-program step) for the mesh's devices; returns
  (compiled, seconds)."""
  arm_lever, state, loss, rows, length = _planner_args(arm, ga)
  return compile_step(arm_lever, state, loss, mesh, rows, length, ga)


def compile_split(arm: AbstractArm, mesh: Mesh, ga: int) -> tuple[Any, Any, float]:
  """Compiles the arm's step as two programs (the planner's split step); returns (grads, update, seconds)."""
  arm_lever, state, loss, rows, length = _planner_args(arm, ga)
  return planner_compile_split(arm_lever, state, loss, mesh, rows, length, ga)


def aot_row(arm: AbstractArm, compiled: Any, compile_s: float, dp: int, ga: int, settings: Settings,
            topology: str) -> dict[str, Any]:
  """bench.json's row for one compiled arm: the CPU rows' fields, ``compiled_for``, no timing.

  ``peak_bytes_per_device`` is argument + output - alias + temp: what the chip
  holds at once while the step runs (for a step compiled as two programs,
  ``compiled`` is the pair and the peak is the larger program's, see
  :func:`split_memory`). ``loop_collectives`` are one trip of the
  micro-batch loop (``collectives`` counts every trip).
  """
  split = isinstance(compiled, tuple)
  if split:
    mem = split_memory(measure.memory(compiled[0]), measure.memory(compiled[1]), arm.opt_state_device_bytes)
  else:
    mem = measure.memory(compiled)
  hlos = [c.as_text() for c in compiled] if split else [compiled.as_text()]
  kind = mesh_device_kind(compiled[0] if split else compiled)
  hbm = HBM_BYTES.get(kind)
  return {
      **row_fields(arm.name, dp, ga, settings, arm.opt_state_bytes, mem),
      "batch": settings.batch,
      "seq_len": settings.seq_len or settings.config.seq_len,
      "compiled_for": topology,
      "device_kind": kind,
      "hbm_bytes": hbm,
      "output_bytes_per_device": mem["output"],
      "alias_bytes_per_device": mem["alias"],
      "fits": None if hbm is None else mem["peak"] <= hbm,
      "programs": 2 if split else 1,
      "compile_s": round(compile_s, 1),
      "collectives": summed([collectives(h) for h in hlos]),
      "loop_collectives": summed([loop_collectives(h) for h in hlos]),
      "param_bytes": arm.param_bytes,
      "opt_state_bytes_by_memory_kind": arm.opt_state_bytes_by_memory_kind,
      "host_argument_bytes_per_device": mem["host_argument"],
      "host_transfers": summed([host_transfers(h) for h in hlos]),
      "loop_host_transfers": summed([loop_host_transfers(h) for h in hlos]),
  }


def oom_row(arm: AbstractArm, oom: Any, dp: int, ga: int, settings: Settings, topology: str,
            kind: str) -> dict[str, Any]:
  """The row of an arm the TPU compiler refused because it does not fit the chip's HBM."""
  return {
      "arm": arm.name, "dp": dp, "ga": ga, "model": settings.model, "optimizer": settings.optimizer,
      "batch": settings.batch, "seq_len": settings.seq_len or settings.config.seq_len,
      "compiled_for": topology, "device_kind": kind, "hbm_bytes": HBM_BYTES.get(kind),
      "opt_state_bytes_per_device": arm.opt_state_bytes, "argument_bytes_per_device": None,
      "output_bytes_per_device": None, "alias_bytes_per_device": None, "temp_bytes_per_device": None,
      "peak_bytes_per_device": None, "fits": False, "hbm_oom": dataclasses.asdict(oom), "compile_s": 0.0,
      "collectives": None, "loop_collectives": None, "param_bytes": arm.param_bytes,
      "opt_state_bytes_by_memory_kind": arm.opt_state_bytes_by_memory_kind,
  }


def mesh_device_kind(compiled: Any) -> str:
  """The device kind a compiled executable was built for (``"TPU v6 lite"`` for v6e)."""
  shardings = jax.tree.leaves(compiled.input_shardings)
  return next(iter(shardings[0].device_set)).device_kind


def run_aot(settings: Settings, topology: str, dp: int, ga: int, arms: Sequence[str],
            tick=None, split_step: bool = False) -> list[dict[str, Any]]:
  """Compiles every arm at one (dp, ga) for ``topology``; one row per arm.

  Example::

    rows = run_aot(Settings(model="tiny", batch=8, seq_len=16), "v6e:2x2", dp=4, ga=2,
                   arms=("baseline", "zero1", "zero1-accum"))
  """
  tick = tick or (lambda: None)
  if settings.batch % dp:
    raise ValueError(f"the global micro-batch of {settings.batch} sequences does not split over dp={dp}")
  mesh = topology_mesh(topology, dp)
  rows = []
  for name in arms:
    arm = abstract_arm(name, settings, mesh, ga)
    start = time.perf_counter()
    try:
      if split_step:
        grads, update, seconds = compile_split(arm, mesh, ga)
        rows.append(aot_row(arm, (grads, update), seconds, dp, ga, settings, topology))
      else:
        compiled, seconds = compile_arm(arm, mesh, ga)
        rows.append(aot_row(arm, compiled, seconds, dp, ga, settings, topology))
    except jax.errors.JaxRuntimeError as e:
      oom = hbm_oom(str(e))
      if oom is None:
        raise
      row = oom_row(arm, oom, dp, ga, settings, topology, mesh.devices.flat[0].device_kind)
      rows.append({**row, "compile_s": round(time.perf_counter() - start, 1)})  # until the refusal
    tick()
  return rows
