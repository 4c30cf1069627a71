"""The two networks of a pod, per chip: the fast one inside a slice or node (ICI, NVLink) and the slow one
between them (DCN, InfiniBand), and what a step's collective bytes cost on each, as an estimate.

The bandwidths are the public figures of each chip's specification sheet or reference system, per chip and
per direction (a device sends at that rate while it receives at the same rate). A step's time on a network
is its bytes over that rate: a lower bound that assumes the link's full rate, no latency and no overlap with
computation, which is why every figure from here is marked an estimate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

__all__ = ["Links", "LINKS", "network_per_step"]


@dataclasses.dataclass(frozen=True)
class Links:
  """One chip's networks: names and bytes per second each way, and where the figures come from."""

  fast: str
  fast_bytes_per_s: float
  slow: str
  slow_bytes_per_s: float
  source: str


_GBIT = 1e9 / 8

LINKS: dict[str, Links] = {
    # Cloud TPU's system pages as read in December 2026: v5e 1,600 Gbps ICI per chip, 2 x 100 Gbps NICs per
    # 8-chip host; v6e 3,200 Gbps ICI per chip (800 GBps bidirectional), 4 x 200 Gbps per 8-chip host; v5p
    # 1,200 GBps bidirectional ICI, 50 Gbps DCN per chip. The DCN figures per chip agree with the scaling
    # book's tpus.md (jax-ml.github.io/scaling-book: 3.125e9, 12.5e9 and 6.25e9 B/s).
    "v5e": Links("ICI", 1600 * _GBIT, "DCN", 200 / 8 * _GBIT, "cloud.google.com/tpu/docs/v5e"),
    "v6e": Links("ICI", 3200 * _GBIT, "DCN", 800 / 8 * _GBIT, "cloud.google.com/tpu/docs/v6e"),
    "v5p": Links("ICI", 600e9, "DCN", 50 * _GBIT, "cloud.google.com/tpu/docs/v5p"),
    # NVIDIA's DGX systems: NVLink per GPU (A100 600 GB/s, H100 and H200 900 GB/s, B200 1.8 TB/s, both
    # directions) and one InfiniBand port per GPU (DGX A100 200 Gb/s, DGX H100/H200/B200 400 Gb/s).
    "a100-80g": Links("NVLink", 300e9, "InfiniBand", 200 * _GBIT, "NVIDIA DGX A100 datasheet"),
    "h100": Links("NVLink", 450e9, "InfiniBand", 400 * _GBIT, "NVIDIA DGX H100 datasheet"),
    "h200": Links("NVLink", 450e9, "InfiniBand", 400 * _GBIT, "NVIDIA DGX H200 datasheet"),
    "b200": Links("NVLink", 900e9, "InfiniBand", 400 * _GBIT, "NVIDIA DGX B200 datasheet"),
}


def _total(counts: Mapping[str, Mapping[str, int]] | None) -> int:
  return sum(c["bytes"] for c in (counts or {}).values())


def network_per_step(collectives: Mapping[str, Any], chip: str, platform: str) -> dict[str, Any]:
  """The bytes one device sends per step over each network of a pod, and the time each takes (estimated).

  Args:
    collectives: a row's ``collectives`` (:func:`nnx_zero1_plan.compiled.collectives_of` on a pod).
    chip: the topology's chip (``v5p``, ``h100``).
    platform: ``"tpu"`` or ``"cuda"``. A multi-slice TPU program's collectives stay inside its slice
      (what crosses is its megascale transfers); a GPU program's node-spanning collectives send part of
      their bytes over InfiniBand and the rest over NVLink.

  Returns:
    ``{"fast": {...}, "slow": {...}, "source": str | None}``; each network ``{"network", "bytes",
    "estimate_ms"}`` (``estimate_ms`` None for a chip without public figures here).

  Example::

    >>> c = {"sent_per_step": {"all-reduce": {"count": 1, "bytes": 9 * 10**9}},
    ...      "across_per_step": {"all-reduce": {"count": 1, "bytes": 10**9}}}
    >>> network_per_step(c, "h100", "cuda")["slow"]
    {'network': 'InfiniBand', 'bytes': 1000000000, 'estimate_ms': 20.0}
  """
  across = _total(collectives.get("across_per_step"))
  sent = _total(collectives.get("sent_per_step"))
  inside = sent if platform == "tpu" else sent - across
  links = LINKS.get(chip)
  names = (links.fast, links.slow) if links else (("ICI", "DCN") if platform == "tpu" else ("NVLink", "IB"))
  rates = (links.fast_bytes_per_s, links.slow_bytes_per_s) if links else (None, None)
  ms = lambda n, rate: None if rate is None else round(1000 * n / rate, 1)
  return {"fast": {"network": names[0], "bytes": inside, "estimate_ms": ms(inside, rates[0])},
          "slow": {"network": names[1], "bytes": across, "estimate_ms": ms(across, rates[1])},
          "source": links.source if links else None}
