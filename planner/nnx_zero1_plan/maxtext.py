"""``maxtext:MODEL``: MaxText's own engine as the planner's model, compiled for a TPU slice in the kernels it
runs, a split step at full depth (docs/planner.md's "MaxText models"). Needs Python >= 3.12 and libtpu."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping

from nnx_zero1_plan.abstract import abstract_bytes_per_device, bytes_by_dtype, bytes_by_memory_kind
from nnx_zero1_plan.inputs import ONE_SLICE, PlanError
from nnx_zero1_plan.levers import Lever, engine_attributes, with_offload
from nnx_zero1_plan.mesh_axes import mesh_axes
from nnx_zero1_plan.planned_model import PlannedModel
from nnx_zero1_plan.program_record import ProgramRecord
from nnx_zero1_plan.request import PlanRequest
from nnx_zero1_plan.row import Figures, MaxTextConfig
from nnx_zero1_plan.row_compiler import Compiled, RowCompiler, compile_and_read, compile_words
from nnx_zero1_plan.steps import StepShape
from nnx_zero1_plan.targets import Target

# Never named like a package: a folder named nnx_zero1_plan in the temp folder would shadow the planner (as an
# empty namespace package) in any Python started there.
OUTPUT_PREFIX = "maxtext_out_"

@dataclasses.dataclass(frozen=True)
class MaxTextModel:
  """A MaxText model as the plan compiles it: its name and the whole config's overrides of ``base.yml``."""

  name: str
  overrides: Mapping[str, str]
  full_depth: int | None = None  # compiled whole: MaxText scans its layers
  defer: bool = True  # MaxText's own choice of deferring the data-parallel all-reduce (False: never)


@contextlib.contextmanager
def output_directory() -> Iterator[str]:
  """A fresh folder for MaxText's ``base_output_directory``, removed with what MaxText wrote in it after."""
  folder = tempfile.mkdtemp(prefix=OUTPUT_PREFIX)
  try:
    yield folder
  finally:
    shutil.rmtree(folder, ignore_errors=True)


def mesh_axis_names() -> tuple[str, ...]:
  """The mesh axes MaxText's config sizes (``ici_AXIS_parallelism``), e.g. ``data``, ``fsdp``, ``tensor``."""
  from maxtext.configs import types

  return tuple(n[len("ici_"):-len("_parallelism")] for n in types.IciParallelism.model_fields)


# The plan's --optimizer names MaxText's opt_type knows under the same name.
_OPT_TYPES = ("adamw", "sgd")


