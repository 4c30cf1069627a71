"""What a plan is asked for: one frozen record, checked without a compiler (a misspelt flag costs nothing),
that crosses into the planning process, and the command that asks for it again."""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from nnx_zero1_plan.gpu_chips import GPU_CHIPS, JAX_GPU_POOL_FRACTION
from nnx_zero1_plan.inputs import (
  KIND_SETTINGS,
  ONE_SLICE,
  Backend,
  ModelKind,
  ModelRef,
  PlanError,
  Topology,
  parse_levers,
  parse_mesh,
  parse_model,
  parse_topology,
  spelled_mesh,
)
from nnx_zero1_plan.levers import LEVERS
from nnx_zero1_plan.mesh_axes import SMALLEST_MICRO_BATCH, check_replica
from nnx_zero1_plan.row import Record

DEFAULT_DEPTHS = (2, 4)  # reduced depths compiled for an estimate (``estimate=True``) of a deeper model

# --steps: the shapes a step is compiled in, and what each is (plan.json's meta says it).
STEPS = {
    "one": "one program: gradients, then optimizer.update, the state donated (Tunix, nnx.jit loops)",
    "split": "two programs: gradients; then optimizer.update, the state donated (MaxText's engine)",
}
DEFAULT_OPTIMIZER = "adamw"

# --optimizer: optax's transformation of each name, at a typical fine-tuning rate (the rate changes no bytes),
# with its fixed options: the one table behind the printed code and the step (steps.OPTIMIZERS).
OPTIMIZER_MENU: dict[str, tuple[str, dict[str, float]]] = {
    "adamw": ("1e-5", {}),
    "adam": ("1e-5", {}),
    "lion": ("1e-6", {}),
    "sgd": ("1e-3", {"momentum": 0.9}),
    "adafactor": ("1e-3", {}),
}
OPTIMIZER_CODE = {name: f"optax.{name}({', '.join([rate, *(f'{k}={v}' for k, v in fixed.items())])})"
                  for name, (rate, fixed) in OPTIMIZER_MENU.items()}


def check_topology(topology: str, slices: int = ONE_SLICE, gpus_per_node: int | None = None) -> Topology:
  """``topology`` parsed and checked with ``slices`` and ``gpus_per_node``; a ``PlanError`` for an unknown
  one, ``slices`` below 1 or over GPU nodes, GPU nodes spelt unlike the chip's node unless ``gpus_per_node``
  says it again, or ``gpus_per_node`` that does not match or is for a TPU."""
  parsed = parse_topology(topology, GPU_CHIPS)
  chip, shape = parsed.chip, parsed.shape
  if slices < 1:
    raise PlanError(f"--slices {slices}: the number of TPU slices joined over the data-center network, 1 or "
                    "more (1, the default, is one slice)")
  if parsed.backend.domain == "nodes":
    nodes, per_node = shape
    if slices > 1:
      nodes_meant = slices * nodes
      raise PlanError(f"--slices {slices} joins TPU slices; GPU nodes are in the topology: for {nodes_meant} "
                      f"nodes of {per_node} GPUs, --topology {chip}:{nodes_meant}x{per_node}")
    standard = GPU_CHIPS[chip].node_gpus
    spelt_as_nodes = "x" in topology.partition(":")[2]
    if gpus_per_node is not None and gpus_per_node != per_node:
      raise PlanError(f"--gpus-per-node {gpus_per_node} does not match {topology} ({nodes} nodes of "
                      f"{per_node} GPUs)")
    # One number is one node (a machine of 4 GPUs is common); nodes x GPUs of another size than the chip's
    # node, or one node larger than it, is more often the two numbers swapped or a pod meant.
    if gpus_per_node is None and per_node != standard and (spelt_as_nodes or per_node > standard):
      total = nodes * per_node
      fewer = "fewer" if per_node < standard else "more"
      article = "an" if chip[0] in "aefhilmnorsx" else "a"  # the letters whose names start with a vowel
      guess = f"did you mean {chip}:{total // standard}x{standard}? " if total % standard == 0 else ""
      nodes_of = f"nodes of {per_node} GPUs" if spelt_as_nodes else f"one node of {per_node} GPUs"
      what = f"{nodes} {nodes_of}" if spelt_as_nodes else nodes_of
      say = f"{'For' if guess else 'for'} {nodes_of}, say --gpus-per-node {per_node}"
      raise PlanError(f"{topology} reads as {what}, {fewer} than {article} {chip.upper()} node's {standard}: "
                      f"{guess}{say}")
  elif gpus_per_node is not None:
    raise PlanError(f"--gpus-per-node is for GPU nodes; {topology} is a TPU slice (--slices N for several)")
  return parsed


def _setting(default: Any, command: str | None = "set", **how: Any) -> Any:
  """A setting: its default, and how the printed command says it (``always``; ``set``: where it is not the
  default; None: never) and plan.json holds it (:func:`~nnx_zero1_plan.row._how`)."""
  return dataclasses.field(default=default, metadata={"command": command, **how})


