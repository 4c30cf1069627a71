"""NVIDIA chips as XLA's GPU compiler sees them: a ``GpuTargetConfig`` text proto per chip.

XLA compiles for a GPU it does not have from this description (deviceless
compilation, ``jax.experimental.topologies.get_topology_desc(platform="cuda",
target_config=...)``). Every figure comes from the chip's public specification
sheet (NVIDIA's data sheets and CUDA's per-compute-capability limits); the
device memory is the total that ``cudaMemGetInfo`` / ``nvidia-smi`` reports for
the part, in bytes.
"""

from __future__ import annotations

import dataclasses

__all__ = ["GpuChip", "GPU_CHIPS", "target_config"]


@dataclasses.dataclass(frozen=True)
class GpuChip:
  """One NVIDIA part's public figures, what XLA's GPU cost model and compiler read."""

  description: str  # the device_kind jax reports for it
  compute_capability: tuple[int, int]
  core_count: int  # streaming multiprocessors
  fpus_per_core: int
  clock_rate_ghz: float
  memory_bytes: int
  memory_bandwidth: int  # bytes per second
  l2_cache_bytes: int
  shared_memory_per_core: int
  shared_memory_per_block_optin: int
  node_gpus: int = 8  # GPUs in the part's standard node (NVIDIA's DGX / HGX boards)


GPU_CHIPS: dict[str, GpuChip] = {
    "a100-80g": GpuChip("NVIDIA A100-SXM4-80GB", (8, 0), 108, 64, 1.41, 81920 * 2**20, 2_039_000_000_000,
                        40 * 2**20, 167936, 166912),
    "h100": GpuChip("NVIDIA H100 80GB HBM3", (9, 0), 132, 128, 1.98, 84_929_347_584, 3_352_320_000_000,
                    50 * 2**20, 233472, 232448),
    "h200": GpuChip("NVIDIA H200", (9, 0), 132, 128, 1.98, 143771 * 2**20, 4_800_000_000_000,
                    50 * 2**20, 233472, 232448),
    "b200": GpuChip("NVIDIA B200", (10, 0), 148, 128, 1.965, 183359 * 2**20, 8_000_000_000_000,
                    126 * 2**20, 233472, 232448),
}


def target_config(chip: GpuChip) -> str:
  """The chip as XLA's ``GpuTargetConfig`` text proto (CUDA 13 runtime, cuDNN 9.7).

  Args:
    chip: one of :data:`GPU_CHIPS`.

  Returns:
    The proto's text, for ``get_topology_desc(platform="cuda", target_config=...)``.

  Example::

    >>> 'device_description_str: "NVIDIA H100 80GB HBM3"' in target_config(GPU_CHIPS["h100"])
    True
  """
  major, minor = chip.compute_capability
  info = (
      f"threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152 "
      f"shared_memory_per_core: {chip.shared_memory_per_core} threads_per_core_limit: 2048 "
      f"core_count: {chip.core_count} fpus_per_core: {chip.fpus_per_core} block_dim_limit_x: 2147483647 "
      f"block_dim_limit_y: 65535 block_dim_limit_z: 65535 memory_bandwidth: {chip.memory_bandwidth} "
      f"l2_cache_size: {chip.l2_cache_bytes} clock_rate_ghz: {chip.clock_rate_ghz} "
      f"device_memory_size: {chip.memory_bytes} "
      f"shared_memory_per_block_optin: {chip.shared_memory_per_block_optin} "
      f"cuda_compute_capability {{ major: {major} minor: {minor} }} registers_per_core_limit: 65536 "
      f"registers_per_block_limit: 65536"
  )
  return (f'gpu_device_info {{ {info} }} platform_name: "CUDA" dnn_version_info {{ major: 9 minor: 7 }} '
          f'runtime_version {{ major: 13 minor: 0 patch: 0 }} device_description_str: "{chip.description}"')
