"""NVIDIA chips as XLA's GPU compiler sees them, for a deviceless compile (from the chip table's figures)."""

from __future__ import annotations

from nnx_zero1_plan.chips import CHIPS, GpuChip

# jax's GPU client takes XLA_PYTHON_CLIENT_MEM_FRACTION (default 0.75) of the memory free when it starts: the
# pool a GPU target is described to its compiler with, and --gpu-memory-fraction's default.
JAX_GPU_POOL_FRACTION = 0.75

# The GPUs among the chips, by the planner's name for each (``h100``): the topologies it compiles for.
GPU_CHIPS: dict[str, GpuChip] = {name: chip.gpu for name, chip in CHIPS.items() if chip.gpu is not None}


def target_config(chip: GpuChip) -> str:
  """``chip`` (one of :data:`GPU_CHIPS`) as XLA's ``GpuTargetConfig`` text proto (CUDA 13 runtime, cuDNN 9.7),
  for ``get_topology_desc(platform="cuda", target_config=...)``."""
  major, minor = chip.compute_capability
  info = (f"threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152 "
          f"shared_memory_per_core: {chip.shared_memory_per_core} threads_per_core_limit: 2048 "
          f"core_count: {chip.core_count} fpus_per_core: {chip.fpus_per_core} block_dim_limit_x: 2147483647 "
          f"block_dim_limit_y: 65535 block_dim_limit_z: 65535 memory_bandwidth: {chip.memory_bandwidth} "
          f"l2_cache_size: {chip.l2_cache_bytes} clock_rate_ghz: {chip.clock_rate_ghz} "
          f"device_memory_size: {chip.memory_bytes} "
          f"shared_memory_per_block_optin: {chip.shared_memory_per_block_optin} "
          f"cuda_compute_capability {{ major: {major} minor: {minor} }} registers_per_core_limit: 65536 "
          f"registers_per_block_limit: 65536")
  return (f'gpu_device_info {{ {info} }} platform_name: "CUDA" dnn_version_info {{ major: 9 minor: 7 }} '
          f'runtime_version {{ major: 13 minor: 0 patch: 0 }} device_description_str: "{chip.description}"')
