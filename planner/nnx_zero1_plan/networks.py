"""Every network's time, in one place: a collective's on a chip's fast network (a TPU slice's links its
group's rings use, a GPU node's switch), and the bytes a pod sends between its slices or nodes on the slow
one. The model, from public figures never measured on a slice: docs/planner.md ("How fast", Collectives)."""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Sequence

from nnx_zero1_plan.chips import CHIPS, Chip, Links
from nnx_zero1_plan.inputs import BACKENDS, Backend
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
  axis doubles first, the last on a tie); a line where no such slice has that many."""
  shape = [1] * dims
  while math.prod(shape) < devices:
    smallest = min(shape)
    shape[max(i for i, s in enumerate(shape) if s == smallest)] *= 2
  return tuple(shape) if math.prod(shape) == devices else (devices, *[1] * (dims - 1))


def on_a_cycle(members: Sequence[Coords], shape: Coords, wraps: Sequence[bool]) -> bool:
  """Whether a group's chips close a cycle of single links: it spans two axes or more (a 2x2, a 2x4), or the
  whole of one axis that wraps; otherwise it is a line, and a ring's way back runs over its own links."""
  spanned = [d for d in range(len(shape)) if len({m[d] for m in members}) > 1]
  whole_axis = len(spanned) == 1 and wraps[spanned[0]] and len(members) == shape[spanned[0]] > 2
  return len(spanned) > 1 or whole_axis


def rings_of(line: str) -> int:
  """The rings the TPU compiler runs a collective as, by its ``backend_config`` (one where it names none)."""
  rings = _COLORS.search(line)
  return int(rings[1]) if rings else 1


def at_rate(bytes_per_s: float) -> CollectiveTime:
  """A collective's time at one rate whatever its group (a GPU's switch)."""
  return lambda kind, sent, groups, rings, devices: sent / bytes_per_s


def collective_time(chip: Chip) -> CollectiveTime:
  """A collective's seconds on ``chip``'s fast network: a GPU's at its NVLink rate whatever the group (a
  switch); a TPU's on a slice, cached: the bytes one device sends at ``rings`` times the link's one-way rate
  on a cycle (:func:`on_a_cycle`), at one link's rate on a line, plus :data:`HOP_S` for each link a ring step
  crosses (one on a cycle, the line's length on a line) over ``n - 1`` steps (twice that for an all-reduce,
  one for a collective-permute). Each device sits in the standard slice of ``devices`` (:func:`slice_shape`),
  first axis fastest as libtpu numbers them."""
  links, dims = chip.links, chip.compute.ports // 2
  if not BACKENDS[chip.platform].ring_links:
    return at_rate(links.fast_bytes_per_s)
  link = links.link_bytes_per_s or 0.0  # every chip with ring links has its link's rate

  @functools.cache
  def timed(kind: str, sent: int, groups: tuple[tuple[int, ...], ...], rings: int, devices: int) -> float:
    n = len(groups[0])
    if n < 2:
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


def slow_seconds(links: Links, sent: int) -> float:
  """The seconds ``sent`` bytes take between slices or nodes: the slow network's public rate, no latency."""
  return sent / links.slow_bytes_per_s


def crossed_seconds(chip: Chip, sent: int) -> float:
  """The seconds a step's walk gave the ``sent`` bytes that cross a GPU pod's nodes (its program spans them:
  at NVLink's rate), to count them once, on the slow network; none on a TPU pod, whose programs keep their
  collectives inside each slice."""
  return sent / chip.links.fast_bytes_per_s if BACKENDS[chip.platform].crosses_in_program else 0.0


def over_the_slow_network(walk_s: float, exposed_s: float, chip: Chip, sent: int
                          ) -> tuple[float, float, float]:
  """A step's seconds from its walk (``walk_s``, ``exposed_s`` of it waiting on collectives) and the ``sent``
  bytes one device sends between slices or nodes, the slow network's seconds added and the wait a GPU pod's
  walk gave the crossing bytes taken off (counted once, there); with the slow seconds and that wait."""
  slow_s = slow_seconds(chip.links, sent)
  crossed = min(crossed_seconds(chip, sent), exposed_s)
  return walk_s - crossed + slow_s, slow_s, crossed


def network_per_step(collectives: Collectives, chip: str, backend: Backend, step_time: StepTime | None = None
                     ) -> PodNetworks:
  """The bytes one device sends per step over each network of a pod (a program over nodes sends part of its
  node-spanning collectives' bytes over InfiniBand and the rest over NVLink; one over slices keeps its
  collectives inside each), and the time each takes: the fast one's is the step time's own, so a row's
  table and its step time say one time (None where there is none)."""
  across = collectives.across_bytes
  inside = collectives.sent_bytes - (across if backend.crosses_in_program else 0)
  links = CHIPS[chip].links
  fast_ms = None if step_time is None else round(1000 * step_time.fast_s, 1)
  slow = Network(links.slow, across, round(1000 * slow_seconds(links, across), 1))
  return PodNetworks(Network(links.fast, inside, fast_ms), slow, links.source)


def network_note(step_time: StepTime | None) -> str | None:
  """A row's note where most of its predicted step waits on the networks: what that time rests on."""
  if step_time is None:
    return None
  network = step_time.fast_exposed_s + step_time.slow_s
  share = network / ((network + step_time.compute_s + step_time.host_exposed_s) or 1.0)
  return (f"mostly network ({share:.0%}): public link rates and the topology, never measured on a slice"
          if share > 0.5 else None)