# How plan.json holds the mesh (its sizes), the steps (with what each is) and the GPU pool's share (None on a
# platform with no pool).
_MESH: Any = {"write": lambda r: dict(r.mesh_sizes), "read": lambda v: spelled_mesh(v) or None}
_STEPS: Any = {"write": lambda r: {s: STEPS[s] for s in r.steps}, "read": tuple}
_POOL: Any = {"write": lambda r: r.gpu_memory_fraction if r.backend.pool_fraction else None,
              "read": lambda v: v or JAX_GPU_POOL_FRACTION}


@dataclasses.dataclass(frozen=True)
class PlanRequest(Record):
  """One plan's settings, described once: what :func:`nnx_zero1_plan.plan` and the command line take, in
  plan.json's order, each with how the printed command and plan.json hold it. Each field but ``depths`` (the
  reduced depths an ``estimate`` compiles at) is the flag of its name (``seq_len``: ``--seq-len``;
  ``overrides``: its ``KEY=VALUE`` words), whose words are :data:`nnx_zero1_plan.cli.FLAGS`'.

  Building it checks every setting (a ``PlanError`` says what it refuses), normalises ``levers`` and ``steps``
  to tuples of names (a ``maxtext:`` model keeps ``split`` only) and parses ``model``, ``topology`` and
  ``mesh`` once (``model_ref``, ``topology_ref``, ``mesh_sizes``: what the planning process reads).

  Example::

    >>> request = PlanRequest("tunix:qwen3_0p6b", "h100:8", levers="zero1", batch=16)
    >>> request.levers, request.steps, request.platform
    (('zero1',), ('one', 'split'), 'cuda')
  """

  model: str = dataclasses.field(metadata={"command": "always"})
  topology: str = dataclasses.field(metadata={"command": "always"})
  mesh: str | None = _setting(None, "always", **_MESH)
  batch: int | None = _setting(None, "always")
  seq_len: int = _setting(1024, "always")
  ga: int = _setting(1, "always")
  optimizer: str = _setting(DEFAULT_OPTIMIZER)
  param_dtype: str | None = _setting(None)
  compute_dtype: str | None = _setting(None)
  remat: str | None = _setting(None)
  levers: str | Sequence[str] = _setting(("baseline", "zero1"), "always")
  steps: str | Sequence[str] = _setting(("one", "split"), "always", **_STEPS)
  gpu_memory_fraction: float = _setting(JAX_GPU_POOL_FRACTION, **_POOL)
  estimate: bool = _setting(False)
  overrides: Mapping[str, str] | None = _setting(None, "words")
  search: bool = _setting(False, None)
  margin: float | None = _setting(None)
  slices: int = _setting(ONE_SLICE)
  tunix_sharding: str = _setting("default", later=True)
  gpus_per_node: int | None = _setting(None, later=True)
  maxtext_deferral: str = _setting("auto", later=True)
  global_batch: int | None = _setting(None, None, later=True)
  lora: int | None = _setting(None, later=True)
  depths: Sequence[int] = _setting(DEFAULT_DEPTHS, None)
  calibration: str | None = _setting(None, None)
  model_ref: ModelRef = dataclasses.field(init=False, repr=False, compare=False)
  topology_ref: Topology = dataclasses.field(init=False, repr=False, compare=False)
  mesh_sizes: Mapping[str, int] = dataclasses.field(init=False, repr=False, compare=False)

  def __post_init__(self) -> None:
    model_ref = parse_model(self.model)
    kind = model_ref.kind
    topology_ref = check_topology(self.topology, self.slices, self.gpus_per_node)
    object.__setattr__(self, "topology_ref", topology_ref)  # frozen: what the checks below read
    sizes = parse_mesh(self.mesh)
    if sizes and not kind.engine:  # an engine's --mesh is one slice's axes (MaxText's ici_*), no replica
      check_replica(sizes, self.domains, where=self.backend.domain)
    steps = parse_levers(self.steps, STEPS, what="step")
    if self.optimizer not in OPTIMIZER_CODE:
      raise PlanError(f"unknown optimizer {self.optimizer!r}; optimizers: {', '.join(OPTIMIZER_CODE)}")
    if min(SMALLEST_MICRO_BATCH if self.batch is None else self.batch, self.seq_len, self.ga) < 1:
      raise PlanError(f"--batch, --seq-len and --ga must be >= 1, got {self.batch}, {self.seq_len}, "
                      f"{self.ga}")
    if self.margin is not None and not 0 <= self.margin < 1:
      raise PlanError(f"--margin is the share of the memory to leave free, in [0, 1); got {self.margin}")
    if not 0 < self.gpu_memory_fraction <= 1:
      raise PlanError(f"--gpu-memory-fraction is XLA_PYTHON_CLIENT_MEM_FRACTION, in (0, 1]; "
                      f"got {self.gpu_memory_fraction}")
    if self.estimate and self.search:
      raise PlanError("--search finds an edge from whole compiles, and --estimate decides no edge: leave out "
                      "one of them")
    if self.lora is not None and self.lora < 1:
      raise PlanError(f"--lora is the LoRA rank, >= 1; got {self.lora}")
    if self.maxtext_deferral not in ("auto", "off"):
      raise PlanError(f"--maxtext-deferral is auto or off, got {self.maxtext_deferral!r}")
    model_ref.check_settings(**{name: getattr(self, name) for name in KIND_SETTINGS})
    levers = parse_levers(self.levers, LEVERS)
    if self.global_batch is not None:
      self._check_global_batch(kind, self.global_batch, levers)
    steps = tuple(s for s in steps if s in kind.steps)
    if not steps:
      raise PlanError(f"{self.model} compiles as MaxText's engine runs it, as two programs: --steps split")
    normal = {"levers": levers, "steps": steps,
              "overrides": dict(self.overrides) if self.overrides else None,
              "depths": tuple(self.depths), "model_ref": model_ref, "mesh_sizes": sizes}
    for name, value in normal.items():
      object.__setattr__(self, name, value)  # frozen: the checked values replace the given ones

  def _check_global_batch(self, kind: ModelKind, global_batch: int, levers: Sequence[str]) -> None:
    """Refuses what may not come with ``global_batch``: a plan splits it into the micro-batch and GA."""
    if global_batch < 1:
      raise PlanError(f"--global-batch is sequences per optimizer step, >= 1; got {global_batch}")
    given = [flag for flag, on in (("--batch", self.batch is not None), ("--ga", self.ga != 1),
                                   ("--search", self.search), ("--estimate", self.estimate)) if on]
    if given and type(self) is PlanRequest:  # a resolved request holds the micro-batch and GA a plan chose
      raise PlanError(f"--global-batch chooses the micro-batch and GA itself, from whole compiles: leave out "
                      f"{', '.join(given)}")
    if kind.engine:
      raise PlanError("--global-batch plans the planner's own step; a maxtext: model sets its micro-batch "
                      "and GA in its config (per_device_batch_size, gradient_accumulation_steps)")
    searching = [n for n in levers if LEVERS[n].picks_offload]
    if searching:
      raise PlanError(f"--global-batch with --levers {searching[0]}: that lever searches its share of the "
                      "state at one micro-batch; plan it with --batch")

  @property
  def platform(self) -> str:
    """``"tpu"`` or ``"cuda"``, from the topology."""
    return self.topology_ref.platform

  @property
  def backend(self) -> Backend:
    """What a plan reads of the platform (:data:`~nnx_zero1_plan.inputs.BACKENDS`)."""
    return self.topology_ref.backend

  @property
  def domains(self) -> int:
    """The slices (TPU) or nodes (GPU) the plan spans."""
    return self.topology_ref.domains(self.slices)

  @property
  def policies(self) -> tuple[str | None, ...]:
    """The remat policies to plan under: each of ``remat``'s comma-separated names, or ``(None,)``."""
    return tuple(dict.fromkeys(filter(None, (self.remat or "").replace(" ", "").split(",")))) or (None,)

  def resolved(self, mesh: Mapping[str, int], batch: int) -> ResolvedRequest:
    """The request as a plan resolved it: every mesh axis sized, the micro-batch set and the model as
    ``--model`` spells it."""
    asked = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
    model = str(self.model_ref)
    return ResolvedRequest(**{**asked, "model": model, "mesh": spelled_mesh(mesh), "batch": batch})