def config_overrides(model_name: str, topology: str, devices: int, axes: Mapping[str, int], *,
                     batch: int, seq_len: int, ga: int, optimizer: str, param_dtype: str | None,
                     compute_dtype: str | None, remat: str | None, known_axes: Iterable[str],
                     output_dir: str, overrides: Mapping[str, str] | None = None,
                     slices: int = ONE_SLICE) -> dict[str, str]:
  """MaxText's config for a plan: its ``key=value`` overrides of ``base.yml``, the user's last; a
  :class:`PlanError` for an axis MaxText's mesh has not, an optimizer it does not name alike, or a batch that
  does not split over the devices.

  A mesh axis ``A=n`` is ``ici_A_parallelism=n``; every other axis is 1 (MaxText's ``ici_fsdp_parallelism``
  default, -1, would take the devices left). On several slices ``dcn_data_parallelism`` is their number.
  """
  known = tuple(known_axes)
  unknown = [a for a in axes if a not in known]
  if unknown:
    raise PlanError(f"--mesh axis {', '.join(unknown)} is not MaxText's; its mesh axes: {', '.join(known)}")
  if optimizer not in _OPT_TYPES:
    raise PlanError(f"--optimizer {optimizer} is not a MaxText opt_type; maxtext: models take "
                    f"{', '.join(_OPT_TYPES)} (or opt_type=... as an override)")
  if batch % devices:
    raise PlanError(f"--batch {batch} does not split over the {devices} devices (MaxText's "
                    "per_device_batch_size)")
  config = {
      "model_name": model_name, "run_name": "nnx_zero1_plan", "enable_checkpointing": "false",
      "base_output_directory": output_dir,
      "skip_jax_distributed_system": "true", "enable_goodput_recording": "false",
      "jax_cache_dir": "", "internal_compile": "true", "compile_topology": topology,
      "internal_compile_num_devices": str(devices), "compile_topology_num_slices": str(slices),
      **({"dcn_data_parallelism": str(slices)} if slices > 1 else {}),
      "per_device_batch_size": str(batch // devices), "max_target_length": str(seq_len),
      "gradient_accumulation_steps": str(ga), "opt_type": optimizer,
      **{f"ici_{a}_parallelism": "1" for a in known},
      **{f"ici_{a}_parallelism": str(n) for a, n in axes.items()},
  }
  for key, value in (("weight_dtype", param_dtype), ("dtype", compute_dtype), ("remat_policy", remat)):
    if value is not None:
      config[key] = value
  return {**config, **(overrides or {})}


@dataclasses.dataclass(frozen=True)
class MaxTextModels:
  """``maxtext:`` models as a :class:`~nnx_zero1_plan.planned_model.ModelPlanner`: described by their config
  on the target, MaxText writing under ``output_dir`` (:func:`output_directory`)."""

  output_dir: str

  def described(self, request: PlanRequest, policy: str | None) -> None:
    return None  # the config needs the target's devices

  def on_target(self, request: PlanRequest, described: PlannedModel | None, target: Target,
                policy: str | None) -> PlannedModel:
    """The model under the remat ``policy``: its config's overrides at each micro-batch (each checked as it is
    made: the plan makes its micro-batch's before any compile); a :class:`PlanError` for a target MaxText's
    engine does not compile for, or MaxText missing."""
    model = request.model_ref
    if not target.backend.maxtext_engine:
      raise PlanError(f"{model} compiles through MaxText's ahead-of-time engine, for TPU slices only; "
                      f"{request.topology} is a GPU target")
    try:
      known = mesh_axis_names()
    except ImportError as e:
      raise PlanError(f"{model} needs MaxText (Python >= 3.12), from a clone: pip install -r "
                      f".ci/requirements-newest.txt && pip install --no-deps maxtext==0.2.5 ({e})") from e
    axes = mesh_axes(request.mesh_sizes, (), len(target.devices) // target.domains)

    def source_at(micro_batch: int) -> MaxTextModel:
      config = config_overrides(model.name, request.topology, len(target.devices), axes, batch=micro_batch,
                                seq_len=request.seq_len, ga=request.ga, optimizer=request.optimizer,
                                param_dtype=request.param_dtype, compute_dtype=request.compute_dtype,
                                remat=policy, known_axes=known, output_dir=self.output_dir,
                                overrides=request.overrides, slices=target.domains)
      return MaxTextModel(str(model), config, defer=request.maxtext_deferral == "auto")

    overrides = request.overrides or {}
    weights = overrides.get("weight_dtype") or request.param_dtype or "float32"
    computes_in = request.compute_dtype or overrides.get("dtype", "bfloat16")  # base.yml's dtype
    return PlannedModel(source_at, axes, None, None, len(target.devices), frozenset({weights}), computes_in,
                        compiles=compiled_figures)


def compiled_figures(lever_name: str, step: str, source: MaxTextModel, mesh: None, shape: StepShape,
                     depth: int | None = None, progress: Callable[[str], None] | None = None,
                     timing: RowCompiler | None = None) -> Figures:
  """:func:`nnx_zero1_plan.row_compiler.compiled_figures` of a ``maxtext:`` model: its engine's split step,
  compiled whole on the engine's own mesh (:func:`compile_maxtext`), by every kind's path
  (:func:`~nnx_zero1_plan.row_compiler.compile_and_read`)."""
  lever = with_offload(lever_name, shape.offload_fraction)
  compile = lambda options: compile_maxtext(lever_name, lever, source.overrides, source.defer)  # noqa: E731
  at = compile_words(lever_name, step, shape)
  return compile_and_read(compile, at, lever_name, shape, progress, timing)


def compile_maxtext(lever_name: str, lever: Lever, overrides: Mapping[str, str], defer: bool = True
                    ) -> Compiled:
  """One lever's MaxText engine compiled for the config ``overrides`` make, reducing in every micro-batch
  where ``defer`` is False (else where MaxText's engine can, it defers the data-parallel all-reduce to
  ``update``): the kernels one step runs, in order (each kernel's text read once), on the engine's mesh, and
  the figures only the engine knows (its state's bytes, the compile's seconds, its config, whether it
  deferred). MaxText's config, Zero-1 or the compiler refusing raise (the plan records it on the row)."""
  # First: the adapter supplies the Tunix types MaxText's engine modules import where Tunix is absent.
  from nnx_zero1.adapters.maxtext import Zero1AbstractMaxTextEngine  # isort: skip
  import maxtext
  from flax import nnx
  from maxtext.configs import pyconfig
  from maxtext.trainers.pre_train import train_compile
  from maxtext.training_engine import maxtext_engine_compile as mec

  from nnx_zero1.adapters._compat import maxtext_reduction_not_deferred, unreduced_grad_shardings

  attributes = engine_attributes(lever_name, lever)
  base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
  config = pyconfig.initialize(["nnx_zero1.plan", base] + [f"{k}={v}" for k, v in overrides.items()])
  mesh = train_compile.get_topology_mesh(config)
  engine_class = (mec.AbstractMaxTextEngine if attributes is None
                  else type(f"Zero1Engine_{lever_name}", (Zero1AbstractMaxTextEngine,), attributes))
  start = time.perf_counter()
  with contextlib.nullcontext() if defer else maxtext_reduction_not_deferred():
    engine = engine_class(config, mesh)
    kernels = engine.compile_kernels(mec.get_shaped_micro_batch(config))
  deferred = unreduced_grad_shardings(engine) is not None
  seconds = time.perf_counter() - start
  state = nnx.state(engine.optimizer.opt_state)
  by_kind = bytes_by_memory_kind(state)
  model = engine._model  # where maxtext 0.2.5's engine keeps it (the version the planner supports)
  ga = int(config.gradient_accumulation_steps)
  runs = ["fwd_bwd"] + ["fwd_bwd_accum"] * (ga - 1)  # the gradient kernels one step runs, in order
  chosen = {f.name: str(getattr(config, f.name)) for f in dataclasses.fields(MaxTextConfig)
            if f.name != "deferred_all_reduce"}  # what MaxText's defaults chose, recorded on a row
  known = Figures(opt_state_bytes_per_device=by_kind.get("device", 0),
                  opt_state_bytes_by_memory_kind=by_kind, opt_state_bytes_by_dtype=bytes_by_dtype(state),
                  param_bytes_per_device=abstract_bytes_per_device(nnx.state(model, nnx.Param)),
                  compile_s=seconds,
                  maxtext_config=MaxTextConfig.from_json({**chosen, "deferred_all_reduce": str(deferred)}))
  times = {**{name: runs.count(name) for name in runs}, "update": 1}
  programs = [(name, kernels[name], ProgramRecord.read(kernels[name].as_text()), n)
              for name, n in times.items()]
  return Compiled(programs, mesh, known, micro_batch=runs[-1])  # a gradient kernel is one micro-batch
