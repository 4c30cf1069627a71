"""A plan, end to end: every lever's step compiled whole for the target (reduced depths for an estimate)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from nnx_zero1_plan import compilers
from nnx_zero1_plan.depth import NEAR, estimate_mark, extrapolate_row, near_the_limit, not_alike
from nnx_zero1_plan.inputs import (
  PlanError,
  check_axis_names,
  command_line,
  mesh_axes,
  micro_batch,
  parse_mesh,
  parse_model,
  shortened,
)
from nnx_zero1_plan.levers import LEVERS, lever_blocker, state_axes, with_offload
from nnx_zero1_plan.networks import network_per_step
from nnx_zero1_plan.recommend import recommend
from nnx_zero1_plan.request import STEPS, PlanRequest
from nnx_zero1_plan.search import fits_in, offload_search, search_row
from nnx_zero1_plan.table import markdown, next_steps, recommendation_lines, table, way_out_lines
from nnx_zero1_plan.tunix_sharding import sharding_of
from nnx_zero1_plan.way_out import Change, changes_to_try, find_way_out

__all__ = ["Plan", "make_plan"]

_EXTRAPOLATED = ("opt_state_bytes_per_device", "argument_bytes_per_device", "output_bytes_per_device",
                 "alias_bytes_per_device", "temp_bytes_per_device", "peak_bytes_per_device",
                 "formula_peak_bytes_per_device", "flops_per_device", "host_argument_bytes_per_device",
                 "collectives", "update_peak_bytes_per_device",
                 "update_temp_bytes_per_device", "update_flops_per_device",
                 "update_bytes_accessed_per_device")


@dataclasses.dataclass
class Plan:
  """What each lever needs per device on the target; ``str()`` is the printed table.

  Attributes:
    rows: one dict per lever (plan.json's rows).
    meta: the settings and the compilers.
    next_steps: what to try next, in order, when no row fits (empty otherwise).
    recommendation: the configuration to run (see :func:`nnx_zero1_plan.recommend.recommend`), or None
      when no row fits with the margin.
    way_out: when no row fits, the changes compiled to make room and the first that fits
      (:func:`nnx_zero1_plan.way_out.find_way_out`); None otherwise.
  """

  rows: list[dict[str, Any]]
  meta: dict[str, Any]
  next_steps: list[str]
  recommendation: dict[str, Any] | None = None
  way_out: dict[str, Any] | None = None

  def __str__(self) -> str:
    stated = [f"\n{self.meta['batch_default']}"] if self.meta.get("batch_default") else []
    lines = [table(self.rows, wide=False), *stated, *recommendation_lines(self.recommendation, self.meta),
             *way_out_lines(self.way_out)]
    if self.next_steps:
      steps = (f"  {i}. {s}" for i, s in enumerate(self.next_steps, 1))
      lines += ["", "Nothing fits. Try next, in order:", *steps]
    return "\n".join(lines)

  def write(self, out_dir: str) -> list[str]:
    """Writes plan.json and plan.md into ``out_dir``; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, "plan.json"), os.path.join(out_dir, "plan.md")]
    with open(paths[0], "w") as f:
      result = {"meta": self.meta, "rows": self.rows, "recommendation": self.recommendation,
                "way_out": self.way_out, "next_steps": self.next_steps}
      json.dump(result, f, indent=1, default=str)
    with open(paths[1], "w") as f:
      f.write(markdown(self.meta, self.rows, self.next_steps, self.recommendation, self.way_out))
    return paths