@dataclasses.dataclass(frozen=True)
class ResolvedRequest(PlanRequest):
  """A request as a plan resolved it (:meth:`PlanRequest.resolved`): every mesh axis sized and the global
  micro-batch set; what the plan's commands reproduce, its settings hold and its way out changes."""

  mesh: str = _setting("", "always", **_MESH)
  batch: int = _setting(0, "always")


def remats(policy: str | None) -> bool:
  """Whether a remat policy recomputes anything (``none``, or none given, does not)."""
  return policy not in (None, "", "none")


# Each setting's default, as :class:`PlanRequest` declares it (the command line's flags take theirs here).
SETTING_DEFAULTS = {f.name: f.default for f in dataclasses.fields(PlanRequest)
                    if f.init and f.default is not dataclasses.MISSING}


def command_line(request: ResolvedRequest, **changes: Any) -> str:
  """The planner's command for ``request`` with ``changes`` made (``dataclasses.replace``: each checked as the
  request was): the inverse of parsing, each setting the command always says, then each other not at its
  default (nor one plan.json says nothing of here), then the overrides."""
  r = dataclasses.replace(request, **changes)
  spelled = {"model": r.model_ref, "mesh": spelled_mesh(r.mesh_sizes), "levers": ",".join(r.levers),
             "steps": ",".join(r.steps)}
  always, given = ["python -m nnx_zero1.plan"], []
  for f in dataclasses.fields(r):
    value, how, flag = getattr(r, f.name), f.metadata, f"--{f.name.replace('_', '-')}"
    if how.get("command") == "always":
      always.append(f"{flag} {spelled.get(f.name, value)}")
    elif how.get("command") == "set" and value not in (f.default, "") and (
        "write" not in how or how["write"](r) is not None):
      given.append(flag if value is True else f"{flag} {shlex.quote(str(value))}")
  return " ".join([*always, *given, *(shlex.quote(f"{k}={v}") for k, v in (r.overrides or {}).items())])
