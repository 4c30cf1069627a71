"""The configuration a plan recommends, by a stated order, with the code that writes it (:mod:`printed_code`).

The order: a row must fit (the compiler accepted the whole program, and its peak
is within the usable memory: the device's less the reserve or the margin; an
estimate decides nothing, and a Zero-1 lever whose optimizer state per device is
the baseline's is not a candidate); then the largest micro-batch (the most
tokens per step per chip; a lever stands at a micro-batch where its own compile
fitted, even above its edge, so no edge is weighed against a micro-batch the
other lever was never compiled at); then the fewest collective
bytes each device sends per token (the same basis for all-reduce, reduce-scatter
and all-gather, within 1%); then the fewest bytes copied to and from host memory
(an offloaded state, within 1%); then the most headroom at that micro-batch; then
no remat; then the lighter lever. Pure: rows in, one dict out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from nnx_zero1_plan.inputs import PlanError, parse_topology
from nnx_zero1_plan.printed_code import lever_code
from nnx_zero1_plan.request import command_line

__all__ = ["ORDER", "micro_batch_of", "fitted_at", "splits_nothing", "sent_bytes_of", "recommend",
           "recompute_note", "thin_note", "baseline_beats", "why_picked", "plan_code"]

ORDER = ("fits", "largest micro-batch", "fewest bytes sent over the slow network per token (pods; within 1%)",
         "fewest collective bytes sent per token (within 1%)",
         "fewest bytes copied to and from host memory per step (offloaded state; within 1%)",
         "most headroom at that micro-batch",
         "no remat", "the lighter lever")
_SAME_BYTES = 0.01  # collective bytes this close are a tie: the headroom decides


def micro_batch_of(row: Mapping[str, Any], batch: int) -> int | None:
  """The micro-batch a row stands for: its search's edge, else ``batch`` where the row fits.

  Example::

    >>> micro_batch_of({"fits": True}, 8), micro_batch_of({"fits": False}, 8)
    (8, None)
    >>> micro_batch_of({"fits": True, "max_micro_batch": 56}, 8)
    56
  """
  if "max_micro_batch" in row:
    return row["max_micro_batch"]
  return batch if row.get("fits") else None


def fitted_at(row: Mapping[str, Any], batch: int) -> set[int]:
  """The micro-batches at which the row's own whole compiles fitted (its search's, and its own at ``batch``
  where the row has no ``batch`` of its own).

  Example::

    >>> sorted(fitted_at({"fits": True, "batch": 8, "search": [{"batch": 140, "fits": True},
    ...                   {"batch": 132, "fits": False}]}, 8))
    [8, 140]
  """
  points = {p["batch"] for p in row.get("search", ()) if p.get("fits")}
  return points | ({row.get("batch", batch)} if row.get("fits") else set())


_RECOMPUTE = 0.05  # compute per sequence this much above the cheapest fitting point: the compiler recomputes


def recompute_note(row: Mapping[str, Any], micro: int) -> str | None:
  """Where a row's compute per sequence at ``micro`` is more than 5% above its cheapest fitting compile's (the
  compiler rematerialises to fit), one sentence saying a larger micro-batch trades memory for recompute
  there; None otherwise, or where its compiles carry no flops.

  Example::

    >>> row = {"lever": "zero1", "search": [{"batch": 8, "fits": True, "flops_per_device": 8e12},
    ...                                     {"batch": 48, "fits": True, "flops_per_device": 60e12}]}
    >>> print(recompute_note(row, 48).replace(": ", ":\\n"))
    zero1 at micro-batch 48 computes 1.25 TFLOP per sequence per device against 1.00 at 8:
    +25% recompute, a larger micro-batch trades memory for it
  """
  points = {p["batch"]: p["flops_per_device"] / p["batch"] for p in row.get("search", ())
            if p.get("fits") and p.get("flops_per_device")}
  if micro not in points or len(points) < 2:
    return None
  cheapest = min(points, key=lambda b: points[b])
  extra = points[micro] / points[cheapest] - 1
  if extra <= _RECOMPUTE:
    return None
  return (f"{row['lever']} at micro-batch {micro} computes {points[micro] / 1e12:.2f} TFLOP per sequence per "
          f"device against {points[cheapest] / 1e12:.2f} at {cheapest}: {extra:+.0%} recompute, a larger "
          "micro-batch trades memory for it")


_THIN = 0.01  # a pick leaving less than this share of the usable memory free is marked thin


def thin_note(row: Mapping[str, Any], micro: int) -> str | None:
  """Where a row at ``micro`` leaves less than 1% of the usable memory free, one sentence saying so: near its
  limit the compiler's schedule lands within about 1.5% either side (DESIGN's sixth round), so a change of
  model code or compiler version can tip it over; None otherwise, or where the figures are missing.

  Example::

    >>> row = {"lever": "zero1-pod", "hbm_bytes": 80 * 2**30, "headroom_bytes_per_device": 2**30 // 20}
    >>> print(thin_note(row, 128).replace("; ", ";\\n").replace(": a", ":\\na"))
    thin: zero1-pod at micro-batch 128 leaves 0.05 GiB of 80.00 GiB usable free (0.06%, under 1%);
    near its limit the compiler lands within about 1.5% either side:
    a smaller micro-batch or --margin leaves room
  """
  room, usable = _headroom_at(row, micro), row.get("hbm_bytes")
  if room is None or not usable or room >= _THIN * usable:
    return None
  return (f"thin: {row['lever']} at micro-batch {micro} leaves {room / 2**30:.2f} GiB of "
          f"{usable / 2**30:.2f} GiB usable free ({room / usable:.2%}, under 1%); near its limit the "
          "compiler lands within about 1.5% either side: a smaller micro-batch or --margin leaves room")


def splits_nothing(row: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> bool:
  """Whether a Zero-1 row holds the baseline's optimizer state per device (the baseline's row of the same step
  and remat, within 0.1%), with none of it in host memory: its layout split nothing (a data axis of size 1,
  or no leaf that divides), so it is the baseline under another name.

  Example::

    >>> base = {"lever": "baseline", "opt_state_bytes_per_device": 1000}
    >>> pod = {"lever": "zero1-pod", "opt_state_bytes_per_device": 1000}
    >>> splits_nothing(pod, [base, pod]), splits_nothing({**pod, "opt_state_bytes_per_device": 250}, [base])
    (True, False)
  """
  if row["lever"] == "baseline" or (row.get("opt_state_bytes_by_memory_kind") or {}).get("pinned_host"):
    return False
  same = lambda r: (r.get("step", "one"), r.get("remat")) == (row.get("step", "one"), row.get("remat"))
  base = next((r for r in rows if r["lever"] == "baseline" and same(r)), None)
  mine, theirs = row.get("opt_state_bytes_per_device"), (base or {}).get("opt_state_bytes_per_device")
  if mine is None or theirs is None:
    return False
  return abs(mine - theirs) <= 0.001 * theirs


def sent_bytes_of(row: Mapping[str, Any]) -> int:
  """The collective bytes one device sends per step on every network together, one basis on every backend:
  on a pod, its bytes inside the slice or node plus those between them (a TPU program's megascale transfers
  are not among its collectives; a GPU program's node-spanning collectives are, split between the two);
  elsewhere its collectives' sent bytes (the results' bytes where a row has no send count).

  Example::

    >>> sent_bytes_of({"collectives": {"sent_per_step": {"all-reduce": {"count": 1, "bytes": 6}}}})
    6
    >>> sent_bytes_of({"network_per_step": {"fast": {"bytes": 6}, "slow": {"bytes": 2}}})
    8
  """
  network = row.get("network_per_step")
  if network:
    return network["fast"]["bytes"] + network["slow"]["bytes"]
  collectives = row.get("collectives") or {}
  per_step = collectives.get("sent_per_step") or collectives.get("per_step", {})
  return sum(v["bytes"] for v in per_step.values())


def across_bytes_of(row: Mapping[str, Any]) -> int:
  """The bytes one device sends per step between slices or nodes (0 on one slice or node).

  Example::

    >>> across_bytes_of({"collectives": {"across_per_step": {"all-gather": {"count": 2, "bytes": 8}}}})
    8
  """
  return sum(v["bytes"] for v in ((row.get("collectives") or {}).get("across_per_step") or {}).values())


def _headroom_at(row: Mapping[str, Any], batch: int) -> int | None:
  """The usable bytes a row leaves free at ``batch``: its search's compile there, else its own."""
  at = _figures_at(row, batch)
  return at.get("headroom_bytes_per_device")


