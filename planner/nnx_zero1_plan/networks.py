"""Each network's time, in one place: a collective's inside a TPU slice on the links its group's rings use,
and a pod's two networks per step (ICI or NVLink inside a slice or node, DCN or InfiniBand between).

Inside a slice the TPU compiler runs a collective as rings, as many as its ``backend_config`` names
(``StrategyRing{colors:1 ...}``, ``UniDirection1DRingStrategy{colors:2 ...}``; one where it names none),
each a cycle through the group's chips that sends one way. Each hop of a cycle is routed over the slice's
links, one axis at a time, the short way round where the axis wraps; a link carrying several hops at once
shares its rate among them. So a group of four on a 2x2 (a cycle of four links) runs two rings at twice one
link's rate, where a line of four without its wraparound carries each ring's way back over the same links and
gets one link's rate whatever the rings. Each ring step costs one hop's latency besides. The rates, the
wraparound and the latency are public figures (the chip table's :class:`~nnx_zero1_plan.chips.Links`,
:data:`HOP_S`), never measured on a slice by this project. A GPU's NVLink and the slow networks keep one rate
whatever the group (a switch), no latency.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Sequence

from nnx_zero1_plan.chips import CHIPS, Links
from nnx_zero1_plan.row import Collectives, Network, PodNetworks, StepTime

__all__ = ["HOP_S", "slice_coords", "ring_through", "link_load", "rings_of", "collective_seconds",
           "tpu_collective_time", "network_per_step", "slow_seconds", "network_note"]

# One ICI hop's own time, whatever it carries: "typically around 1us" (How to Scale Your Model,
# jax-ml/scaling-book, sharding.md, "A note on ICI latency").
HOP_S = 1e-6
_COLORS = re.compile(r"colors:(\d+)")

Coords = tuple[int, ...]


def slice_coords(devices: int, dims: int) -> list[Coords]:
  """Each device's place in the chip's standard slice of ``devices`` chips (``dims`` axes: 2 for v5e and v6e,
  3 for v5p), the first axis fastest as libtpu numbers them; the smallest axis doubles first, the last on a
  tie (4 chips: 2x2; 8: 2x4; 16: 4x4), as the slices are named.

  Example::

    >>> slice_coords(4, 2)
    [(0, 0), (1, 0), (0, 1), (1, 1)]
  """
  shape = [1] * dims
  while math.prod(shape) < devices:
    smallest = min(shape)
    shape[max(i for i, s in enumerate(shape) if s == smallest)] *= 2
  if math.prod(shape) != devices:  # not a standard slice: a line
    shape = [devices] + [1] * (dims - 1)
  return [tuple((i // math.prod(shape[:d])) % shape[d] for d in range(dims)) for i in range(devices)]


def _snake(sizes: Sequence[int]) -> list[Coords]:
  """Every place of a box of ``sizes``, each a neighbour of the one before (the last axis fastest, turning
  back at each end)."""
  if not sizes:
    return [()]
  inner = _snake(sizes[1:])
  return [(i, *rest) for i in range(sizes[0]) for rest in (inner if i % 2 == 0 else inner[::-1])]


def ring_through(members: Sequence[Coords]) -> list[Coords]:
  """A cycle through a group's chips, neighbour to neighbour wherever the group fills a box with an even side
  (a 2x2, a 2x4: every hop one link); otherwise the box in :func:`_snake` order, its last hop back routed over
  the links (along a line: its whole length).

  Example::

    >>> ring_through([(0, 0), (1, 0), (0, 1), (1, 1)])
    [(0, 1), (1, 1), (1, 0), (0, 0)]
  """
  spanned = [d for d in range(len(members[0])) if len({m[d] for m in members}) > 1]
  values = [sorted({m[d] for m in members}) for d in spanned]
  sizes = [len(v) for v in values]
  if math.prod(sizes) != len(members):  # not a box: the members' own order
    return sorted(members)
  even = next((i for i, s in enumerate(sizes) if s % 2 == 0), None)
  if len(sizes) < 2 or even is None:
    order = _snake(sizes)
  else:  # rows along the even axis, each but the first column, back along the first column
    rest = _snake(sizes[:even] + sizes[even + 1:])
    rows = [(i, r) for i in range(sizes[even]) for r in (rest[1:] if i % 2 == 0 else rest[:0:-1])]
    back = [(i, rest[0]) for i in reversed(range(sizes[even]))]
    order = [(*r[:even], i, *r[even:]) for i, r in rows + back]
  place = dict(zip(spanned, range(len(spanned)), strict=True))

  def coords(index: Coords) -> Coords:
    return tuple(values[place[d]][index[place[d]]] if d in place else members[0][d]
                 for d in range(len(members[0])))

  return [coords(i) for i in order]


def _route(a: Coords, b: Coords, shape: Coords, wraps: Sequence[bool]) -> list[tuple[Coords, int, int]]:
  """The links a hop from ``a`` to ``b`` crosses, one axis at a time (the short way round a wrapped axis):
  each ``(from, axis, direction)``."""
  links, at = [], list(a)
  for d, (size, wrap) in enumerate(zip(shape, wraps, strict=True)):
    step = 1 if b[d] > at[d] else -1
    if wrap and abs(b[d] - at[d]) > size // 2:
      step = -step
    while at[d] != b[d]:
      links.append((tuple(at), d, step))
      at[d] = (at[d] + step) % size
  return links


def link_load(groups: Sequence[Sequence[Coords]], rings: int, shape: Coords, wraps: Sequence[bool]
              ) -> tuple[int, int]:
  """The most ring hops any one link carries at once, over every group's ``rings`` (each other one sent the
  other way round), and the most links one hop crosses.

  Example::

    >>> square = [(0, 0), (1, 0), (0, 1), (1, 1)]
    >>> link_load([square], 2, (2, 2), (False, False))  # a cycle of four links: each ring on its own
    (1, 1)
    >>> link_load([[(0,), (1,), (2,), (3,)]], 2, (4,), (False,))  # a line: the way back on the same links
    (2, 3)
  """
  load: dict[tuple[Coords, int, int], int] = {}
  longest = 0
  for members in groups:
    cycle = ring_through(members)
    for r in range(rings):
      order = cycle if r % 2 == 0 else cycle[::-1]
      for a, b in zip(order, order[1:] + order[:1], strict=True):
        route = _route(a, b, shape, wraps)
        longest = max(longest, len(route))
        for link in route:
          load[link] = load.get(link, 0) + 1
  return max(load.values(), default=0), longest


def rings_of(line: str) -> int:
  """The rings the TPU compiler runs a collective as, from its ``backend_config`` (one where it names none).

  Example::

    >>> rings_of('all-reduce(%p), backend_config={"debug":"UniDirection1DRingStrategy{colors:2 phases:1}"}')
    2
  """
  rings = _COLORS.search(line)
  return int(rings[1]) if rings else 1


def collective_seconds(kind: str, sent: int, groups: Sequence[Sequence[Coords]], rings: int, links: Links
                       ) -> float:
  """One collective's time on a TPU slice: the bytes one device ``sent`` by a ring over ``rings`` rings at the
  link's one-way rate, each sharing its links as :func:`link_load` counts, and :data:`HOP_S` for each link
  of each ring step (``n - 1`` steps for a gather or a scatter, twice that for an all-reduce; a
  collective-permute, its buffer to one peer: one).

  Example::

    >>> from nnx_zero1_plan.chips import CHIPS
    >>> square = [(0, 0), (1, 0), (0, 1), (1, 1)]  # a 4 MB all-gather's ring bytes, 3/4 of it, on one ring
    >>> round(collective_seconds("all-gather", 3 * 10**6, [square], 1, CHIPS["v6e"].links) * 1e6, 1)
    36.3
  """
  n = len(groups[0])
  if n < 2 or links.link_bytes_per_s is None:
    return 0.0
  if kind == "collective-permute":
    return sent / links.link_bytes_per_s + HOP_S
  shape = tuple(max(m[d] for g in groups for m in g) + 1 for d in range(len(groups[0][0])))
  wraps = [links.wrap_every is not None and s % links.wrap_every == 0 for s in shape]
  load, hops = link_load(groups, rings, shape, wraps)
  steps = (n - 1) * (2 if kind == "all-reduce" else 1)
  return sent * load / (rings * links.link_bytes_per_s) + steps * hops * HOP_S


def tpu_collective_time(links: Links, dims: int, coords: Sequence[Coords] | None = None
                        ) -> Callable[[str, int, Sequence[tuple[int, ...]], int, int], float]:
  """A TPU collective's seconds from ``(kind, ring bytes one device sends, its device groups, its rings, the
  program's devices)``: :func:`collective_seconds` with each device at ``coords`` (its place in the slice,
  in the program's device order; None: the standard slice of the program's devices, :func:`slice_coords`)."""

  @functools.cache
  def timed(kind: str, sent: int, groups: tuple[tuple[int, ...], ...], rings: int, devices: int) -> float:
    places = list(coords) if coords is not None else slice_coords(devices, dims)
    placed = [[places[i % len(places)] for i in g] for g in groups]
    return collective_seconds(kind, sent, placed, rings, links)

  return lambda kind, sent, groups, rings, devices: timed(kind, sent, tuple(map(tuple, groups)), rings,
                                                          devices)


def network_per_step(collectives: Collectives, chip: str, platform: str, step_time: StepTime | None = None
                     ) -> PodNetworks:
  """The bytes one device sends per step over each network of a pod, and the time each takes: the step
  time's own (:func:`nnx_zero1_plan.predict_step_time`: the fast network's collectives walked on their
  links, the slow network's bytes at its rate), so a row's table and its step time say one time.

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
  links = CHIPS[chip].links
  fast_ms = None if step_time is None else round(1000 * step_time.fast_s, 1)
  slow = Network(links.slow, across, round(1000 * slow_seconds(across, links), 1))
  return PodNetworks(Network(links.fast, inside, fast_ms), slow, links.source)


def slow_seconds(nbytes: int, links: Links) -> float:
  """The slow network's time for ``nbytes`` one device sends between slices or nodes: at its rate, exposed
  (the one rate the table and the step time use).

  Example::

    >>> slow_seconds(10**9, CHIPS["h100"].links)
    0.02
  """
  return nbytes / links.slow_bytes_per_s


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
