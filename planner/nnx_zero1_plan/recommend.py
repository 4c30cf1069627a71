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

__all__ = ["ORDER", "LEVER_CODE", "micro_batch_of", "recommend", "baseline_beats"]

ORDER = ("fits with the margin", "largest micro-batch", "fewest collective bytes per token", "no remat",
         "the lighter lever")

# The constructor line that turns each lever on in an own nnx loop.
LEVER_CODE = {
    "baseline": "nnx.Optimizer(model, tx, wrt=nnx.Param)",
    "zero1": "Zero1Optimizer(model, tx, mesh)",
    "zero1-accum": "Zero1Optimizer(model, tx, mesh); grads from value_and_grad_accumulated(loss_fn, model, "
                   "batch, micro_batches=GA, optimizer=optimizer)",
    "zero2": "Zero1Optimizer(model, tx, mesh); grads from value_and_grad_accumulated(loss_fn, model, batch, "
             "micro_batches=GA, optimizer=optimizer, shard_accumulator=True)",
    "offload": "Zero1Optimizer(model, tx, mesh, offload_state_to_host=True)",
    "zero2-offload": "Zero1Optimizer(model, tx, mesh, offload_state_to_host=True); grads from "
                     "value_and_grad_accumulated(..., shard_accumulator=True)",
    "zero1-bf16state": "Zero1Optimizer(model, tx, mesh, state_dtype=jnp.bfloat16)",
    "zero1-master": "Zero1Optimizer(model, tx, mesh, master_dtype=jnp.float32)",
}
# Tunix's trainers read the options off TrainingConfig attributes named zero1_<option>.
_TUNIX_OPTIONS = {"offload": "zero1_offload_state_to_host=True",
                  "zero1-bf16state": "zero1_state_dtype=jnp.bfloat16",
                  "zero1-master": "zero1_master_dtype=jnp.float32"}
# MaxText's engine reads them off class attributes.
_MAXTEXT_OPTIONS = {"offload": "OFFLOAD_STATE_TO_HOST = True",
                    "zero1-bf16state": "STATE_DTYPE = jnp.bfloat16",
                    "zero1-master": "MASTER_DTYPE = jnp.float32"}


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


def _code(lever: str, model: str) -> str:
  if model.startswith("tunix:"):
    trainer = "nnx.Optimizer via PeftTrainer" if lever == "baseline" else "Zero1PeftTrainer (from " \
        "nnx_zero1.adapters.tunix) in place of PeftTrainer"
    option = _TUNIX_OPTIONS.get(lever)
    return trainer + (f", with training_config.{option}" if option else "")
  if model.startswith("maxtext:"):
    if lever == "baseline":
      return "MaxText's own MaxTextTrainingEngine"
    option = _MAXTEXT_OPTIONS.get(lever)
    return "Zero1MaxTextTrainingEngine (from nnx_zero1.adapters.maxtext)" + (
        f" subclassed with {option}" if option else "")
  return LEVER_CODE[lever]


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
          "code": _code(best["lever"], str(meta.get("model", ""))),
          "cli": command_line(meta, levers=[best["lever"]], steps=[step], batch=micro, remat=remat),
          "order": list(ORDER),
          "baseline_beats": baseline_beats([r for r in rows if r.get("step", "one") == step], meta["batch"],
                                           margin)}