def _figures_at(row: Mapping[str, Any], batch: int) -> Mapping[str, Any]:
  """The row's figures at ``batch``: its search's compile there, else the row itself (its own batch)."""
  return next((p for p in row.get("search", ()) if p["batch"] == batch), row)


def baseline_beats(rows: Sequence[Mapping[str, Any]], batch: int) -> list[str]:
  """One sentence for each Zero-1 lever that fits a smaller micro-batch than ``nnx.Optimizer``, saying why:
  its temporaries against the arguments it saves, at the baseline's largest micro-batch where a search
  compiled both there, else at the plan's.

  Example::

    >>> g = 2**30
    >>> base = {"lever": "baseline", "step": "one", "max_micro_batch": 48, "search": [
    ...     {"batch": 48, "temp_bytes_per_device": 12 * g, "argument_bytes_per_device": 3 * g}]}
    >>> z = {"lever": "zero1", "step": "one", "max_micro_batch": 44, "search": [
    ...     {"batch": 48, "temp_bytes_per_device": 14 * g, "argument_bytes_per_device": 1.5 * g}]}
    >>> line = baseline_beats([base, z], 8)[0]
    >>> print(*line.replace(": ", ", ").split(", "), sep="\\n")
    baseline fits micro-batch 48 where zero1 fits 44
    at micro-batch 48 (one step) zero1's temporaries are +2.00 GiB against the baseline's
    more than the 1.50 GiB its arguments save
  """
  out = []
  for step in dict.fromkeys(r.get("step", "one") for r in rows):
    same = [r for r in rows if r.get("step", "one") == step]
    base = next((r for r in same if r["lever"] == "baseline"), None)
    if base is None:
      continue
    at_base = micro_batch_of(base, batch) or 0
    for r in same:
      at_lever = micro_batch_of(r, batch) or 0
      if r["lever"] == "baseline" or at_lever >= at_base:
        continue
      if at_base in fitted_at(r, batch):  # its own compile fitted there: it does not fit less
        continue
      b, z, compared = _figures_at(base, at_base), _figures_at(r, at_base), at_base
      if b is base or z is r:  # no search compiled both there: the plan's own micro-batch
        b, z, compared = base, r, batch
      if z.get("temp_bytes_per_device") is None or b.get("temp_bytes_per_device") is None:
        why = (z.get("error") or "no figures")[:160]
        out.append(f"baseline fits micro-batch {at_base} where {r['lever']} fits {at_lever or 'none'}: at "
                   f"micro-batch {compared} ({step} step) the compiler refused {r['lever']}: {why}")
        continue
      temp = z["temp_bytes_per_device"] - b["temp_bytes_per_device"]
      args = (b.get("argument_bytes_per_device") or 0) - (z.get("argument_bytes_per_device") or 0)
      saved = (f"more than the {args / 2**30:.2f} GiB its arguments save" if temp > args
               else f"and its arguments save {args / 2**30:.2f} GiB")
      out.append(f"baseline fits micro-batch {at_base} where {r['lever']} fits {at_lever or 'none'}: at "
                 f"micro-batch {compared} ({step} step) {r['lever']}'s temporaries are "
                 f"{temp / 2**30:+.2f} GiB against the baseline's, {saved}")
  return out


