"""Each network's time, in one place: a collective's inside a TPU slice on the links its group's rings use,
and a pod's two networks per step (ICI or NVLink inside a slice or node, DCN or InfiniBand between). The
model, from public figures never measured on a slice: docs/planner.md ("How fast", Collectives).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Sequence

from nnx_zero1_plan.chips import CHIPS, Links
from nnx_zero1_plan.inputs import Backend
from nnx_zero1_plan.row import Collectives, Network, PodNetworks, StepTime

# One ICI hop's own time, whatever it carries: "typically around 1us" (How to Scale Your Model,
# jax-ml/scaling-book, sharding.md, "A note on ICI latency").
HOP_S = 1e-6
_COLORS = re.compile(r"colors:(\d+)")

Coords = tuple[int, ...]
# A collective's seconds from (kind, ring bytes one device sends, device groups, rings, program's devices).
CollectiveTime = Callable[[str, int, tuple[tuple[int, ...], ...], int, int], float]


def slice_shape(devices: int, dims: int) -> Coords:
  """The chip's standard slice of ``devices`` chips on ``dims`` axes, as the slices are named (the smallest
  axis doubles first, the last on a tie); a line where no such slice has that many.

  Example::

    >>> slice_shape(4, 2), slice_shape(8, 2), slice_shape(3, 2)
    ((2, 2), (2, 4), (3, 1))
  """
  shape = [1] * dims
  while math.prod(shape) < devices:
    smallest = min(shape)
    shape[max(i for i, s in enumerate(shape) if s == smallest)] *= 2
  return tuple(shape) if math.prod(shape) == devices else (devices, *[1] * (dims - 1))


def on_a_cycle(members: Sequence[Coords], shape: Coords, wraps: Sequence[bool]) -> bool:
  """Whether a group's chips close a cycle of single links: it spans two axes or more (a 2x2, a 2x4), or the
  whole of one axis that wraps; otherwise it is a line, and a ring's way back runs over its own links.

  Example::

    >>> on_a_cycle([(0, 0), (1, 0), (0, 1), (1, 1)], (2, 2), (False, False))
    True
    >>> on_a_cycle([(0,), (1,), (2,), (3,)], (4,), (False,)), on_a_cycle([(0,), (1,)], (16,), (True,))
    (False, False)
  """
  spanned = [d for d in range(len(shape)) if len({m[d] for m in members}) > 1]
  whole_axis = len(spanned) == 1 and wraps[spanned[0]] and len(members) == shape[spanned[0]] > 2
  return len(spanned) > 1 or whole_axis


def rings_of(line: str) -> int:
  """The rings the TPU compiler runs a collective as, from its ``backend_config`` (one where it names none).

  Example::

    >>> rings_of('all-reduce(%p), backend_config={"debug":"UniDirection1DRingStrategy{colors:2 phases:1}"}')
    2
  """
  rings = _COLORS.search(line)
  return int(rings[1]) if rings else 1


def tpu_collective_time(links: Links, dims: int) -> CollectiveTime:
  """One collective's time on a TPU slice, a cached function of ``(kind, sent, groups, rings, devices)``: the
  bytes one device ``sent`` at ``rings`` times the link's one-way rate on a cycle (:func:`on_a_cycle`), at one
  link's rate on a line, plus :data:`HOP_S` for each link a ring step crosses (one on a cycle, the line's
  length on a line) over ``n - 1`` steps (twice that for an all-reduce, one for a collective-permute). Each
  device sits in the standard slice of ``devices`` (:func:`slice_shape`), first axis fastest as libtpu
  numbers them."""

  @functools.cache
  def timed(kind: str, sent: int, groups: tuple[tuple[int, ...], ...], rings: int, devices: int) -> float:
    n, link = len(groups[0]), links.link_bytes_per_s
    if n < 2 or link is None:
      return 0.0
    if kind == "collective-permute":
      return sent / link + HOP_S
    shape = slice_shape(devices, dims)
    places = [tuple(i // math.prod(shape[:d]) % shape[d] for d in range(dims)) for i in range(devices)]
    wraps = [links.wrap_every is not None and s % links.wrap_every == 0 for s in shape]
    # A replica's ids run past a slice's: each at its place in its own slice.
    cycle = all(on_a_cycle([places[i % devices] for i in g], shape, wraps) for g in groups)
    steps = (n - 1) * (2 if kind == "all-reduce" else 1)
    return sent / (link * (rings if cycle else 1)) + steps * (1 if cycle else n - 1) * HOP_S

  return timed


def network_per_step(collectives: Collectives, chip: str, backend: Backend, step_time: StepTime | None = None
                     ) -> PodNetworks:
  """The bytes one device sends per step over each network of a pod, and the time each takes: the step
  time's own (:func:`nnx_zero1_plan.predict_step_time`), so a row's table and its step time say one time.

  Args:
    collectives: a row's ``collectives`` (:func:`nnx_zero1_plan.compiled.collectives_of` on a pod).
    chip: the topology's chip (``v5p``, ``h100``).
    backend: the platform's facts. A program over slices keeps its collectives inside each slice (what
      crosses is its megascale transfers); a program over nodes sends part of its node-spanning
      collectives' bytes over InfiniBand and the rest over NVLink.
    step_time: the row's predicted step's parts (None where the compiler gave no estimate: no fast time).

  Returns:
    The :class:`~nnx_zero1_plan.row.PodNetworks`: each network's name, bytes and ``estimate_ms``.

  Example::

    >>> from nnx_zero1_plan.inputs import BACKENDS
    >>> ar = lambda n: {"all-reduce": {"count": 1, "bytes": n}}
    >>> c = Collectives.from_json({"per_step": {}, "sent_per_step": ar(9 * 10**9),
    ...                            "across_per_step": ar(10**9)})
    >>> network_per_step(c, "h100", BACKENDS["cuda"]).slow
    Network(network='InfiniBand', bytes=1000000000, estimate_ms=20.0)
  """
  across = collectives.across_bytes
  inside = collectives.sent_bytes - (across if backend.crosses_in_program else 0)
  links = CHIPS[chip].links
  fast_ms = None if step_time is None else round(1000 * step_time.fast_s, 1)
  slow = Network(links.slow, across, round(1000 * (across / links.slow_bytes_per_s), 1))
  return PodNetworks(Network(links.fast, inside, fast_ms), slow, links.source)


def network_note(step_time: StepTime | None) -> str | None:
  """A row's note where most of its predicted step waits on the networks: what that time rests on.

  Example::

    >>> t = StepTime("", [], compute_s=0.3, fast_network="ICI", fast_s=0.5, fast_exposed_s=0.5,
    ...              slow_network=None, slow_s=0.0, host_s=None, host_exposed_s=0.0, unestimated_ops=0,
    ...              clock_ghz=None, roofline_s=None)
    >>> network_note(t)
    'mostly network (62%): public link rates and the topology, never measured on a slice'
  """
  if step_time is None:
    return None
  network = step_time.fast_exposed_s + step_time.slow_s
  share = network / ((network + step_time.compute_s + step_time.host_exposed_s) or 1.0)
  return (f"mostly network ({share:.0%}): public link rates and the topology, never measured on a slice"
          if share > 0.5 else None)
