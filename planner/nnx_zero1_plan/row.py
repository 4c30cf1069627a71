"""One lever's row of a plan: typed frozen records whose fields are plan.json's names, written side by side by
:meth:`Row.to_json` and put back by :meth:`Row.from_json`, so a new figure is one field here. What each field
holds: docs/planner.md's "What a row says"."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any


class Record:
  """A frozen record of plan.json's, written field by field; each field that is a record (or a tuple or
  mapping of them) is read into its type as the record is made: a record may be given plan.json's objects
  (and a tuple field JSON's list). Each record plan.json holds is one: a row and the meta flatten theirs."""

  def __post_init__(self) -> None:
    for name, kind in _field_types(type(self)).items():
      object.__setattr__(self, name, _read(kind, getattr(self, name)))

  def to_json(self) -> dict[str, Any]:
    """plan.json's object: every field by its name (one marked ``only_when_set`` only where it is set)."""
    return {f.name: as_json(value) for f in dataclasses.fields(self)  # type: ignore[arg-type]
            if (value := getattr(self, f.name)) is not None or not f.metadata.get("only_when_set")}

  @classmethod
  def from_json(cls, fields: Mapping[str, Any]) -> Any:
    """The record :meth:`to_json` wrote."""
    return cls(**fields)


# Each record's fields' types, read once (the annotations are strings until read).
_field_types: Callable[[type], dict[str, Any]] = functools.cache(typing.get_type_hints)


def _read(kind: Any, value: Any) -> Any:
  """``value`` as plan.json holds it, read into the type ``kind`` (``X | Y`` as ``X``)."""
  origin, args = typing.get_origin(kind), typing.get_args(kind)
  if value is None or kind is Any:
    return value
  if origin in (typing.Union, types.UnionType):
    return _read(args[0], value)
  if isinstance(kind, type) and issubclass(kind, Record):
    return kind.from_json(value) if isinstance(value, Mapping) else value
  if origin is tuple and isinstance(value, (tuple, list)):
    return tuple(_read(args[0], v) for v in value)
  if origin is Mapping and isinstance(value, Mapping):
    return {k: _read(args[1], v) for k, v in value.items()}
  return value


def as_json(value: Any) -> Any:
  """A value as plan.json writes it: a record by its ``to_json``, a sequence as a list, a mapping's values
  each; any other value as it is (one JSON has no type for is left for ``json.dump`` to refuse)."""
  if isinstance(value, Record):
    return value.to_json()
  if isinstance(value, (tuple, list)):
    return [as_json(v) for v in value]
  if isinstance(value, Mapping):
    return {k: as_json(v) for k, v in value.items()}
  return value


def _figure(*, per_layer: bool = False) -> Any:
  """A :class:`Figures` field (None by default), and whether an estimate extrapolates it per layer."""
  return dataclasses.field(default=None, metadata={"per_layer": per_layer})


def _when_set() -> Any:
  """A field (None by default) that plan.json carries only where it says something (not None)."""
  return dataclasses.field(default=None, metadata={"only_when_set": True})


def _names(record: type, flag: str | None = None) -> tuple[str, ...]:
  return tuple(f.name for f in dataclasses.fields(record) if flag is None or f.metadata.get(flag))


# What a step's time rests on (StepTime.source), for each kind of target.
TPU_SOURCE = "the TPU compiler's estimated_cycles (classic cost model), walked in schedule order"
GPU_SOURCE = ("XLA's GPU cost model: its latency-hiding scheduler's estimate of each instruction (dumped "
              "with xla_dump_latency_hiding_schedule; a bfloat16 matmul with a float32 result priced as the "
              "same matmul with a bfloat16 result, nnx_zero1_plan.gpu_matmuls), walked in schedule order")

@dataclasses.dataclass(frozen=True)
class StepTime(Record):
  """A step's predicted time on one device in parts, in seconds (:func:`nnx_zero1_plan.predict_step_time`)."""

  source: str
  programs: Sequence[str]
  compute_s: float
  fast_network: str
  fast_s: float
  fast_exposed_s: float
  slow_network: str | None
  slow_s: float
  host_s: float | None
  host_exposed_s: float
  unestimated_ops: int
  clock_ghz: float | None
  roofline_s: float | None
  fast_exposed_by_kind: Mapping[str, float] | None = _when_set()  # fast_exposed_s, kind by kind


@dataclasses.dataclass(frozen=True)
class OpCount(Record):
  """One collective op kind's (or host transfer's) count and bytes on one device."""

  count: int
  bytes: int


def op_counts(by_op: Mapping[str, Any] | None) -> dict[str, OpCount] | None:
  """plan.json's ``{op: {"count", "bytes"}}`` as :class:`OpCount` s, in its order."""
  return _read(Mapping[str, OpCount], by_op)


@dataclasses.dataclass(frozen=True)
class Collectives(Record):
  """A step's collectives on one device, each ``{op kind: OpCount}``
  (:func:`nnx_zero1_plan.compiled.collectives_of`).

  Example::

    >>> c = Collectives.from_json({"per_step": {"all-reduce": {"count": 2, "bytes": 6}}})
    >>> c.per_step["all-reduce"].count, c.sent_bytes, c.across_bytes, c.to_json()["per_step"]
    (2, 6, 0, {'all-reduce': {'count': 2, 'bytes': 6}})
  """

  per_step: Mapping[str, OpCount] = dataclasses.field(default_factory=dict)
  per_micro_batch: Mapping[str, OpCount] | None = _when_set()
  sent_per_step: Mapping[str, OpCount] | None = _when_set()
  across_per_step: Mapping[str, OpCount] | None = _when_set()

  @property
  def sent_bytes(self) -> int:
    """The bytes one device sends per step (the results' bytes where the row has no send count)."""
    return sum(c.bytes for c in (self.sent_per_step or self.per_step).values())

  @property
  def across_bytes(self) -> int:
    """The bytes one device sends per step between slices or nodes (0 on one slice or node)."""
    return sum(c.bytes for c in (self.across_per_step or {}).values())

  @classmethod
  def from_json(cls, fields: Mapping[str, Any]) -> Collectives:
    """The record :meth:`to_json` wrote (``per_step`` empty where it has none; other names not read)."""
    return cls(**{name: fields[name] for name in _names(cls) if name in fields})


@dataclasses.dataclass(frozen=True)
class StateSplit(Record):
  """The axes a lever splits the optimizer state over, and the share of its bytes split over each set of
  axes (``"none"``: not split)."""

  axes: Sequence[str]
  share: Mapping[str, float]


@dataclasses.dataclass(frozen=True)
class HbmOom(Record):
  """The TPU compiler's "does not fit" refusal as numbers (None where its message gave none)."""

  required_bytes: int | None
  available_bytes: int | None
  required_for: str


@dataclasses.dataclass(frozen=True)
class MaxTextConfig(Record):
  """What MaxText's defaults chose for a row (its config's values of these names).

  Example::

    >>> config = MaxTextConfig("qwen3-0.6b", "ShardMode.EXPLICIT", "None", False, "bfloat16", "float32",
    ...                        "OptimizerType.ADAMW", 28, 8, 64, True)
    >>> config.to_json()["num_decoder_layers"], MaxTextConfig.from_json(config.to_json()) == config
    ('28', True)
  """

  model_name: str
  shard_mode: str
  remat_policy: str
  scan_layers: bool
  dtype: str
  weight_dtype: str
  opt_type: str
  num_decoder_layers: int
  gradient_accumulation_steps: int
  global_batch_size_to_train_on: int
  deferred_all_reduce: bool

  def to_json(self) -> dict[str, str]:
    """plan.json's ``maxtext_config``: each value as the config's ``str()``."""
    return {name: str(value) for name, value in vars(self).items()}

  @classmethod
  def from_json(cls, fields: Mapping[str, str]) -> MaxTextConfig:
    """The record :meth:`to_json` wrote (or the config's values): each field's type read from its string."""
    typed: dict[type, Callable[[str], Any]] = {int: int, bool: lambda v: v in (True, "True"), str: str}
    return cls(**{k: typed[_field_types(cls)[k]](v) for k, v in fields.items()})


@dataclasses.dataclass(frozen=True)
class Figures(Record):
  """What the compiler said of one lever's step, per device (None where it refused the program)."""

  opt_state_bytes_per_device: int | None = _figure(per_layer=True)
  opt_state_bytes_by_memory_kind: Mapping[str, int] | None = _figure(per_layer=True)
  opt_state_bytes_by_dtype: Mapping[str, int] | None = _figure(per_layer=True)
  param_bytes_per_device: int | None = _figure(per_layer=True)
  state_split: StateSplit | None = _figure()
  argument_bytes_per_device: int | None = _figure(per_layer=True)
  output_bytes_per_device: int | None = _figure(per_layer=True)
  alias_bytes_per_device: int | None = _figure(per_layer=True)
  temp_bytes_per_device: int | None = _figure(per_layer=True)
  peak_bytes_per_device: int | None = _figure(per_layer=True)
  formula_peak_bytes_per_device: int | None = _figure(per_layer=True)
  host_argument_bytes_per_device: int | None = _figure(per_layer=True)
  flops_per_device: int | None = _figure(per_layer=True)
  flops_source: str | None = _figure()
  collectives: Collectives | None = _figure(per_layer=True)
  update_peak_bytes_per_device: int | None = _figure(per_layer=True)
  update_temp_bytes_per_device: int | None = _figure(per_layer=True)
  update_flops_per_device: int | None = _figure(per_layer=True)
  update_bytes_accessed_per_device: int | None = _figure(per_layer=True)
  headroom_bytes_per_device: int | None = _figure()
  error: str | None = _figure()
  hbm_oom: HbmOom | None = _figure()
  compile_s: float | None = _figure()
  maxtext_config: MaxTextConfig | None = _figure()
  predicted_step_s: float | None = _figure(per_layer=True)
  tokens_per_s_per_device: float | None = _figure()
  mfu: float | None = _figure()
  step_time: StepTime | None = _figure()
  time_absent: str | None = _figure()
  calibrated_step_s: float | None = _when_set()
  # The calibrated step's exposed collectives, where --measure timed each kind of them on this slice.
  calibrated_collective_s: float | None = _when_set()

  @property
  def host_state_bytes(self) -> int:
    """The optimizer state's bytes in host memory (an offloaded state; 0 where none is)."""
    return (self.opt_state_bytes_by_memory_kind or {}).get("pinned_host", 0)


# The figures an estimate extrapolates per layer.
PER_LAYER = _names(Figures, "per_layer")


@dataclasses.dataclass(frozen=True)
class Network(Record):
  """One network (``ICI``, ``DCN``, ``NVLink``, ``InfiniBand``), the bytes one device sends over it per
  step, and their time in ms at its public rate (an estimate; None: no public rate here for the chip)."""

  network: str
  bytes: int
  estimate_ms: float | None


@dataclasses.dataclass(frozen=True)
class PodNetworks(Record):
  """A pod's two networks per step (:func:`nnx_zero1_plan.networks.network_per_step`): the fast one inside a
  slice or node, the slow one between them, and where their rates come from."""

  fast: Network
  slow: Network
  source: str | None

  @property
  def bytes(self) -> int:
    """The bytes one device sends per step on both networks together."""
    return self.fast.bytes + self.slow.bytes


@dataclasses.dataclass(frozen=True)
class Estimate(Record):
  """What marks an extrapolated row as an estimate (:func:`nnx_zero1_plan.estimate.estimate_mark`): how it was
  made, the figures it touches, and how far low such estimates were measured (the whole program's peak over
  the estimate's), where."""

  method: str
  figures: Sequence[str]
  whole_peak_over_estimate_up_to: float
  measured: Sequence[str]


@dataclasses.dataclass(frozen=True)
class Made(Record):
  """How a row's figures were made: the depth always, each other note where it says something (not None)."""

  depth: int | None = None
  depth_extrapolated_from: Sequence[int] | None = None
  not_alike: str | None = _when_set()
  estimate: Estimate | None = _when_set()
  fits_estimate: bool | None = _when_set()
  extrapolated_peak_bytes_per_device: int | None = _when_set()
  compiled_whole_because: str | None = _when_set()
  network_per_step: PodNetworks | None = _when_set()


@dataclasses.dataclass(frozen=True)
class Point(Record):
  """One compile of a search: its micro-batch, whether it fits, and the :class:`Figures` a search keeps
  (:data:`AT_EDGE`, each named as its :class:`Figures` field).

  Example::

    >>> Point.of(48, True, Figures(peak_bytes_per_device=9, compile_s=2.0)).peak_bytes_per_device
    9
  """

  batch: int
  fits: bool
  argument_bytes_per_device: int | None = None
  temp_bytes_per_device: int | None = None
  peak_bytes_per_device: int | None = None
  formula_peak_bytes_per_device: int | None = None
  flops_per_device: int | None = None
  headroom_bytes_per_device: int | None = None
  error: str | None = None
  compile_s: float | None = None
  predicted_step_s: float | None = _when_set()
  tokens_per_s_per_device: float | None = _when_set()
  mfu: float | None = _when_set()
  calibrated_step_s: float | None = _when_set()
  calibrated_collective_s: float | None = _when_set()
  step_time: StepTime | None = _when_set()

  @classmethod
  def of(cls, batch: int, fits: bool, figures: Figures) -> Point:
    """The point of a compile at ``batch`` whose figures are ``figures``."""
    return cls(batch, fits, **{k: getattr(figures, k) for k in AT_EDGE})


# The figures a search keeps for each micro-batch it compiled.
AT_EDGE = _names(Point)[2:]


@dataclasses.dataclass(frozen=True)
class Searched(Record):
  """What the search for the largest micro-batch that fits found (:func:`nnx_zero1_plan.search.find_edge`):
  the edge, the first compile above it and why it was refused, and each compile as a :class:`Point`."""

  max_micro_batch: int | None
  above: int | None
  refused_because: str | None
  search_unfinished: str | None
  fits_above: tuple[int, ...]
  at_max: Point | None
  at_above: Point | None
  search: tuple[Point, ...]
  search_compile_s: float


@dataclasses.dataclass(frozen=True)
class OffloadPoint(Record):
  """One compile of the offload search: the share offloaded, its peak, seconds and whether it fits."""

  fraction: float
  peak_bytes_per_device: int | None
  compile_s: float
  fits: bool


@dataclasses.dataclass(frozen=True)
class Offloaded(Record):
  """What the search for the share of the optimizer state to offload found
  (:func:`nnx_zero1_plan.search.offload_search`)."""

  offload_fraction: float
  offload_search: tuple[OffloadPoint, ...]
  offload_refused_because: str | None


@dataclasses.dataclass(frozen=True)
class Measured(Record):
  """One step run on the local devices (``--measure``): a few steady steps of the compiled program."""

  batch: int
  step_s: float | None
  held_bytes: int | None = None
  error: str | None = None

  @classmethod
  def from_json(cls, fields: Mapping[str, Any]) -> Measured:
    """The run :meth:`to_json` wrote (an older plan's ``peak_bytes`` as ``held_bytes``: what it held)."""
    return cls(**{("held_bytes" if k == "peak_bytes" else k): v for k, v in fields.items()})


@dataclasses.dataclass(frozen=True)
class Split(Record):
  """One split of ``--global-batch`` compiled: micro-batch x GA, whether it fits, its peak, its step's seconds
  and which kind of time they are (``measured`` on this machine's chips, ``calibrated``, ``predicted``;
  ``None`` where it has none), and its calibrated seconds beside a measured time (``None`` without one)."""

  batch: int
  ga: int
  fits: bool | None
  peak_bytes_per_device: int | None
  step_s: float | None
  time: str | None
  calibrated_s: float | None = None


@dataclasses.dataclass(frozen=True)
class Row(Record):
  """One lever's step compiled for the target, as plan.json's row: what identifies the compile, then its
  records (:class:`Figures`, :class:`Made`; :class:`Searched`, :class:`Offloaded` and the :class:`Measured`
  runs where there were any)."""

  lever: str
  step: str
  compiled_for: str
  device_kind: str
  mesh: Mapping[str, int]
  model: str
  batch: int
  figures: Figures
  made: Made
  hbm_bytes: int
  usable_bytes: int
  fits: bool | None
  activation_sharding: Any = None
  remat: str | None = None
  searched: Searched | None = None
  offloaded: Offloaded | None = None
  measured: tuple[Measured, ...] | None = None
  ga: int | None = _when_set()  # the row's own GA, where --global-batch chose it (else the plan's --ga)
  splits: tuple[Split, ...] | None = _when_set()  # every split --global-batch compiled, in order

  def to_json(self) -> dict[str, Any]:
    """plan.json's row: every record's fields side by side (:class:`Made`'s notes where they are set, a
    search's where there was one).

    Example::

      >>> row = Row.from_json({"lever": "zero1", "step": "one", "compiled_for": "h100:8", "device_kind": "H",
      ...                      "mesh": {"data": 8}, "model": "m:f", "batch": 8, "peak_bytes_per_device": 5,
      ...                      "depth": 2, "activation_sharding": None, "hbm_bytes": 9, "usable_bytes": 8,
      ...                      "fits": True, "remat": None})
      >>> row.figures.peak_bytes_per_device, row.made.depth, row.verdict, Row.from_json(row.to_json()) == row
      (5, 2, True, True)
    """
    nested = super().to_json()
    row = {k: v for k, v in nested.items() if k not in _RECORDS}
    for name in _RECORDS[:-1]:
      row.update(nested[name] or {})
    return row if self.measured is None else {**row, "measured": nested["measured"]}

  @classmethod
  def from_json(cls, fields: Mapping[str, Any]) -> Row:
    """The row :meth:`to_json` wrote (or a row's fields as the plan compiles them), each in its record.

    Raises:
      KeyError: a field no record has (a plan.json written by another version of the planner).
      TypeError: a field the row or a search's record needs is missing.
    """
    unknown = set(fields) - _KNOWN
    if unknown:
      raise KeyError(f"plan.json's row has fields no record here has: {sorted(unknown)}")
    pick = lambda record: {k: fields[k] for k in _names(record) if k in fields}
    records: dict[str, Any] = {"figures": pick(Figures), "made": pick(Made),
                               "searched": pick(Searched) if "max_micro_batch" in fields else None,
                               "offloaded": pick(Offloaded) if "offload_fraction" in fields else None}
    return cls(**pick(cls), **records)

  @property
  def estimated(self) -> bool:
    """Whether the figures are an estimate (extrapolated per layer: ``--estimate``)."""
    return self.made.estimate is not None

  @property
  def verdict(self) -> bool | None:
    """Whether the row fits, the one reading of it: ``fits`` for a compiled row; for an estimate (whose
    ``fits`` is None: it decides nothing) what its line says; None where a refusal left no figures."""
    return self.made.fits_estimate if self.estimated else self.fits


_RECORDS = ("figures", "made", "searched", "offloaded", "measured")
_KNOWN = frozenset(name for record in (Row, Figures, Made, Searched, Offloaded) for name in _names(record)
                   if name not in _RECORDS[:-1])
