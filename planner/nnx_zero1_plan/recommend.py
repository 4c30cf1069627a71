"""The configuration a plan recommends, by a stated order, with the code that writes it.

The order: a row must fit with the margin the user set; then the largest
micro-batch (the most tokens per step per chip); then the fewest collective
bytes per token; then no remat; then the lighter lever. Pure: rows in, one dict
out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from nnx_zero1_plan.inputs import command_line

__all__ = ["ORDER", "micro_batch_of", "lever_code", "recommend", "baseline_beats"]

ORDER = ("fits with the margin", "largest micro-batch", "fewest collective bytes per token", "no remat",
         "the lighter lever")


def micro_batch_of(row: Mapping[str, Any], batch: int, margin: float) -> int | None:
  """The micro-batch a row stands for: its search's edge, else ``batch`` if it fits with the margin.

  Example::

    >>> micro_batch_of({"fits": True, "peak_bytes_per_device": 90, "hbm_bytes": 100}, 8, margin=0.05)
    8
    >>> micro_batch_of({"fits": True, "peak_bytes_per_device": 97, "hbm_bytes": 100}, 8, margin=0.05)
  """
  if "max_micro_batch" in row:
    return row["max_micro_batch"]
  peak = row.get("peak_bytes_per_device")
  if not row.get("fits") or peak is None:
    return None
  return batch if peak <= row["hbm_bytes"] * (1 - margin) else None


def _collective_bytes(row: Mapping[str, Any]) -> int:
  per_step = (row.get("collectives") or {}).get("per_step", {})
  return sum(v["bytes"] for v in per_step.values())


def _spelled(value: Any) -> str:
  """An option's value as code: a dtype's name (the levers hold them as strings) is ``jnp``'s."""
  return f"jnp.{value}" if isinstance(value, str) else repr(value)


def lever_code(name: str, model: str, offload_fraction: float | None = None) -> str:
  """The code that turns lever ``name`` on where ``model``'s users train: their own loop, Tunix's trainers
  (``Zero1TrainingConfig``'s ``zero1_*`` options) or MaxText's engine (the class attributes
  :func:`nnx_zero1_plan.maxtext.engine_attributes` gives). Written from the lever table, so a new lever
  needs no entry here; ``offload-fraction`` writes the ``offload_fraction`` its plan picked.

  Example::

    >>> lever_code("offload", "my_pkg.models:build")
    'Zero1Optimizer(model, tx, mesh, offload_state_to_host=True)'
    >>> lever_code("offload-fraction", "my_pkg.models:build", 0.37)
    'Zero1Optimizer(model, tx, mesh, offload_state_to_host=0.37)'
    >>> lever_code("zero1-bf16state", "maxtext:qwen3-0.6b")
    'Zero1MaxTextTrainingEngine (nnx_zero1.adapters.maxtext) subclassed with STATE_DTYPE = jnp.bfloat16'
  """
  from nnx_zero1_plan.levers import LEVERS, with_offload
  from nnx_zero1_plan.maxtext import engine_attributes

  lever = LEVERS[name]
  if lever.picks_offload:
    lever = with_offload(lever, offload_fraction or 0.0)
  options = [f"{k}={_spelled(v)}" for k, v in lever.optimizer_options.items()]
  if model.startswith("tunix:"):
    if not lever.zero1:
      return "Tunix's PeftTrainer with its TrainingConfig, as it is"
    config = "".join(f", zero1_{option}" for option in options)
    return f"Zero1PeftTrainer (nnx_zero1.adapters.tunix) with Zero1TrainingConfig(...{config})"
  if model.startswith("maxtext:"):
    attributes = engine_attributes(name, lever)
    if attributes is None:
      return "MaxText's own MaxTextTrainingEngine"
    spelled = "; ".join(f"{k} = {_spelled(v)}" for k, v in attributes.items())
    return "Zero1MaxTextTrainingEngine (nnx_zero1.adapters.maxtext)" + (f" subclassed with {spelled}"
                                                                      if spelled else "")
  if not lever.zero1:
    return "nnx.Optimizer(model, tx, wrt=nnx.Param)"
  code = f"Zero1Optimizer({', '.join(['model, tx, mesh', *options])})"
  if lever.deferred:
    accumulate = "".join(f", {k}={_spelled(v)}" for k, v in lever.accumulate_options.items())
    code += (f"; grads from value_and_grad_accumulated(loss_fn, model, batch, micro_batches=GA, "
             f"optimizer=optimizer{accumulate})")
  return code