def _measured(lever_name: str, step: str, source: Any, depth: int | None, mesh: Any,
              settings: dict[str, Any]) -> dict:
  """One compile of the lever's step at ``depth``: its per-device figures, or the compiler's refusal."""
  import jax

  from nnx_zero1_plan.abstract import abstract_bytes_per_device, state_split
  from nnx_zero1_plan.compiled import (
    collectives_of,
    cost,
    hbm_oom,
    memory,
    row_figures,
    split_collectives_of,
    split_memory,
    step_flops,
  )
  from nnx_zero1_plan.maxtext import MaxTextModel, measure_maxtext
  from nnx_zero1_plan.steps import compile_split, compile_step, lever_state

  lever = LEVERS[lever_name]
  say = settings.get("progress") or (lambda line: None)
  at = f"{lever_name} ({step}) at micro-batch {settings['batch']}" + (f", {depth} layers" if depth else "")
  if lever.picks_offload:
    lever = with_offload(lever, settings.get("offload_fraction", 0.0))
    at += f", {settings.get('offload_fraction', 0.0):.0%} of the state offloaded"
  say(f"compiling {at} ...")
  row: dict[str, Any] = {"opt_state_bytes_per_device": None, "opt_state_bytes_by_memory_kind": None,
                         "param_bytes_per_device": None}
  started = time.perf_counter()
  try:  # Zero1Error (a ValueError) when the optimizer refuses the model, the compiler's refusals
    if isinstance(source, MaxTextModel):
      measured = measure_maxtext(lever_name, lever, source.overrides)
      say(f"compiled {at} in {measured['compile_s']:.0f} s: peak "
          f"{measured['peak_bytes_per_device'] / 2**30:.2f} GiB")
      return measured
    shapes = (source.loss_fn, mesh, settings["batch"], settings["seq_len"], settings["ga"])
    state = lever_state(lever, lambda: source.build(depth), settings["optimizer"], mesh)
    by_kind = state.opt_state_bytes_by_memory_kind
    row = {"opt_state_bytes_per_device": by_kind.get("device", 0), "opt_state_bytes_by_memory_kind": by_kind,
           "param_bytes_per_device": abstract_bytes_per_device(state.state[0]),
           "state_split": {"axes": list(state_axes(lever)), "share": state_split(state.state[1],
                                                                                   state_axes(lever))}}
    if step == "one":
      compiled, seconds = compile_step(lever, state, *shapes)
    else:
      grads, update, seconds = compile_split(lever, state, *shapes)
  except (jax.errors.JaxRuntimeError, ValueError, TypeError, NotImplementedError) as e:
    error = shortened(f"{type(e).__name__}: {' '.join(str(e).split())}", 400)
    refused = {"error": error, "hbm_oom": hbm_oom(str(e)), "compile_s": time.perf_counter() - started}
    say(f"compiled {at}: refused in {refused['compile_s']:.0f} s ({shortened(error, 160)})")
    return {**dict.fromkeys(_EXTRAPOLATED), **row, **refused}
  if step == "one":
    figures = row_figures(memory(compiled), collectives_of(compiled, _domains_in_order(mesh)))
  else:
    mem = split_memory(memory(grads), memory(update), row["opt_state_bytes_per_device"])
    figures = row_figures(mem, split_collectives_of(grads, update, _domains_in_order(mesh)), cost(update))
  flops, source = step_flops(compiled if step == "one" else grads)
  figures = {**figures, "flops_per_device": flops, "flops_source": source}
  say(f"compiled {at} in {seconds:.0f} s: peak {figures['peak_bytes_per_device'] / 2**30:.2f} GiB")
  return {**row, "error": None, "hbm_oom": None, "compile_s": seconds, **figures}


def _lever_row(lever: str, step: str, source: Any, depths: Sequence[int] | None, mesh: Any,
               settings: dict) -> dict:
  if not depths:
    row = _measured(lever, step, source, None, mesh, settings)
    return {**row, "depth": source.full_depth, "depth_extrapolated_from": None}
  d1, d2 = depths
  r1 = _measured(lever, step, source, d1, mesh, settings)
  r2 = _measured(lever, step, source, d2, mesh, settings) if not r1["error"] else r1
  compile_s = r1["compile_s"] + (r2["compile_s"] if r2 is not r1 else 0.0)
  if r1["error"] or r2["error"]:
    return {**(r1 if r1["error"] else r2), "compile_s": compile_s, "depth": d1 if r1["error"] else d2,
            "depth_extrapolated_from": None}
  keys = (*_EXTRAPOLATED, "opt_state_bytes_by_memory_kind", "param_bytes_per_device")
  row = extrapolate_row(r1, r2, d1, d2, source.full_depth, keys)
  doubt = (not_alike(r1["temp_bytes_per_device"], r2["temp_bytes_per_device"], d1, d2)
           or not_alike(r1["peak_bytes_per_device"], r2["peak_bytes_per_device"], d1, d2, "peak"))
  return {**row, "compile_s": compile_s, "depth": source.full_depth, "depth_extrapolated_from": [d1, d2],
          "not_alike": doubt}