def host_bytes_of(row: Mapping[str, Any]) -> int:
  """The bytes a row's step copies between host and device memory: its offloaded state, in and out.

  Example::

    >>> host_bytes_of({"host_argument_bytes_per_device": 100}), host_bytes_of({})
    (200, 0)
  """
  return 2 * (row.get("host_argument_bytes_per_device") or 0)


def narrowed_note(lever: str) -> str | None:
  """What a lever that narrows the gradients' hop between slices or nodes gives up (None: nothing).

  Example::

    >>> narrowed_note("zero1"), narrowed_note("zero1-accum-bf16across")[:44]
    (None, 'zero1-accum-bf16across is not bit-identical:')
  """
  from nnx_zero1_plan.levers import LEVERS

  dtype = LEVERS[lever].accumulate_options.get("across_dtype") if lever in LEVERS else None
  if dtype is None:
    return None
  return (f"{lever} is not bit-identical: its gradients cross between slices or nodes in {dtype} "
          "(across_dtype; docs/pods.md measures the loss against the exact reduction)")


def why_picked(best: Mapping[str, Any], rivals: Sequence[Mapping[str, Any]], micro: int) -> list[str]:
  """One sentence for each lever that fits the same micro-batch as the pick: the headroom each leaves there
  and the bytes each sends, and which of :data:`ORDER` decided.

  Example::

    >>> g = 2**30
    >>> z = {"lever": "zero1", "headroom_bytes_per_device": 5 * g, "collectives": {}}
    >>> b = {"lever": "baseline", "headroom_bytes_per_device": 1 * g, "collectives": {}}
    >>> print(why_picked(z, [b], 8)[0].replace("; ", "\\n"))
    at micro-batch 8 zero1 leaves 5.00 GiB free and baseline 1.00 GiB
    both send 0.00 GiB of collectives per step: zero1 for its headroom
  """
  out = []
  mine, my_room, my_across = sent_bytes_of(best), _headroom_at(best, micro), across_bytes_of(best)
  for rival in rivals:
    theirs, room, their_across = sent_bytes_of(rival), _headroom_at(rival, micro), across_bytes_of(rival)
    gib = lambda n: "?" if n is None else f"{n / 2**30:.2f}"
    if abs(my_across - their_across) > _SAME_BYTES * max(my_across, their_across, 1):
      sent = (f"{best['lever']} sends {gib(my_across)} GiB per step over the slow network and "
              f"{rival['lever']} {gib(their_across)}")
      reason = "its fewer bytes between slices or nodes"
    elif abs(mine - theirs) <= _SAME_BYTES * max(mine, theirs, 1):
      sent, reason = f"both send {gib(mine)} GiB of collectives per step", "its headroom"
      my_host, their_host = host_bytes_of(best), host_bytes_of(rival)
      if abs(my_host - their_host) > _SAME_BYTES * max(my_host, their_host, 1):
        sent += (f"; {best['lever']} copies {gib(my_host)} GiB to and from host memory per step and "
                 f"{rival['lever']} {gib(their_host)}")
        reason = "its fewer bytes over the host link"
    else:
      sent = (f"{best['lever']} sends {gib(mine)} GiB of collectives per step and {rival['lever']} "
              f"{gib(theirs)}")
      reason = "its fewer collective bytes"
    out.append(f"at micro-batch {micro} {best['lever']} leaves {gib(my_room)} GiB free and {rival['lever']} "
               f"{gib(room)} GiB; {sent}: {best['lever']} for {reason}")
  return out