def _figures_at(row: Mapping[str, Any], batch: int) -> Mapping[str, Any]:
  """The row's figures at ``batch``: its search's compile there, else the row itself (its own batch)."""
  return next((p for p in row.get("search", ()) if p["batch"] == batch), row)


def baseline_beats(rows: Sequence[Mapping[str, Any]], batch: int, margin: float) -> list[str]:
  """One sentence for each Zero-1 lever that fits a smaller micro-batch than ``nnx.Optimizer``, saying why:
  its temporaries against the arguments it saves, at the baseline's largest micro-batch where a search
  compiled both there, else at the plan's.

  Example::

    >>> g = 2**30
    >>> base = {"lever": "baseline", "step": "one", "max_micro_batch": 48, "search": [
    ...     {"batch": 48, "temp_bytes_per_device": 12 * g, "argument_bytes_per_device": 3 * g}]}
    >>> z = {"lever": "zero1", "step": "one", "max_micro_batch": 44, "search": [
    ...     {"batch": 48, "temp_bytes_per_device": 14 * g, "argument_bytes_per_device": 1.5 * g}]}
    >>> line = baseline_beats([base, z], 8, 0.0)[0]
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
    at_base = micro_batch_of(base, batch, margin) or 0
    for r in same:
      at_lever = micro_batch_of(r, batch, margin) or 0
      if r["lever"] == "baseline" or at_lever >= at_base:
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


def recommend(rows: Sequence[Mapping[str, Any]], meta: Mapping[str, Any], *, margin: float = 0.05,
              step: str | None = None) -> dict[str, Any] | None:
  """The configuration to run, by :data:`ORDER`, among the rows of one step shape.

  Args:
    rows: the plan's rows (each may carry ``max_micro_batch`` from a search, and ``remat``).
    meta: the plan's settings (``model``, ``topology``, ``mesh``, ``batch``, ``seq_len``, ``ga``, ...).
    margin: the share of the usable memory to leave free (0.05: a row must fit in 95%).
    step: the step shape to choose among (default: ``split`` for MaxText's engine, else ``one`` where
      there are such rows).

  Returns:
    ``{"lever", "step", "micro_batch", "remat", "code", "cli", "order", "baseline_beats"}``, or None when no
    row fits with the margin.

  Example::

    >>> g = 2**30
    >>> rows = [{"lever": "baseline", "step": "one", "fits": True, "peak_bytes_per_device": 9 * g,
    ...          "hbm_bytes": 16 * g}, {"lever": "zero1", "step": "one", "fits": True,
    ...          "peak_bytes_per_device": 7 * g, "hbm_bytes": 16 * g}]
    >>> meta = {"model": "m:f", "topology": "h100:4", "mesh": {"data": 4}, "batch": 8, "seq_len": 1024,
    ...         "ga": 1}
    >>> recommend(rows, meta)["lever"]
    'baseline'
  """
  shapes = [r.get("step", "one") for r in rows]
  if step is None:
    step = "split" if str(meta.get("model", "")).startswith("maxtext:") else "one"
    step = step if step in shapes else (shapes[0] if shapes else step)
  candidates = []
  for order, r in enumerate(rows):
    micro = micro_batch_of(r, meta["batch"], margin)
    if r.get("step", "one") != step or not micro:
      continue
    tokens = micro * meta["seq_len"] * meta["ga"]
    remat = r.get("remat", meta.get("remat"))
    key = (-micro, _collective_bytes(r) / tokens, remat not in (None, "none"), order)
    candidates.append((key, r, micro, remat))
  if not candidates:
    return None
  _, best, micro, remat = min(candidates, key=lambda c: c[0])
  return {"lever": best["lever"], "step": step, "micro_batch": micro, "remat": remat,
          "code": lever_code(best["lever"], str(meta.get("model", "")), best.get("offload_fraction")),
          "cli": command_line(meta, levers=[best["lever"]], steps=[step], batch=micro, remat=remat),
          "order": list(ORDER),
          "baseline_beats": baseline_beats([r for r in rows if r.get("step", "one") == step], meta["batch"],
                                           margin)}
