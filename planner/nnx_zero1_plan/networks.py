"""A pod's two networks (ICI or NVLink inside a slice or node, DCN or InfiniBand between): each one's time per
step, estimated at the chip table's public rates each way (a device receives as it sends), no latency."""

from __future__ import annotations

from nnx_zero1_plan.chips import CHIPS, Links
from nnx_zero1_plan.row import Collectives, Network, PodNetworks, StepTime

__all__ = ["LINKS", "network_per_step", "slow_seconds"]

# Each chip's networks, by the planner's name for it (``v5p``, ``h100``).
LINKS: dict[str, Links] = {name: chip.links for name, chip in CHIPS.items()}


def network_per_step(collectives: Collectives, chip: str, platform: str, step_time: StepTime | None = None
                     ) -> PodNetworks:
  """The bytes one device sends per step over each network of a pod, and the time each takes: the step
  time's own (:func:`nnx_zero1_plan.predict_step_time`: the fast network's collectives walked at its ports'
  rate, the slow network's bytes at its rate), so a row's table and its step time say one time.

  Args:
    collectives: a row's ``collectives`` (:func:`nnx_zero1_plan.compiled.collectives_of` on a pod).
    chip: the topology's chip (``v5p``, ``h100``).
    platform: ``"tpu"`` or ``"cuda"``. A multi-slice TPU program's collectives stay inside its slice
      (what crosses is its megascale transfers); a GPU program's node-spanning collectives send part of
      their bytes over InfiniBand and the rest over NVLink.
    step_time: the row's predicted step's parts (None where the compiler gave no estimate: no fast time).

  Returns:
    The :class:`~nnx_zero1_plan.row.PodNetworks`: each network's name, bytes and ``estimate_ms`` (the fast
    one's None where there is no step time).

  Example::

    >>> ar = lambda n: {"all-reduce": {"count": 1, "bytes": n}}
    >>> c = Collectives.from_json({"per_step": {}, "sent_per_step": ar(9 * 10**9),
    ...                            "across_per_step": ar(10**9)})
    >>> network_per_step(c, "h100", "cuda").slow
    Network(network='InfiniBand', bytes=1000000000, estimate_ms=20.0)
  """
  across = collectives.across_bytes
  inside = collectives.sent_bytes - (0 if platform == "tpu" else across)
  links = LINKS[chip]
  fast_ms = None if step_time is None else round(1000 * step_time.fast_s, 1)
  slow = Network(links.slow, across, round(1000 * slow_seconds(across, links), 1))
  return PodNetworks(Network(links.fast, inside, fast_ms), slow, links.source)


def slow_seconds(nbytes: int, links: Links) -> float:
  """The slow network's time for ``nbytes`` one device sends between slices or nodes: at its rate, exposed
  (the one rate the table and the step time use).

  Example::

    >>> slow_seconds(10**9, LINKS["h100"])
    0.02
  """
  return nbytes / links.slow_bytes_per_s