@dataclasses.dataclass(frozen=True)
class _Model:
  """What a plan compiles: the model at a micro-batch, its mesh, and what the checks and hints need."""

  source_at: Callable[[int], Any]  # global micro-batch -> ModelSource or MaxTextModel
  axes: dict[str, int]
  device_mesh: Any  # None for MaxText (its engine builds its own)
  reduced: tuple[int, ...] | None  # the depths compiled and extrapolated from (None: whole)
  batch_unit: int  # a micro-batch is a multiple of the batch axes' size
  param_dtypes: frozenset[str]
  remat_hint: str | None  # the remat policy "Try next" suggests (None: the model takes no --remat)
  named: tuple[str, ...] = ()  # the mesh axes the model's variables name


def _tunix_or_own(model: str, platform: str, sizes: dict[str, int], estimate: bool, depths: Sequence[int],
                  dtypes_and_remat: tuple) -> _Model:
  """A ``tunix:`` or ``package.module:function`` model, described from one abstract build (no compiler
  needed): the axes it names (a ``--mesh`` axis it does not name is refused here) and its dtypes."""
  from nnx_zero1_plan.abstract import describe_model
  from nnx_zero1_plan.models import model_source

  source = model_source(model, *dtypes_and_remat)
  # An estimate is for TPUs only: XLA's GPU compiler compiles a whole program in minutes, and schedules a
  # deep program's collectives unlike a shallow one's (Zero-1's temp on qwen3_8b: 2.70 GiB by the line,
  # 7.95 whole).
  shallow = not source.full_depth or source.full_depth <= max(depths)
  reduced = tuple(depths) if estimate and platform == "tpu" and not shallow else None
  named, dtypes = describe_model(lambda: source.build(reduced[0] if reduced else None))
  check_axis_names(sizes, named)
  remat_hint = "decoder" if parse_model(model)[0] == "tunix" else None
  return _Model(lambda b: source, dict(sizes), None, reduced, 1, dtypes, remat_hint, named)


def _on_devices(planned: _Model, target: Any) -> _Model:
  """``planned`` on the target's devices: every mesh axis sized (``replica`` across the slices or nodes), the
  device mesh, the batch's unit."""
  import numpy as np
  from jax.sharding import AxisType, Mesh

  from nnx_zero1_plan.steps import batch_axes

  where = "slices" if target.platform == "tpu" else "nodes"
  axes = mesh_axes(planned.axes, planned.named, len(target.devices), domains=target.domains, where=where)
  device_mesh = Mesh(np.array(target.devices).reshape(tuple(axes.values())), tuple(axes),
                     axis_types=(AxisType.Auto,) * len(axes))
  rows_over = math.prod(axes[a] for a in batch_axes(device_mesh))
  return dataclasses.replace(planned, axes=axes, device_mesh=device_mesh, batch_unit=rows_over)


def _batch_words(planned: _Model) -> str:
  """The batch axes, as the refusal and the default's sentence name them (``replica x data``)."""
  from nnx_zero1_plan.steps import batch_axes

  return " x ".join(batch_axes(planned.device_mesh)) if planned.device_mesh is not None else "the devices"