def plan_code(meta: Mapping[str, Any], lever: str, offload_fraction: float | None = None,
              mesh: Mapping[str, int] | None = None) -> str:
  """The code that trains as the plan ``meta`` compiled with ``lever`` (:func:`lever_code`): its model,
  mesh (or ``mesh``, a change's), optimizer and target; a recommendation's and a way out's.

  Example::

    >>> print(plan_code({"model": "maxtext:qwen3-0.6b", "mesh": {"data": 4}}, "zero1-bf16state"))
    Zero1MaxTextTrainingEngine (nnx_zero1.adapters.maxtext) subclassed with STATE_DTYPE = jnp.bfloat16
  """
  return lever_code(lever, str(meta.get("model", "")), offload_fraction, mesh or meta.get("mesh"),
                    meta.get("optimizer", "adamw"), platform=_platform(meta),
                    domains=meta.get("domains") or 1, activation_sharding=meta.get("activation_sharding"))


def _platform(meta: Mapping[str, Any]) -> str:
  """``"tpu"`` or ``"cuda"``: the plan's topology's platform (TPU where a plan names none)."""
  from nnx_zero1_plan.gpu_chips import GPU_CHIPS

  try:
    return parse_topology(str(meta.get("topology", "")), GPU_CHIPS)[0]
  except PlanError:
    return "tpu"


