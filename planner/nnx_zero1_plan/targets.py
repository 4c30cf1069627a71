"""What the plan compiles for: a TPU slice (libtpu) or NVIDIA GPUs (XLA's GPU compiler), deviceless."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from nnx_zero1_plan import compilers
from nnx_zero1_plan.gpu_chips import GPU_CHIPS, JAX_GPU_POOL_FRACTION, target_config
from nnx_zero1_plan.inputs import BACKENDS, ONE_SLICE, Backend, PlanError, Topology, parse_topology
from nnx_zero1_plan.local_chips import LocalDevices, not_the_target

# XLA's GPU compiler schedules a program for the device memory it is told, deviceless for 80% of the target's
# device_memory_size: a GPU is described with device_memory_size = pool / 0.8 (measured: docs/accuracy.md).
GPU_SCHEDULER_FRACTION = 0.8
# What the CUDA context holds before jax's pool (an H200 with jax 0.11.2: 150,754,820,096 B total, pool
# 112,583,507,968 B at JAX_GPU_POOL_FRACTION 0.75).
CUDA_CONTEXT_BYTES = 643_476_139


@dataclasses.dataclass(frozen=True)
class Target:
  """A topology to compile for: its devices (compile-only, or this process's own: :func:`local_target`) and
  the memory a program may use on one, as the compiler or the allocator reports it."""

  name: str
  platform: str  # "tpu" or "cuda"
  chip: str  # as the planner names it ("v5p", "h100")
  devices: tuple[Any, ...]
  hbm_bytes: int
  hbm_source: str

  @property
  def device_kind(self) -> str:
    """jax's name for the chip (``"TPU v6 lite"``, ``"NVIDIA H100 80GB HBM3"``)."""
    return self.devices[0].device_kind

  @property
  def backend(self) -> Backend:
    """What a plan reads of the platform (:data:`~nnx_zero1_plan.inputs.BACKENDS`)."""
    return BACKENDS[self.platform]

  @property
  def domains(self) -> int:
    """The slices (TPU) or nodes (GPU) the devices sit in, joined by the slow network."""
    return len({self.domain_of(d) for d in self.devices})

  def domain_of(self, device: Any) -> int:
    """The slice or node ``device`` sits in (:attr:`~nnx_zero1_plan.inputs.Backend.domain_index`)."""
    return getattr(device, self.backend.domain_index, 0)


def usable_bytes(hbm_bytes: int, backend: Backend, margin: float | None = None) -> int:
  """What a step may use per device: ``hbm_bytes`` less the margin (a share), or by default less the
  ``backend``'s reserve."""
  if margin is not None:
    return int(hbm_bytes * (1 - margin))
  return hbm_bytes - backend.reserve_bytes


def require_compiler(backend: Backend) -> str:
  """The name and version of ``backend``'s compiler; :class:`~nnx_zero1_plan.compilers.AotUnavailable`, naming
  the install command, where it is not installed."""
  return f"{backend.compiler} {compilers.require(backend.compiler)}"


def _tpu_devices(topology: str, slices: int = ONE_SLICE) -> tuple[Any, ...]:
  from jax.experimental import topologies

  try:
    desc = topologies.get_topology_desc(topology_name=topology, platform="tpu", num_slices=slices)
    return tuple(desc.devices)
  except Exception as e:  # libtpu's own refusal, in its words
    raise PlanError(f"libtpu does not know topology {topology!r}: {str(e).splitlines()[0]}") from e


def _gpu_devices(chip: str, nodes: int, per_node: int, pool: int) -> tuple[Any, ...]:
  from jax.experimental import topologies

  described = dataclasses.replace(GPU_CHIPS[chip], memory_bytes=int(pool / GPU_SCHEDULER_FRACTION))
  desc = topologies.get_topology_desc(platform="cuda", target_config=target_config(described),
                                      topology=f"1x{nodes}x{per_node}")
  return tuple(desc.devices)


def gpu_pool_bytes(chip: str, fraction: float = JAX_GPU_POOL_FRACTION) -> int:
  """jax's GPU memory pool on ``chip`` at ``XLA_PYTHON_CLIENT_MEM_FRACTION=fraction``: what a program may use
  (on an H200, 112,583,507,968 B measured)."""
  return int(fraction * (GPU_CHIPS[chip].memory_bytes - CUDA_CONTEXT_BYTES))


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
  except Exception as e:  # any refusal is read, or said in one line: never a traceback
    oom = hbm_oom(str(e))
    if oom and oom.available_bytes:
      return oom.available_bytes
    first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
    raise PlanError(f"cannot read the usable HBM of {topology} from the TPU compiler's refusal of a 1 TiB "
                    f"program: {first[:300]}") from e
  raise PlanError(f"the TPU compiler accepted a 1 TiB program for {topology}; cannot read its usable HBM")


def local_target(topology: str, parsed: Topology, slices: int = ONE_SLICE) -> Target:
  """``topology``'s chips (``parsed``: it parsed) where they are this process's own devices
  (``jax.devices()``), compiled for and run on as they are; the memory a program may use is the allocator's
  ``bytes_limit`` on the first. :class:`PlanError` where they are not the topology's chips."""
  import jax

  platform, chip, _ = parsed
  devices = tuple(jax.devices())
  why = not_the_target(LocalDevices.of(devices), topology, parsed, slices)
  if why:
    raise PlanError(f"cannot compile for this machine's devices: {why}")
  limit = (devices[0].memory_stats() or {}).get("bytes_limit")
  if limit is None:
    raise PlanError(f"this machine's {devices[0].device_kind} reports no bytes_limit in memory_stats()")
  return Target(topology, platform, chip, devices, int(limit),
                "the local device's allocator (memory_stats()'s bytes_limit)")


def make_target(topology: str, gpu_memory_fraction: float = JAX_GPU_POOL_FRACTION, slices: int = ONE_SLICE, *,
                parsed: Topology | None = None, local: bool = False) -> Target:
  """The target ``topology`` names (``v5e:2x4``, ``h100:2x8``), its devices and usable memory per device, the
  compiler loaded; :class:`PlanError` where the planner or libtpu does not know it.

  ``gpu_memory_fraction`` is the ``XLA_PYTHON_CLIENT_MEM_FRACTION`` a GPU run will use, the pool the compiler
  plans for; ``slices``, TPU slices joined over the data-center network; ``local``, the chips are this
  process's own devices (:func:`local_target`).

  Example::

    target = make_target("v5e:2x4", slices=2)   # two 8-chip slices joined over the data-center network
  """
  platform, chip, shape = parsed = parsed or parse_topology(topology, GPU_CHIPS)
  if local:
    return local_target(topology, parsed, slices)
  if not parsed.backend.pool_fraction:  # the memory a program may use is the compiler's own figure
    return Target(topology, platform, chip, _tpu_devices(topology, slices), _tpu_usable_bytes(topology),
                  "the TPU compiler's available HBM (its out-of-memory message)")
  pool = gpu_pool_bytes(chip, gpu_memory_fraction)
  source = (f"jax's GPU memory pool at XLA_PYTHON_CLIENT_MEM_FRACTION={gpu_memory_fraction}: that share of "
            f"the {GPU_CHIPS[chip].memory_bytes:,} B device memory less the CUDA context; the compiler "
            f"schedules for it")
  nodes, per_node = shape
  return Target(topology, platform, chip, _gpu_devices(chip, nodes, per_node, pool), pool, source)
