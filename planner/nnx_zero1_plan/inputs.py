"""The planner's inputs, parsed and checked: pure functions of strings, no compiler needed, each refusing what
it cannot read with a :class:`PlanError` that names it and what is accepted."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

ONE_SLICE = 1  # a TPU target is one slice unless --slices joins several (a pod)


class PlanError(ValueError):
  """An input the planner cannot plan for; the message names it and what is accepted."""


class ModelKind(NamedTuple):
  """What a plan reads of a kind of model where kinds differ, each fact named for what it decides."""

  name: str  # the key of the kind's builder (models.py), for the kinds the planner builds
  engine: bool  # an engine (MaxText's) compiles and runs its own step, on its own mesh of one slice's axes
  trainer: bool  # its users train it with Tunix's trainers: the printed code is theirs
  steps: tuple[str, ...]  # the step shapes it compiles, the one recommended first
  takes: frozenset[str]  # which of the settings only some kinds take (KIND_SETTINGS) it takes
  remat_hint: str | None  # the remat policy "Try next" suggests (None: it takes no --remat)


_DTYPES = frozenset({"param_dtype", "compute_dtype", "remat"})
# ``--model``'s part before the colon: each kind; any other is a package.module of the user's own function.
MODEL_KINDS = {
    "tunix": ModelKind("tunix", engine=False, trainer=True, steps=("one", "split"),
                       takes=_DTYPES | {"tunix_sharding", "lora"}, remat_hint="decoder"),
    "maxtext": ModelKind("maxtext", engine=True, trainer=False, steps=("split",),
                         takes=_DTYPES | {"maxtext_deferral", "overrides"}, remat_hint="full"),
}
FUNCTION = ModelKind("function", engine=False, trainer=False, steps=("one", "split"), takes=frozenset(),
                     remat_hint=None)

_OWN_DTYPES = ("--param-dtype, --compute-dtype and --remat apply to tunix: models; {model} builds its own "
               "(set them in your function)")
# Each setting only some kinds take: its value when not given, and its refusal where a kind does not.
KIND_SETTINGS = {
    "tunix_sharding": ("default", "--tunix-sharding applies to tunix: models; {model} shards its own "
                                  "activations"),
    "lora": (None, "--lora applies LoRA to tunix: models; {model} applies its own: call "
                   "qwix.apply_lora_to_model in your function, and the plan trains its nnx.LoRAParam s only, "
                   "as Tunix's PeftTrainer does"),
    "maxtext_deferral": ("auto", "--maxtext-deferral applies to maxtext: models; {model} is not MaxText's "
                                 "engine"),
    "overrides": (None, "config overrides (key=value) apply to maxtext: models; {model} takes its settings "
                        "from the flags"),
    "param_dtype": (None, _OWN_DTYPES), "compute_dtype": (None, _OWN_DTYPES), "remat": (None, _OWN_DTYPES),
}


class ModelRef(NamedTuple):
  """``--model`` parsed: its ``source`` (``"tunix"``, ``"maxtext"``, or the user's module) and its ``name``
  there (Tunix's ``ModelConfig`` classmethod, MaxText's model name, or the user's function)."""

  source: str
  name: str

  def __str__(self) -> str:
    """As ``--model`` spells it: ``tunix:qwen3_8b``."""
    return f"{self.source}:{self.name}"

  @property
  def kind(self) -> ModelKind:
    """What the plan reads of the model's kind (:data:`MODEL_KINDS`)."""
    return MODEL_KINDS.get(self.source, FUNCTION)

  def check_settings(self, **settings: Any) -> None:
    """Refuses the first of ``settings`` (:data:`KIND_SETTINGS`) given that the model's kind does not take."""
    for name, value in settings.items():
      unset, refusal = KIND_SETTINGS[name]
      if value not in (None, unset, {}) and name not in self.kind.takes:
        raise PlanError(refusal.format(model=self))


class Backend(NamedTuple):
  """What a plan reads of a platform where TPUs and GPUs differ, each fact named for what it decides."""

  domain: str  # what the slow network joins: "slices" (TPU: --slices of one) or "nodes" (GPU: in the shape)
  device_files: tuple[str, ...]  # its chips' device files, where a machine has them
  reserve_bytes: int  # kept back from the compiler's memory figure unless --margin says otherwise
  compiles_on_chips: bool  # on a machine with its chips, the plan compiles for them rather than deviceless
  prices_in_cycles: bool  # time from the compiler's cost model, which a run calibrates (else its schedule)
  estimates_shallow: bool  # --estimate compiles a deep model at reduced depths
  host_memory: bool  # its compiler places arrays in host memory: offloading is a way out
  pool_fraction: bool  # its run's memory pool is --gpu-memory-fraction of the device's
  ring_links: bool  # its collectives run as rings on the chip's own links (else through a switch)
  crosses_in_program: bool  # a program spans the domains, its collectives crossing (else megascale transfers)
  domain_index: str  # the device attribute that says which domain a device sits in
  compiler: str  # the package that compiles for it
  maxtext_engine: bool  # MaxText's ahead-of-time engine compiles for it


# TPU: libtpu refuses a program whose whole footprint exceeds the HBM it names, so nothing is reserved.
# GPU: an H200's allocator peaked 50 MiB above the compiler's figure (docs/accuracy.md); 256 MiB leaves room
# for NCCL's and cuBLAS's buffers on several. XLA's GPU compiler compiles a whole program in minutes and
# schedules a deep program's collectives unlike a shallow one's (Zero-1's temp on qwen3_8b: 2.70 GiB by the
# line, 7.95 whole), so a GPU estimate compiles whole.
BACKENDS = {
    "tpu": Backend(domain="slices", device_files=("/dev/accel*", "/dev/vfio/[0-9]*"), reserve_bytes=0,
                   compiles_on_chips=True, prices_in_cycles=True, estimates_shallow=True,
                   host_memory=True, pool_fraction=False, ring_links=True, crosses_in_program=False,
                   domain_index="slice_index", compiler="libtpu", maxtext_engine=True),
    "cuda": Backend(domain="nodes", device_files=("/dev/nvidia[0-9]*",), reserve_bytes=256 * 2**20,
                    compiles_on_chips=False, prices_in_cycles=False, estimates_shallow=False,
                    host_memory=False, pool_fraction=True, ring_links=False, crosses_in_program=True,
                    domain_index="process_index", compiler="jax-cuda13-plugin", maxtext_engine=False),
}


class Topology(NamedTuple):
  """``--topology`` parsed: ``platform`` (``"tpu"`` or ``"cuda"``), ``chip`` as the planner names it
  (``"v5e"``, ``"h100"``), and ``shape``, a TPU slice's as libtpu names it or GPUs' (nodes, GPUs per node)."""

  platform: str
  chip: str
  shape: tuple[int, ...]

  def domains(self, slices: int = ONE_SLICE) -> int:
    """The slices (TPU: ``slices`` of this one) or nodes (GPU: the shape's first number) the target spans."""
    return slices if self.backend.domain == "slices" else self.shape[0]

  @property
  def backend(self) -> Backend:
    """What a plan reads of the platform (:data:`BACKENDS`)."""
    return BACKENDS[self.platform]


def parse_mesh(text: str | None) -> dict[str, int]:
  """``--mesh data=4,fsdp=2`` as ``{"data": 4, "fsdp": 2}`` (empty for None or "")."""
  sizes: dict[str, int] = {}
  for entry in filter(None, (text or "").replace(" ", "").split(",")):
    m = re.fullmatch(r"([A-Za-z_]\w*)=(\d+)", entry)
    if m is None or int(m[2]) < 1:
      raise PlanError(f"--mesh entry {entry!r} is not AXIS=SIZE with a size >= 1 (e.g. data=4,fsdp=2)")
    if m[1] in sizes:
      raise PlanError(f"--mesh names axis {m[1]!r} twice")
    sizes[m[1]] = int(m[2])
  return sizes


def spelled_mesh(axes: Mapping[str, int]) -> str:
  """A mesh as ``--mesh`` spells it: ``replica=2,data=4``."""
  return ",".join(f"{k}={v}" for k, v in axes.items())


def parse_levers(text: str | Sequence[str], known: Iterable[str], what: str = "lever") -> tuple[str, ...]:
  """``--levers baseline,zero1`` (or ``--steps one,split``: ``what="step"``) as a tuple, each checked
  against ``known``."""
  names = tuple(filter(None, text.replace(" ", "").split(","))) if isinstance(text, str) else tuple(text)
  known = tuple(known)
  unknown = [n for n in names if n not in known]
  if unknown or not names:
    raise PlanError(f"unknown {what} {', '.join(unknown) or '(none given)'}; {what}s: {', '.join(known)}")
  return names


def parse_topology(text: str, gpu_chips: Iterable[str]) -> Topology:
  """A topology as a :class:`Topology`: ``v6e:2x2`` is a TPU slice (libtpu checks it), ``h100:8`` /
  ``h100:2x8`` GPUs."""
  chips = tuple(gpu_chips)
  m = re.fullmatch(r"([\w\-]+):(\d+(?:x\d+)*)", text.strip())
  hint = (f"TPU slices as libtpu names them (v5e:2x4, v6e:2x2, v4:2x2x1, v5p:2x2x1) or GPUs "
          f"{', '.join(chips)} as CHIP:GPUS or CHIP:NODESxGPUS (h100:8, h100:2x8)")
  if m is None:
    raise PlanError(f"unknown topology {text!r}; {hint}")
  chip, shape = m[1].lower(), tuple(int(n) for n in m[2].split("x"))
  if re.fullmatch(r"v\d+[a-z]?", chip):
    return Topology("tpu", chip, shape)
  if chip not in chips or len(shape) > 2 or min(shape) < 1:
    raise PlanError(f"unknown topology {text!r}; {hint}")
  return Topology("cuda", chip, shape if len(shape) == 2 else (1, shape[0]))


def parse_model(text: str) -> ModelRef:
  """``--model`` as a :class:`ModelRef`: ``tunix:qwen3_8b``, ``maxtext:qwen3-0.6b`` or
  ``package.module:function``."""
  source, sep, name = text.strip().partition(":")
  if not sep or not source or not name:
    raise PlanError(f"unknown model {text!r}; give tunix:CONFIG (e.g. tunix:qwen3_8b), maxtext:MODEL_NAME "
                    "(e.g. maxtext:qwen3-0.6b) or package.module:function")
  return ModelRef(source, name)


def parse_overrides(entries: Sequence[str]) -> dict[str, str]:
  """MaxText config overrides, ``key=value`` as on MaxText's own command line, as a dict."""
  overrides = {}
  for entry in entries:
    key, sep, value = entry.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z_][\w.]*", key):
      raise PlanError(f"{entry!r} is not a MaxText config override KEY=VALUE (e.g. remat_policy=minimal)")
    overrides[key] = value
  return overrides


# --lora: the projections qwix's LoraProvider adapts, as Tunix's own LoRA examples name them (attention and
# MLP; Llama's and Qwen's, and Gemma 3's einsums), and the alpha they pass (it scales the adapters' output and
# changes no bytes).
_PROJECTIONS = ".*q_proj|.*k_proj|.*v_proj|.*o_proj|.*gate_proj|.*up_proj|.*down_proj"
_GEMMA3_EINSUMS = ".*q_einsum|.*kv_einsum|.*qkv_einsum|.*attn_vec_einsum|.*gate_proj|.*up_proj|.*down_proj"
LORA_ALPHA = 2.0


# Tunix's model families, each in tunix.models.FAMILY.model as its capitalised name; a configuration's name
# starts with its family's.
TUNIX_FAMILIES = ("qwen3", "qwen2", "llama3", "gemma3")


def tunix_family(config: str) -> str | None:
  """The family of Tunix's configuration named ``config`` (None: none of :data:`TUNIX_FAMILIES`)."""
  return max((f for f in TUNIX_FAMILIES if config.startswith(f)), key=len, default=None)


def lora_modules(config: str) -> str:
  """The ``module_path`` regex ``--lora`` adapts in the Tunix configuration ``config``."""
  return _GEMMA3_EINSUMS if tunix_family(config) == "gemma3" else _PROJECTIONS


def error_line(error: BaseException, limit: int = 300) -> str:
  """An exception as one line (its type, then its message's words), :func:`shortened` to ``limit``."""
  return shortened(f"{type(error).__name__}: {' '.join(str(error).split())}", limit)


def shortened(text: str, limit: int) -> str:
  """``text`` cut to at most ``limit`` characters at a word's end, with an ellipsis where it was cut."""
  if len(text) <= limit:
    return text
  return text[:limit - 4].rsplit(" ", 1)[0] + " ..."
