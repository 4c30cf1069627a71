"""What the plan compiles for: a TPU slice (libtpu) or NVIDIA GPUs (XLA's GPU compiler), deviceless.

A :class:`Target` holds the topology's devices, which compile but never run,
and the memory a program may use on one of them, as the compiler reports it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

from nnx_zero1_plan import compilers
from nnx_zero1_plan.gpu_chips import GPU_CHIPS, target_config
from nnx_zero1_plan.inputs import PlanError, parse_topology

__all__ = ["Target", "GPU_SCHEDULER_FRACTION", "make_target", "require_compiler"]

# XLA's GPU compiler schedules for 80% of the device memory (its "base limit", which it names when a
# program's arguments exceed it); jax's GPU client preallocates XLA_PYTHON_CLIENT_MEM_FRACTION (0.75).
GPU_SCHEDULER_FRACTION = 0.8
_JAX_GPU_POOL_FRACTION = 0.75


@dataclasses.dataclass(frozen=True)
class Target:
  """A topology to compile for: its devices and the memory a program may use on one."""

  name: str
  platform: str  # "tpu" or "cuda"
  devices: tuple[Any, ...]
  hbm_bytes: int
  hbm_source: str

  @property
  def device_kind(self) -> str:
    """jax's name for the chip (``"TPU v6 lite"``, ``"NVIDIA H100 80GB HBM3"``)."""
    return self.devices[0].device_kind


def require_compiler(topology: str) -> str:
  """The compiler's name and version for ``topology``; raises naming what to install when it is missing.

  Raises:
    PlanError: the topology is not one the planner knows.
    compilers.AotUnavailable: its compiler is not installed (the message names the install command).
  """
  platform, _, _ = parse_topology(topology, GPU_CHIPS)
  if platform == "tpu":
    return f"libtpu {compilers.require_libtpu()}"
  return f"jax-cuda13-plugin {compilers.require_cuda_plugin()}"


def _tpu_devices(topology: str) -> tuple[Any, ...]:
  from jax.experimental import topologies

  try:
    return tuple(topologies.get_topology_desc(topology_name=topology, platform="tpu").devices)
  except Exception as e:  # libtpu's own refusal, in its words
    raise PlanError(f"libtpu does not know topology {topology!r}: {str(e).splitlines()[0]}") from e


def _gpu_devices(chip: str, nodes: int, per_node: int) -> tuple[Any, ...]:
  from jax.experimental import topologies

  desc = topologies.get_topology_desc(platform="cuda", target_config=target_config(GPU_CHIPS[chip]),
                                      topology=f"1x{nodes}x{per_node}")
  return tuple(desc.devices)


@functools.cache
def _tpu_usable_bytes(topology: str) -> int:
  """The HBM a program may use on one chip, from the TPU compiler's refusal of one that cannot fit."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  from nnx_zero1_plan.compiled import hbm_oom

  devices = _tpu_devices(topology)[:1]
  huge = jax.ShapeDtypeStruct((2**40,), jnp.int8, sharding=NamedSharding(Mesh(np.array(devices), ("x",)),
                                                                         PartitionSpec()))
  try:
    jax.jit(lambda x: x + 1).lower(huge).compile()
  except jax.errors.JaxRuntimeError as e:
    oom = hbm_oom(str(e))
    if oom and oom["available_bytes"]:
      return oom["available_bytes"]
    raise
  raise PlanError(f"the TPU compiler accepted a 1 TiB program for {topology}; cannot read its usable HBM")


def _gpu_usable_bytes(chip: str) -> tuple[int, str]:
  total = GPU_CHIPS[chip].memory_bytes
  pool = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", _JAX_GPU_POOL_FRACTION))
  fraction = min(GPU_SCHEDULER_FRACTION, pool)
  source = (f"{fraction:.0%} of the {total:,} B device memory: the smaller of XLA's GPU scheduler "
            f"limit ({GPU_SCHEDULER_FRACTION:.0%}) and jax's GPU memory pool "
            f"(XLA_PYTHON_CLIENT_MEM_FRACTION={pool})")
  return int(total * fraction), source


def make_target(topology: str) -> Target:
  """The target ``topology`` names, its devices and usable memory per device (the compiler loaded).

  Raises:
    PlanError: the topology is unknown (to the planner, or to libtpu).

  Example::

    target = make_target("h100:2x8")   # 16 H100s on two nodes, deviceless
  """
  platform, chip, shape = parse_topology(topology, GPU_CHIPS)
  if platform == "tpu":
    devices = _tpu_devices(topology)
    hbm = _tpu_usable_bytes(topology)
    source = "the TPU compiler's available HBM (its out-of-memory message)"
    return Target(topology, platform, devices, hbm, source)
  hbm, source = _gpu_usable_bytes(chip)
  return Target(topology, platform, _gpu_devices(chip, *shape), hbm, source)