def _domains_in_order(mesh: Any) -> list[int] | None:
  """Each device's slice or node, in the mesh's order (None without a device mesh: MaxText builds its own)."""
  from nnx_zero1_plan.targets import domain_of

  return None if mesh is None else [domain_of(d) for d in mesh.devices.flat]


def _refuse_blocked(names: Sequence[str], planned: _Model, model: str, domains: int) -> dict[str, str]:
  """The levers that cannot apply to the model or the target, and why; raises when one was asked for."""
  blocked = {n: why for n in LEVERS if (why := lever_blocker(n, planned.param_dtypes, domains))}
  for name in names:
    if name in blocked:
      raise PlanError(f"--levers {name} does not apply to {model}: {blocked[name]}")
  return blocked


def _maxtext(name: str, topology: str, target: Any, sizes: dict[str, int], settings: dict[str, Any],
             dtypes_and_remat: tuple, overrides: Mapping[str, str] | None) -> _Model:
  """A ``maxtext:`` model: its config's overrides at each micro-batch (MaxText builds its own mesh)."""
  from nnx_zero1_plan.maxtext import MaxTextModel, config_overrides, mesh_axis_names

  if target.platform != "tpu":
    raise PlanError(f"maxtext:{name} compiles through MaxText's ahead-of-time engine, for TPU slices only; "
                    f"{topology} is a GPU target")
  try:
    known = mesh_axis_names()
  except ImportError as e:
    raise PlanError(f"maxtext:{name} needs MaxText (Python >= 3.12), from a clone: pip install -r "
                    f".ci/requirements-newest.txt && pip install --no-deps maxtext==0.2.5 ({e})") from e
  axes = mesh_axes(sizes, (), len(target.devices) // target.domains)  # one slice's: MaxText's ici_* axes
  param_dtype, compute_dtype, remat = dtypes_and_remat

  def source_at(batch: int) -> MaxTextModel:
    config = config_overrides(name, topology, len(target.devices), axes, batch=batch,
                              seq_len=settings["seq_len"], ga=settings["ga"], optimizer=settings["optimizer"],
                              param_dtype=param_dtype, compute_dtype=compute_dtype, remat=remat,
                              known_axes=known, overrides=overrides, slices=target.domains)
    return MaxTextModel(f"maxtext:{name}", config)

  source_at(settings["batch"])  # the settings checked before any compile
  weights = (overrides or {}).get("weight_dtype") or param_dtype or "float32"
  return _Model(source_at, axes, None, None, len(target.devices), frozenset({weights}), "full")


def _row(name: str, step: str, model: _Model, batch: int, settings: dict[str, Any], target: Any,
         topology: str, usable: int) -> dict:
  """One lever's row at one micro-batch, compiled whole; for an estimate (``model.reduced``), compiled at
  reduced depths and extrapolated, and compiled whole anyway where the line comes near the limit or the two
  depths disagree. ``fits``: the compiler accepted the whole program and its peak is within ``usable``
  (the memory less the reserve); an estimate's is None and ``fits_estimate`` says what the line says."""
  settings = {**settings, "batch": batch}
  source = model.source_at(batch)
  row = _lever_row(name, step, source, model.reduced, model.device_mesh, settings)
  near = row["depth_extrapolated_from"] and near_the_limit(row["peak_bytes_per_device"], target.hbm_bytes)
  if near or row.get("not_alike"):
    extrapolated = row
    row = _lever_row(name, step, source, None, model.device_mesh, settings)
    row = {**row, "compile_s": row["compile_s"] + extrapolated["compile_s"],
           "extrapolated_peak_bytes_per_device": extrapolated["peak_bytes_per_device"],
           "compiled_whole_because": extrapolated.get("not_alike") or NEAR}
  peak = row.get("peak_bytes_per_device")
  verdict = fits_in(row, usable)
  row = {**row, "headroom_bytes_per_device": None if peak is None else usable - peak}
  if row["depth_extrapolated_from"]:
    row = {**row, "estimate": estimate_mark(row, (*_EXTRAPOLATED, "headroom_bytes_per_device")),
           "fits_estimate": verdict}
    verdict = None
  if target.domains > 1 and row.get("collectives"):
    row = {**row, "network_per_step": network_per_step(row["collectives"], target.chip, target.platform)}
  return {"lever": name, "step": step, "compiled_for": topology, "device_kind": target.device_kind,
          "mesh": model.axes, "model": source.name, "batch": batch, **row,
          "activation_sharding": sharding_of(source, model.axes),
          "compile_s": round(row["compile_s"], 1), "hbm_bytes": target.hbm_bytes, "usable_bytes": usable,
          "fits": verdict}


def make_plan(request: PlanRequest, progress: Callable[[str], None] | None = None) -> Plan:
  """Compiles every lever's training step for the request's topology in this process, which it keeps on
  jax's CPU backend and expects prepared for the compilers (the command line's, after
  :func:`nnx_zero1_plan.compilers.start_cpu_jax`, or the planning process :func:`nnx_zero1_plan.plan` starts).

  Args:
    request: the plan's settings, checked.
    progress: called with one line as each compile starts and ends, and after each lever.

  Returns:
    The :class:`Plan`.

  Raises:
    PlanError: what only the model or the compiler can tell (an axis the model does not name, a lever
      that cannot apply, a topology libtpu does not know).
    AotUnavailable: the target's compiler is not installed.
  """
  from nnx_zero1_plan.targets import require_compiler

  r = request
  kind, model_name = parse_model(r.model)
  names, shapes, sizes, policies, platform = r.levers, r.steps, parse_mesh(r.mesh), r.policies, r.platform
  compilers.keep_jax_on_cpu()
  if kind != "maxtext":  # described before the compiler is looked for: a misspelt axis needs none
    plans = {p: _tunix_or_own(r.model, platform, sizes, r.estimate, r.depths,
                              (r.param_dtype, r.compute_dtype, p, r.tunix_sharding)) for p in policies}
    blocked = _refuse_blocked(names, plans[policies[0]], r.model, r.domains)
  compiler = require_compiler(r.topology)
  import jax

  from nnx_zero1_plan.compiled import PEAK_SOURCE
  from nnx_zero1_plan.targets import make_target, usable_bytes

  target = make_target(r.topology, r.gpu_memory_fraction, r.slices)
  topology = r.topology
  if kind != "maxtext":
    plans = {p: _on_devices(m, target) for p, m in plans.items()}
  # MaxText splits its global batch over every device (per_device_batch_size), and checks it itself.
  unit, over = ((len(target.devices), "every device") if kind == "maxtext"
                else (plans[policies[0]].batch_unit, _batch_words(plans[policies[0]])))
  batch = r.batch if kind == "maxtext" and r.batch is not None else micro_batch(r.batch, unit, over)
  batch_default = None if r.batch is not None else (
      f"--batch not given: micro-batch {batch}, the smallest of at least 8 sequences that splits over the "
      f"batch axes ({over} = {unit} devices)")
  if batch_default and progress:
    progress(batch_default)
  settings: dict[str, Any] = {"batch": batch, "seq_len": r.seq_len, "ga": r.ga, "optimizer": r.optimizer,
                              "progress": progress}
  if kind == "maxtext":
    plans = {p: _maxtext(model_name, topology, target, sizes, settings, (r.param_dtype, r.compute_dtype, p),
                         r.overrides) for p in policies}
    blocked = _refuse_blocked(names, plans[policies[0]], r.model, r.domains)
  planned = plans[policies[0]]  # the axes, the batch's unit and the hints are the same under every policy
  usable = usable_bytes(target.hbm_bytes, target.platform, r.margin)
  rows = []
  for policy, name, step in ((p, n, s) for p in policies for n in names for s in shapes):
    row_at = lambda b, p=policy, n=name, s=step: {
        **_row(n, s, plans[p], b, settings, target, topology, usable), "remat": p}
    if LEVERS[name].picks_offload:  # the fraction is searched at --batch, the micro-batch is not
      def row_with(f: float, p: Any = policy, n: str = name, s: str = step) -> dict:
        return {**_row(n, s, plans[p], batch, {**settings, "offload_fraction": f}, target, topology, usable),
                "remat": p}
      row = offload_search(row_with, usable)
    else:
      row = row_at(batch)
    if r.search and not LEVERS[name].picks_offload:
      row = {**row, **search_row(row, row_at, planned.batch_unit, usable)}
    rows.append(row)
    if progress:
      found = ""
      if "max_micro_batch" in row:
        found = f"; the largest micro-batch that fits: {row['max_micro_batch']}"
      if "offload_fraction" in row:
        found = f"; the smallest share of the state to offload: {row['offload_fraction']:.0%}"
      under = f", remat {policy}" if policy else ""
      progress(f"done: {name} ({step}{under}) for {topology}{found}")
  layers = planned.source_at(batch).full_depth or next(
      (int(row["maxtext_config"]["num_decoder_layers"]) for row in rows if row.get("maxtext_config")), None)
  extrapolated = [row["depth_extrapolated_from"] for row in rows if row.get("depth_extrapolated_from")]
  meta = {"model": planned.source_at(batch).name, "layers": layers, "topology": topology,
          "device_kind": target.device_kind, "mesh": planned.axes, "batch": batch, "seq_len": r.seq_len,
          "batch_default": batch_default, "ga": r.ga, "optimizer": r.optimizer, "param_dtype": r.param_dtype,
          "param_dtypes": sorted(planned.param_dtypes), "compute_dtype": r.compute_dtype, "remat": r.remat,
          "levers": list(names), "steps": {s: STEPS[s] for s in shapes}, "compiler": compiler,
          "jax": jax.__version__, "hbm_bytes": target.hbm_bytes, "hbm_source": target.hbm_source,
          "usable_bytes": usable, "peak_source": PEAK_SOURCE,
          "gpu_memory_fraction": r.gpu_memory_fraction if target.platform == "cuda" else None,
          "depth_extrapolated_from": extrapolated[0] if extrapolated else None,
          "estimate": r.estimate, "overrides": r.overrides, "search": r.search, "margin": r.margin,
          "batch_unit": planned.batch_unit, "slices": r.slices, "domains": target.domains,
          "activation_sharding": sharding_of(planned.source_at(batch), planned.axes),
          "tunix_sharding": r.tunix_sharding, "gpus_per_node": r.gpus_per_node}
  hints = next_steps(rows, meta, list(LEVERS), blocked=blocked, remat=planned.remat_hint,
                     batch_unit=planned.batch_unit)
  way_out = None
  if rows and not r.estimate and not any(row["fits"] for row in rows):

    def compile_changed(change: Change) -> dict:
      s = change.settings
      policy = s.get("remat", policies[0])
      try:
        if kind == "maxtext":
          model = _maxtext(model_name, topology, target, sizes, settings,
                           (r.param_dtype, r.compute_dtype, policy), r.overrides)
        else:
          model = _on_devices(_tunix_or_own(r.model, platform, s.get("mesh", sizes), False, r.depths,
                                            (r.param_dtype, r.compute_dtype, policy)), target)
          micro_batch(s.get("batch", batch), model.batch_unit, _batch_words(model))
      except PlanError as e:
        return {"fits": False, "error": str(e)}
      changed = {**settings, "ga": s.get("ga", r.ga)}
      return _row(s["levers"][0], shapes[0], model, s.get("batch", batch), changed, target, topology, usable)

    lever = "zero1" if "zero1" not in blocked else "baseline"
    changes = changes_to_try(meta, lever=lever, batch_unit=planned.batch_unit, remat=planned.remat_hint,
                             named_axes=planned.named, host_memory=target.platform == "tpu")
    way_out = find_way_out(changes, compile_changed,
                           lambda c: command_line(meta, steps=[shapes[0]], **c.settings))
  return Plan(rows, meta, hints, recommend(rows, meta), way_out)
