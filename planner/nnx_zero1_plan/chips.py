"""Every chip the planner knows, in one table: each figure its maker's published one (docs/planner.md's
compute table, docs/pods.md's network table) or measured on the chip (``Compute.source``)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Links:
  """One chip's networks: names and bytes per second each way, and where the figures come from; a TPU's one
  ICI link one way, and the axis length whose multiples wrap around (None for a GPU: a switch)."""

  fast: str
  fast_bytes_per_s: float
  slow: str
  slow_bytes_per_s: float
  source: str
  link_bytes_per_s: float | None = None
  wrap_every: int | None = None


@dataclasses.dataclass(frozen=True)
class Compute:
  """One chip's public compute figures: what a step's time and its MFU are measured against.

  ``peak_flops_per_s`` is by the dtype a program computes in (a TPU runs float32 matmuls as bfloat16 passes, a
  GPU on its TF32 tensor cores). A TPU's matrix units' FLOPs per cycle and ICI ports (its network rate is
  shared among them) are None and 0 on a GPU. ``host_bytes_per_s`` (PCIe, per direction) is None where
  neither published nor measured: host copies are then counted, not timed. ``class_clocks_hz`` is the clock
  the TPU compiler's cycles run at by class of work, measured on the chip (``benchmarks.chip_rates``).
  """

  peak_flops_per_s: dict[str, float]
  mxu_flops_per_cycle: int | None
  ports: int
  host_bytes_per_s: float | None
  source: str
  class_clocks_hz: dict[str, float] | None = None

  @property
  def clock_hz(self) -> float | None:
    """The TPU core's clock: the bfloat16 peak over the matrix units' FLOPs per cycle (None for a GPU)."""
    cycle = self.mxu_flops_per_cycle
    return None if cycle is None else self.peak_flops_per_s["bfloat16"] / cycle


@dataclasses.dataclass(frozen=True)
class GpuChip:
  """One NVIDIA part's public figures, what XLA's GPU cost model and compiler read: its data sheet's, CUDA's
  per-compute-capability limits, and the memory ``nvidia-smi`` reports for it, in bytes."""

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


@dataclasses.dataclass(frozen=True)
class Chip:
  """One chip's facts: its platform (``inputs.BACKENDS``' key), networks, compute, and for a GPU what its
  compiler is told."""

  platform: str
  links: Links
  compute: Compute
  gpu: GpuChip | None = None


_GBIT = 1e9 / 8
_MXU = lambda units, side: units * side * side * 2  # FLOPs per cycle of `units` side x side arrays
_TPU = "float32 matmuls run as bfloat16 passes (jax's default precision on TPU)"
# Each TPU's Links' last two: How to Scale Your Model (jax-ml/scaling-book), tpus.md's ICI table after its
# correction (one way: v5e 4.5e10, v6e 9e10, v5p 9e10 bytes/s) and its footnote (wraparound "on inference
# chips when we have a full 16 axis, or on training chips (v*p) when we have an axis which is a multiple
# of 4").

CHIPS: dict[str, Chip] = {
    "v5e": Chip("tpu", Links("ICI", 1600 * _GBIT, "DCN", 200 / 8 * _GBIT, "cloud.google.com/tpu/docs/v5e",
                             4.5e10, 16),
                Compute({"bfloat16": 197e12, "float32": 197e12}, _MXU(4, 128), 4, 14.17e9,
                        f"cloud.google.com/tpu/docs/v5e; {_TPU}; clocks and host link measured on the chip "
                        "(docs/data/device_v5e/run2/chip_rates)",
                        {"matmul-bf16": 1.572e9, "matmul-f32": 1.522e9, "vector": 2.628e9})),
    "v6e": Chip("tpu", Links("ICI", 3200 * _GBIT, "DCN", 800 / 8 * _GBIT, "cloud.google.com/tpu/docs/v6e",
                             9e10, 16),
                Compute({"bfloat16": 918e12, "float32": 918e12}, _MXU(4, 256), 4, None,
                        f"cloud.google.com/tpu/docs/v6e; {_TPU}")),
    "v5p": Chip("tpu", Links("ICI", 600e9, "DCN", 50 * _GBIT, "cloud.google.com/tpu/docs/v5p", 9e10, 4),
                Compute({"bfloat16": 459e12, "float32": 459e12}, _MXU(8, 128), 6, None,
                        f"cloud.google.com/tpu/docs/v5p; {_TPU}")),
    "a100-80g": Chip("cuda", Links("NVLink", 300e9, "InfiniBand", 200 * _GBIT, "NVIDIA DGX A100 datasheet"),
                     Compute({"bfloat16": 312e12, "float32": 156e12}, None, 0, 32e9, "NVIDIA A100 datasheet"),
                     GpuChip("NVIDIA A100-SXM4-80GB", (8, 0), 108, 64, 1.41, 81920 * 2**20, 2_039_000_000_000,
                             40 * 2**20, 167936, 166912)),
    "h100": Chip("cuda", Links("NVLink", 450e9, "InfiniBand", 400 * _GBIT, "NVIDIA DGX H100 datasheet"),
                 Compute({"bfloat16": 989.4e12, "float32": 494.7e12}, None, 0, 64e9, "NVIDIA H100 datasheet"),
                 GpuChip("NVIDIA H100 80GB HBM3", (9, 0), 132, 128, 1.98, 84_929_347_584, 3_352_320_000_000,
                         50 * 2**20, 233472, 232448)),
    "h200": Chip("cuda", Links("NVLink", 450e9, "InfiniBand", 400 * _GBIT, "NVIDIA DGX H200 datasheet"),
                 Compute({"bfloat16": 989.4e12, "float32": 494.7e12}, None, 0, 64e9, "NVIDIA H200 datasheet"),
                 GpuChip("NVIDIA H200", (9, 0), 132, 128, 1.98, 143771 * 2**20, 4_800_000_000_000,
                         50 * 2**20, 233472, 232448)),
    "b200": Chip("cuda", Links("NVLink", 900e9, "InfiniBand", 400 * _GBIT, "NVIDIA DGX B200 datasheet"),
                 Compute({"bfloat16": 2250e12, "float32": 1100e12}, None, 0, None, "NVIDIA B200 datasheet"),
                 GpuChip("NVIDIA B200", (10, 0), 148, 128, 1.965, 183359 * 2**20, 8_000_000_000_000,
                         126 * 2**20, 233472, 232448)),
}

# jax's device_kind for each TPU the table knows (a GPU's is its GpuChip.description).
TPU_KINDS = {"TPU v5 lite": "v5e", "TPU v6 lite": "v6e", "TPU v5": "v5p", "TPU v5p": "v5p"}


def chip_of(device_kind: str) -> str | None:
  """The planner's name for the chip jax calls ``device_kind`` (None where the table does not know it).

  Example::

    >>> chip_of("TPU v5 lite"), chip_of("cpu")
    ('v5e', None)
  """
  gpus = (name for name, c in CHIPS.items() if c.gpu and c.gpu.description == device_kind)
  return TPU_KINDS.get(device_kind) or next(gpus, None)
