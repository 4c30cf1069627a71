"""When nothing fits: what makes room, tried by a compile each, in the order a user would try it.

A refused compile has no peak, so the arithmetic of "what to try next" has
nothing to work from; only the compiler can say whether a change is enough.
:func:`changes_to_try` lists the changes, lightest first: a smaller micro-batch
(more accumulation, the same tokens per step), remat, a larger ``fsdp`` on the
same chips, the optimizer state in host memory. :func:`find_way_out` compiles
them in that order and stops at the first that fits. Pure: the compiles are the
caller's ``compile_changed``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["Change", "changes_to_try", "find_way_out"]


@dataclasses.dataclass(frozen=True)
class Change:
  """One change to the plan's settings that may make room.

  Attributes:
    what: the change in words.
    settings: what changes, by the command line's names (``batch``, ``ga``, ``remat``, ``mesh``, ``levers``).
  """

  what: str
  settings: Mapping[str, Any]


def changes_to_try(meta: Mapping[str, Any], *, lever: str, batch_unit: int, remat: str | None,
                   named_axes: Sequence[str] = (), host_memory: bool = True) -> list[Change]:
  """The changes to compile when nothing fits, lightest first, each from the plan's settings.

  Args:
    meta: the plan's settings (``batch``, ``ga``, ``mesh``, ``remat``).
    lever: the lever to try them on (the lightest Zero-1 lever that applies, else the baseline).
    batch_unit: the batch axes' size: a micro-batch is a multiple of it.
    remat: the remat policy the model takes (None: it takes none).
    named_axes: the mesh axes the model's variables name (``fsdp`` must be one for a larger fsdp).
    host_memory: whether the target's compile-only devices have host memory to offload to (TPUs; XLA's GPU
      compiler offers none without a GPU).

  Returns:
    The :class:`Change` s, in the order to try them.

  Example::

    >>> meta = {"batch": 16, "ga": 1, "mesh": {"data": 4, "fsdp": 2}, "remat": None}
    >>> [c.what for c in changes_to_try(meta, lever="zero1", batch_unit=4, remat="block",
    ...                                 named_axes=["fsdp"])]  # doctest: +NORMALIZE_WHITESPACE
    ['micro-batch 8, 2x the accumulation (the same tokens per step)',
     'micro-batch 4, 4x the accumulation (the same tokens per step)', 'remat block',
     'fsdp=4 (data=2): parameters and gradients split too', 'the optimizer state in host memory']
  """
  out = []
  for times in (2, 4, 8):  # a smaller micro-batch, halved while it still splits over the batch axes
    smaller = meta["batch"] // times // batch_unit * batch_unit
    if smaller >= batch_unit and smaller * times == meta["batch"]:
      out.append(Change(f"micro-batch {smaller}, {times}x the accumulation (the same tokens per step)",
                        {"levers": [lever], "batch": smaller, "ga": times * meta["ga"]}))
  if remat is not None and meta.get("remat") in (None, "none"):
    out.append(Change(f"remat {remat}", {"levers": [lever], "remat": remat}))
  mesh = dict(meta["mesh"])
  if "fsdp" in named_axes and mesh.get("data", 1) % 2 == 0:
    mesh["data"], mesh["fsdp"] = mesh["data"] // 2, 2 * mesh.get("fsdp", 1)
    out.append(Change(f"fsdp={mesh['fsdp']} (data={mesh['data']}): parameters and gradients split too",
                      {"levers": [lever], "mesh": mesh}))
  if host_memory:
    out.append(Change("the optimizer state in host memory", {"levers": ["offload"]}))
  return out


def find_way_out(changes: Sequence[Change], compile_changed: Callable[[Change], Mapping[str, Any]],
                 command: Callable[[Change], str]) -> dict[str, Any]:
  """Compiles each change in order until one fits.

  Args:
    changes: from :func:`changes_to_try`.
    compile_changed: compiles the step with a change made; returns its row (``fits``,
      ``peak_bytes_per_device``, ``error``).
    command: the planner's command for a change.

  Returns:
    ``{"tried": [...], "found": the first that fits or None}``; each tried entry has ``what``, ``command``,
    ``fits``, ``peak_bytes_per_device`` and ``error``.

  Example::

    >>> changes = [Change("smaller", {"batch": 4}), Change("offload", {"levers": ["offload"]})]
    >>> out = find_way_out(changes, lambda c: {"fits": "offload" in c.what, "peak_bytes_per_device": 1},
    ...                    lambda c: f"plan {c.what}")
    >>> [t["fits"] for t in out["tried"]], out["found"]["command"]
    ([False, True], 'plan offload')
  """
  tried = []
  for change in changes:
    row = compile_changed(change)
    tried.append({"what": change.what, "command": command(change), "fits": bool(row.get("fits")),
                  "peak_bytes_per_device": row.get("peak_bytes_per_device"), "error": row.get("error")})
    if tried[-1]["fits"]:
      return {"tried": tried, "found": tried[-1]}
  return {"tried": tried, "found": None}