def recommend(rows: Sequence[Mapping[str, Any]], meta: Mapping[str, Any], *,
              step: str | None = None) -> dict[str, Any] | None:
  """The configuration to run, by :data:`ORDER`, among the rows of one step shape.

  Args:
    rows: the plan's rows (each may carry ``max_micro_batch`` from a search, and ``remat``); ``fits`` is
      within the usable memory (the reserve or the margin taken off).
    meta: the plan's settings (``model``, ``topology``, ``mesh``, ``batch``, ``seq_len``, ``ga``, ...).
    step: the step shape to choose among (default: ``split`` for MaxText's engine, else ``one`` where
      there are such rows).

  Returns:
    ``{"lever", "step", "micro_batch", "remat", "code", "cli", "order", "baseline_beats", "why", "notes"}``
    (``notes``: edges not confirmed, levers left out for splitting nothing), or None when no row fits.

  Example::

    >>> g = 2**30
    >>> rows = [{"lever": "baseline", "step": "one", "fits": True, "headroom_bytes_per_device": 7 * g},
    ...         {"lever": "zero1", "step": "one", "fits": True, "headroom_bytes_per_device": 9 * g}]
    >>> meta = {"model": "m:f", "topology": "h100:4", "mesh": {"data": 4}, "batch": 8, "seq_len": 1024,
    ...         "ga": 1}
    >>> recommend(rows, meta)["lever"]
    'zero1'
  """
  shapes = [r.get("step", "one") for r in rows]
  if step is None:
    step = "split" if str(meta.get("model", "")).startswith("maxtext:") else "one"
    step = step if step in shapes else (shapes[0] if shapes else step)
  same_step = [r for r in rows if r.get("step", "one") == step]
  skipped = [f"{r['lever']} holds the baseline's optimizer state per device (its layout splits nothing): "
             "not a candidate" for r in same_step if splits_nothing(r, same_step)]
  edges = {i: micro_batch_of(r, meta["batch"]) for i, r in enumerate(rows)
           if r.get("step", "one") == step and not splits_nothing(r, same_step)}
  if not any(edges.values()):
    return None
  best_micro = max(m for m in edges.values() if m)
  tokens = best_micro * meta["seq_len"] * meta["ga"]
  # Every lever whose own compile fitted at the best micro-batch stands there, above its edge or not.
  level = [(best_micro, across_bytes_of(rows[i]) / tokens, sent_bytes_of(rows[i]) / tokens, i, rows[i])
           for i, m in edges.items() if m == best_micro or best_micro in fitted_at(rows[i], meta["batch"])]
  candidates = list(level)
  # The slow network's bytes first, then all collectives', then the host link's.
  for bytes_of in (lambda c: c[1], lambda c: c[2], lambda c: host_bytes_of(c[4])):
    fewest = min(bytes_of(c) for c in level)
    level = [c for c in level if bytes_of(c) <= fewest * (1 + _SAME_BYTES)]

  def rest(c: tuple) -> tuple:
    remat = c[4].get("remat", meta.get("remat"))
    room = _headroom_at(c[4], best_micro)
    return (-(room or 0), remat not in (None, "none"), c[3])

  best = min(level, key=rest)[4]
  remat = best.get("remat", meta.get("remat"))
  rivals = [c[4] for c in candidates if c[4] is not best]
  unconfirmed = [f"{r['lever']}'s edge is not confirmed ({r['search_unfinished']}): it fits at least "
                 f"{micro_batch_of(r, meta['batch'])}" for r in same_step if r.get("search_unfinished")
                 and not splits_nothing(r, same_step)]
  return {"lever": best["lever"], "step": step, "micro_batch": best_micro, "remat": remat,
          "code": plan_code(meta, best["lever"], best.get("offload_fraction")),
          "cli": command_line(meta, levers=[best["lever"]], steps=[step], batch=best_micro, remat=remat),
          "order": list(ORDER),
          "baseline_beats": baseline_beats(same_step, meta["batch"]),
          "why": why_picked(best, rivals, best_micro),
          "notes": [*unconfirmed, *skipped, *filter(None, [thin_note(best, best_micro),
                                                          recompute_note(best, best_micro),
                                                          narrowed_note(best["lever"])])]}
