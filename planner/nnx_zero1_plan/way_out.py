"""When nothing fits: what to try next, and what makes room, tried by a compile each, in the order a user
would try it.

:func:`next_steps` lists what to try, each with its command, from the rows' figures (a lever not tried, more
``fsdp``, remat, half the micro-batch).

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

from nnx_zero1_plan.levers import adds_memory
from nnx_zero1_plan.request import command_line

__all__ = ["Change", "changes_to_try", "find_way_out", "next_steps"]


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
                 command: Callable[[Change], str],
                 code: Callable[[Change], str] | None = None) -> dict[str, Any]:
  """Compiles each change in order until one fits.

  Args:
    changes: from :func:`changes_to_try`.
    compile_changed: compiles the step with a change made; returns its row (``fits``,
      ``peak_bytes_per_device``, ``error``).
    command: the planner's command for a change.
    code: the code that trains with a change made (its lever's, as a recommendation prints it).

  Returns:
    ``{"tried": [...], "found": the first that fits or None}``; each tried entry has ``what``, ``command``,
    ``fits``, ``peak_bytes_per_device`` and ``error``; the one that fits (``found``) has its ``code`` too.

  Example::

    >>> changes = [Change("smaller", {"batch": 4}), Change("offload", {"levers": ["offload"]})]
    >>> out = find_way_out(changes, lambda c: {"fits": "offload" in c.what, "peak_bytes_per_device": 1},
    ...                    lambda c: f"plan {c.what}", lambda c: f"code of {c.settings['levers'][0]}")
    >>> [t["fits"] for t in out["tried"]], out["found"]["command"], out["found"]["code"]
    ([False, True], 'plan offload', 'code of offload')
  """
  tried = []
  for change in changes:
    row = compile_changed(change)
    tried.append({"what": change.what, "command": command(change), "fits": bool(row.get("fits")),
                  "peak_bytes_per_device": row.get("peak_bytes_per_device"), "error": row.get("error")})
    if tried[-1]["fits"]:
      if code is not None:
        tried[-1]["code"] = code(change)
      return {"tried": tried, "found": tried[-1]}
  return {"tried": tried, "found": None}


def next_steps(rows: Sequence[Mapping[str, Any]], meta: Mapping[str, Any], levers: Sequence[str], *,
               blocked: Mapping[str, str], remat: str | None, batch_unit: int) -> list[str]:
  """What to try next, in order, when no row fits (empty when one does): each item ends with its command.

  Args:
    rows: the plan's rows.
    meta: the plan's settings (``model``, ``topology``, ``mesh``, ``batch``, ``ga``, ...).
    levers: every lever the planner knows, lightest first.
    blocked: the levers that cannot apply to this model, and why (they are not suggested, nor is a lever
      that adds memory: :func:`nnx_zero1_plan.levers.adds_memory`).
    remat: the remat policy to suggest when the plan used none (None: the model takes no ``--remat``).
    batch_unit: the batch axes' size: a micro-batch is a multiple of it.

  Example::

    >>> row = {"lever": "baseline", "fits": False, "peak_bytes_per_device": 3 * 2**30, "hbm_bytes": 2**30,
    ...        "temp_bytes_per_device": 2**30, "opt_state_bytes_per_device": 2**30, "mesh": {"data": 4}}
    >>> meta = {"model": "m:f", "topology": "h100:4", "mesh": {"data": 4}, "batch": 8, "seq_len": 1024,
    ...         "ga": 1, "levers": ["baseline"], "steps": ["one"]}
    >>> next_steps([row], meta, ["baseline", "zero1"], blocked={}, remat=None, batch_unit=4)[0][:75]
    'the lever zero1: saves 0.75 GiB of optimizer state per device (the layout r'
  """
  if not rows or any(r["fits"] or r.get("fits_estimate") for r in rows):
    return []
  steps = []
  tried = {r["lever"] for r in rows}
  base = next((r for r in rows if r["lever"] == "baseline" and r["opt_state_bytes_per_device"]), None)
  for name in levers:
    if name in tried or name in blocked or adds_memory(name):  # only what may make room
      continue
    saving = ""
    if name == "zero1" and base is not None:
      data = base["mesh"].get("data", 1)
      saving = (f": saves {base['opt_state_bytes_per_device'] * (1 - 1 / data) / 2**30:.2f} GiB of optimizer "
                "state per device (the layout rule)")
    steps.append(f"the lever {name}{saving}: {command_line(meta, levers=[name])}")
  best = min((r for r in rows if r["peak_bytes_per_device"]), key=lambda r: r["peak_bytes_per_device"],
             default=None)
  temp = (best or {}).get("temp_bytes_per_device") or 0
  if best is not None:
    short = (best["peak_bytes_per_device"] - best["hbm_bytes"]) / 2**30
    mesh = dict(meta["mesh"])
    if "fsdp" in mesh and mesh.get("data", 1) > 1:
      mesh["data"], mesh["fsdp"] = mesh["data"] // 2, 2 * mesh["fsdp"]
      steps.append(f"{best['lever']} comes closest, {short:.2f} GiB over; more fsdp splits parameters and "
                   f"gradients too: {command_line(meta, levers=[best['lever']], mesh=mesh)}")
    if remat is not None and not meta.get("remat"):
      steps.append(f"remat (recomputes activations; the temp is {temp / 2**30:.2f} GiB): "
                   f"{command_line(meta, levers=[best['lever']], remat=remat)}")
  half = meta["batch"] // 2 // batch_unit * batch_unit
  if half >= batch_unit:
    why = (f"activations shrink, up to ~{temp / 2 / 2**30:.2f} GiB" if best is not None
           else "the compiler refused every program at this micro-batch")
    lever = best["lever"] if best is not None else rows[-1]["lever"]
    steps.append(f"half the micro-batch, twice the accumulation (the same tokens per step; {why}): "
                 f"{command_line(meta, levers=[lever], batch=half, ga=2 * meta['ga'])}")
  return steps
