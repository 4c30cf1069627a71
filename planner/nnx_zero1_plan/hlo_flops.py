"""A compiled program's matmul FLOPs, counted from its HLO text, where the compiler has no cost analysis.

XLA's GPU compiler returns no ``cost_analysis()`` for a deviceless compile, so a GPU
row would carry no compute, and a plan could not show what a larger micro-batch costs
where the compiler rematerialises to fit. Every ``dot`` of the optimised program is
counted here, ``2 x (result elements) x (contracted elements)``, times the trip
count of each loop it runs in (``known_trip_count``; a loop without one counts once)
and the number of places its computation is called from. Only dots: elementwise work
is small beside them in a transformer step, and remat shows in the dots it repeats.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator

__all__ = ["dot_flops"]

_HEADER = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>\S+)\s+(?P<op>[\w\-]+)\((?P<args>.*)")
_DIMS = re.compile(r"^\(?[a-z]\w*\[(?P<dims>[\d,]*)\]")
_CALLS = re.compile(r"(?:calls|body)=%?(?P<callee>[\w.\-]+)")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(?P<n>\d+)"\}')
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{(?P<dims>[\d,]*)\}")


def _dims(shape: str) -> tuple[int, ...] | None:
  match = _DIMS.match(shape)
  if match is None:
    return None
  return tuple(int(d) for d in match["dims"].split(",") if d)


def _computations(hlo: str) -> Iterator[tuple[str, bool, list[str]]]:
  """Each computation's name, whether it is the entry, and its instruction lines."""
  name: str | None = None
  entry, lines = False, list[str]()
  for line in hlo.splitlines():
    header = _HEADER.match(line)
    if header and not _INSTRUCTION.match(line):
      name, entry, lines = header["name"], line.lstrip().startswith("ENTRY"), []
    elif line.strip() == "}" and name is not None:
      yield name, entry, lines
      name = None
    elif name is not None:
      lines.append(line)


def dot_flops(hlo: str) -> int:
  """The FLOPs of every ``dot`` in a compiled HLO module's text, each loop's body times its trip count.

  Example::

    >>> import jax, jax.numpy as jnp
    >>> hlo = jax.jit(lambda a, b: a @ b).lower(jnp.ones((8, 16)), jnp.ones((16, 4))).compile().as_text()
    >>> dot_flops(hlo)  # 2 x 8 x 4 x 16
    1024
  """
  own: dict[str, int] = {}
  calls: dict[str, list[tuple[str, int]]] = {}
  entry = None
  for name, is_entry, lines in _computations(hlo):
    entry = name if is_entry else entry
    shapes: dict[str, tuple[int, ...] | None] = {}
    flops, callees = 0, []
    for line in lines:
      for callee in _CALLS.finditer(line):  # a while's tuple shape has spaces: read calls off any line
        trips = _TRIPS.search(line) if callee.group(0).startswith("body") else None
        callees.append((callee["callee"], int(trips["n"]) if trips else 1))
      instruction = _INSTRUCTION.match(line)
      if instruction is None:
        continue
      shapes[instruction["name"]] = _dims(instruction["shape"])
      if instruction["op"] != "dot":
        continue
      result = shapes[instruction["name"]]
      lhs = shapes.get(instruction["args"].split(",")[0].strip().lstrip("%"))
      contracting = _CONTRACTING.search(line)
      if result is None or lhs is None or contracting is None:
        continue
      kept = [lhs[int(d)] for d in contracting["dims"].split(",") if d]
      flops += 2 * math.prod(result) * math.prod(kept)
    own[name], calls[name] = flops, callees

  def total(name: str, seen: frozenset[str]) -> int:
    if name in seen or name not in own:
      return 0
    return own[name] + sum(trips * total(callee, seen | {name}) for callee, trips in calls[name])

  return 0 if entry is None else total(entry, frozenset())
