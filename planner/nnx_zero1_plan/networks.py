"""The two networks of a pod, per chip: the fast one inside a slice or node (ICI, NVLink) and the slow one
between them (DCN, InfiniBand), and what a step's collective bytes cost on each, as an estimate.

The bandwidths are :data:`nnx_zero1_plan.chips.CHIPS`' (the public figures of each chip's specification
sheet or reference system), per chip and per direction (a device sends at that rate while it receives at the
same rate). A step's time on a network is its bytes over that rate: a lower bound that assumes the link's
full rate, no latency and no overlap with computation, which is why every figure from here is marked an
estimate.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nnx_zero1_plan.chips import CHIPS, Links
from nnx_zero1_plan.row import Collectives, OpCount

__all__ = ["LINKS", "network_per_step"]

# Each chip's networks, by the planner's name for it (``v5p``, ``h100``).
LINKS: dict[str, Links] = {name: chip.links for name, chip in CHIPS.items()}


def _total(counts: Mapping[str, OpCount] | None) -> int:
  return sum(c.bytes for c in (counts or {}).values())


def network_per_step(collectives: Collectives, chip: str, platform: str) -> dict[str, Any]:
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

    >>> ar = lambda n: {"all-reduce": {"count": 1, "bytes": n}}
    >>> c = Collectives.from_json({"per_step": {}, "sent_per_step": ar(9 * 10**9),
    ...                            "across_per_step": ar(10**9)})
    >>> network_per_step(c, "h100", "cuda")["slow"]
    {'network': 'InfiniBand', 'bytes': 1000000000, 'estimate_ms': 20.0}
  """
  across = _total(collectives.across_per_step)
  sent = _total(collectives.sent_per_step)
  inside = sent if platform == "tpu" else sent - across
  links = LINKS.get(chip)
  names = (links.fast, links.slow) if links else (("ICI", "DCN") if platform == "tpu" else ("NVLink", "IB"))
  rates = (links.fast_bytes_per_s, links.slow_bytes_per_s) if links else (None, None)
  ms = lambda n, rate: None if rate is None else round(1000 * n / rate, 1)
  return {"fast": {"network": names[0], "bytes": inside, "estimate_ms": ms(inside, rates[0])},
          "slow": {"network": names[1], "bytes": across, "estimate_ms": ms(across, rates[1])},
          "source": links.source if links else None}
