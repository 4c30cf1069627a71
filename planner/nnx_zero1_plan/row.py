"""One lever's row of a plan, typed frozen records named as plan.json names them (a new figure is one field
here; docs/planner.md's "What a row says"), and the one mechanism that writes and reads them all: Record."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar


class Record:
  """A frozen record of plan.json's, written and read by these two methods alone, each field as its metadata
  says (:func:`_how`); a field holding records is read into their type as the record is made."""

  spelled: ClassVar[bool] = False  # every field written as its str(), read back by its type

  def __post_init__(self) -> None:
    record: Any = type(self)  # (a class is hashable, which mypy does not see)
    for f, kind in _fields(record):
      object.__setattr__(self, f.name, _read(kind, getattr(self, f.name)))

  def to_json(self) -> dict[str, Any]:
    """plan.json's object (the keys an older plan.json lacked, in ``absent``, left out again)."""
    own: dict[str, Any] = {}
    flat: dict[str, Any] = {}
    last: dict[str, Any] = {}
    record: Any = type(self)
    absent: frozenset[str] = getattr(self, "absent", frozenset())
    for name, when_set, write, leaving, at_last in _writing(record):
      value = getattr(self, name)
      if (value is None and when_set) or name in absent:
        continue
      written: Any = write(self) if write else str(value) if self.spelled else as_json(value)
      if leaving is not None:
        flat.update((k, v) for k, v in (written or {}).items() if k not in absent and k not in leaving)
      else:
        (last if at_last else own)[name] = written
    written = {**own, **flat, **last}
    keys = list(written)
    for f, _ in _fields(record):
      if "after" in f.metadata and f.name in written:
        keys.remove(f.name)
        keys.insert(keys.index(f.metadata["after"]) + 1, f.name)
    return {k: written[k] for k in keys}

  @classmethod
  def from_json(cls, fields: Mapping[str, Any]) -> Any:
    """The record :meth:`to_json` wrote; a KeyError for a key no field has, or one missing not ``later``."""
    record: Any = cls
    renamed = _renamed(record)
    given = {renamed.get(k, k): v for k, v in fields.items()} if renamed else dict(fields)
    keeps_absent = "absent" in _names(record)
    unknown = given.keys() - _keys(record)
    missing = _keys(record, "later", absent=True) - given.keys() if keeps_absent else set()
    if unknown or missing:
      raise KeyError(f"plan.json's object has keys no field has: {sorted(unknown)}, or lacks: "
                     f"{sorted(missing)}")
    if not keeps_absent and not any("flat" in f.metadata or "read" in f.metadata for f, _ in _fields(record)):
      return cls(**given)
    made: dict[str, Any] = {}
    for f, kind in _fields(record):
      if "flat" in f.metadata:
        picked = {k: v for k, v in given.items() if k in _keys(kind)}
        made[f.name] = kind.from_json(picked) if picked or f.default is not None else None
      elif f.name in given:
        made[f.name] = f.metadata["read"](given[f.name]) if "read" in f.metadata else given[f.name]
    if keeps_absent:
      made["absent"] = frozenset(_keys(record, "later") - given.keys())
    return cls(**made)


def _how(default: Any = None, **how: Any) -> Any:
  """A field and how plan.json holds it: ``only_when_set`` (not None), ``flat`` (its record's keys among the
  record's, but those named), ``after`` a key, ``last``, ``write`` / ``read`` by a function, ``formerly`` (an
  older name), ``later`` (an older plan.json may lack it), ``per_layer`` (an estimate extrapolates it)."""
  return dataclasses.field(default=default, metadata=how)


def _when_set() -> Any:
  """A field (None by default) that plan.json carries only where it says something (not None)."""
  return _how(only_when_set=True)


# Each record's fields' types, read once (the annotations are strings until read).
_field_types: Callable[[type], dict[str, Any]] = functools.cache(typing.get_type_hints)


@functools.cache
def _fields(record: type) -> tuple[tuple[dataclasses.Field, Any], ...]:
  """A record's fields plan.json holds (those it is made from), each with its type (``X`` of ``X | None``)."""
  return tuple((f, _record_of(_field_types(record)[f.name])) for f in dataclasses.fields(record)
               if f.init and f.name != "absent")


@functools.cache
def _writing(record: type) -> tuple[tuple[str, bool, Any, Any, bool], ...]:
  """How each field is written: its name, only where set, by which function, flat (but which keys), last."""
  return tuple((f.name, bool(f.metadata.get("only_when_set")), f.metadata.get("write"),
                f.metadata.get("flat"), bool(f.metadata.get("last"))) for f, _ in _fields(record))


@functools.cache
def _renamed(record: type) -> dict[str, str]:
  """Each older name of a record's fields, and the field's."""
  return {f.metadata["formerly"]: f.name for f, _ in _fields(record) if "formerly" in f.metadata}


@functools.cache
def _keys(record: type, flag: str | None = None, absent: bool = False) -> frozenset[str]:
  """The keys a record's object may hold; with ``flag``, those of fields marked so (``absent``: not so)."""
  keys: set[str] = set()
  for f, kind in _fields(record):
    if "flat" in f.metadata:
      keys |= _keys(kind, flag, absent) - set(f.metadata["flat"])
    elif flag is None or bool(f.metadata.get(flag)) != absent:
      keys.add(f.name)
  return frozenset(keys)


def _record_of(kind: Any) -> Any:
  """``X`` of ``X | None``."""
  return typing.get_args(kind)[0] if typing.get_origin(kind) in (typing.Union, types.UnionType) else kind


def _read(kind: Any, value: Any) -> Any:
  """``value`` as plan.json holds it, read into the type ``kind`` (``X | Y`` as ``X``)."""
  if value is None or kind is Any:
    return value
  origin, args, is_record = _kind(kind)
  if origin in (typing.Union, types.UnionType):
    return _read(args[0], value)
  if is_record:
    return kind.from_json(value) if isinstance(value, Mapping) else value
  if origin in (tuple, list) and isinstance(value, (tuple, list)):
    return origin(_read(args[0], v) for v in value)
  if origin is Mapping and isinstance(value, Mapping):
    return {k: _read(args[1], v) for k, v in value.items()}
  if kind in (int, bool) and isinstance(value, str):  # a spelled record's
    return int(value) if kind is int else value == "True"
  return value


@functools.cache
def _kind(kind: Any) -> tuple[Any, tuple[Any, ...], bool]:
  """A type's origin and arguments, and whether it is a record's."""
  return typing.get_origin(kind), typing.get_args(kind), isinstance(kind, type) and issubclass(kind, Record)


def as_json(value: Any) -> Any:
  """A value as plan.json writes it (one JSON has no type for is left for ``json.dump`` to refuse)."""
  if isinstance(value, Record):
    return value.to_json()
  if isinstance(value, (tuple, list)):
    return [as_json(v) for v in value]
  if isinstance(value, Mapping):
    return {k: as_json(v) for k, v in value.items()}
  return value


@functools.cache
def _names(record: type, flag: str | None = None) -> tuple[str, ...]:
  """A record's field names (those marked ``flag``)."""
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
  """A step's collectives on one device, each ``{op kind: OpCount}`` (``compiled.collectives_of``)."""

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


@dataclasses.dataclass(frozen=True)
class StateSplit(Record):
  """The axes a lever splits the state over, and the share of its bytes over each set (or ``"none"``)."""

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
  """What MaxText's defaults chose for a row: its config's values of these names, written as their str()."""

  spelled = True

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


@dataclasses.dataclass(frozen=True)
class Figures(Record):
  """What the compiler said of one lever's step, per device (None where it refused the program)."""

  opt_state_bytes_per_device: int | None = _how(per_layer=True)
  opt_state_bytes_by_memory_kind: Mapping[str, int] | None = _how(per_layer=True)
  opt_state_bytes_by_dtype: Mapping[str, int] | None = _how(per_layer=True)
  param_bytes_per_device: int | None = _how(per_layer=True)
  state_split: StateSplit | None = _how()
  argument_bytes_per_device: int | None = _how(per_layer=True)
  output_bytes_per_device: int | None = _how(per_layer=True)
  alias_bytes_per_device: int | None = _how(per_layer=True)
  temp_bytes_per_device: int | None = _how(per_layer=True)
  peak_bytes_per_device: int | None = _how(per_layer=True)
  formula_peak_bytes_per_device: int | None = _how(per_layer=True)
  host_argument_bytes_per_device: int | None = _how(per_layer=True)
  flops_per_device: int | None = _how(per_layer=True)
  flops_source: str | None = _how()
  collectives: Collectives | None = _how(per_layer=True)
  update_peak_bytes_per_device: int | None = _how(per_layer=True)
  update_temp_bytes_per_device: int | None = _how(per_layer=True)
  update_flops_per_device: int | None = _how(per_layer=True)
  update_bytes_accessed_per_device: int | None = _how(per_layer=True)
  headroom_bytes_per_device: int | None = _how()
  error: str | None = _how()
  hbm_oom: HbmOom | None = _how()
  compile_s: float | None = _how()
  maxtext_config: MaxTextConfig | None = _how()
  predicted_step_s: float | None = _how(per_layer=True)
  tokens_per_s_per_device: float | None = _how()
  mfu: float | None = _how()
  step_time: StepTime | None = _how()
  time_absent: str | None = _how()
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
  """One network, the bytes one device sends over it per step, and their ms at its public rate (or None)."""

  network: str
  bytes: int
  estimate_ms: float | None


@dataclasses.dataclass(frozen=True)
class PodNetworks(Record):
  """A pod's two networks per step, inside a slice or node and between them, and whence their rates."""

  fast: Network
  slow: Network
  source: str | None

  @property
  def bytes(self) -> int:
    """The bytes one device sends per step on both networks together."""
    return self.fast.bytes + self.slow.bytes


@dataclasses.dataclass(frozen=True)
class Estimate(Record):
  """What marks an extrapolated row as an estimate (:func:`nnx_zero1_plan.estimate.estimate_mark`)."""

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
  """One compile of a search: its micro-batch, whether it fits, and the :class:`Figures` a search keeps."""

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
  """What the search for the largest micro-batch that fits found (:func:`nnx_zero1_plan.search.find_edge`)."""

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
  """What the search for the share of the state to offload found (``search.offload_search``)."""

  offload_fraction: float
  offload_search: tuple[OffloadPoint, ...]
  offload_refused_because: str | None


@dataclasses.dataclass(frozen=True)
class Measured(Record):
  """One step run on the local devices (``--measure``): a few steady steps of the compiled program."""

  batch: int
  step_s: float | None
  held_bytes: int | None = _how(formerly="peak_bytes")  # what it held (an older plan's name)
  error: str | None = None


@dataclasses.dataclass(frozen=True)
class Split(Record):
  """One split of ``--global-batch`` compiled: micro-batch x GA, its verdict, peak, seconds and their kind."""

  batch: int
  ga: int
  fits: bool | None
  peak_bytes_per_device: int | None
  step_s: float | None
  time: str | None
  calibrated_s: float | None = None


@dataclasses.dataclass(frozen=True)
class Row(Record):
  """One lever's step compiled for the target, as plan.json's row (its records' fields side by side)."""

  lever: str
  step: str
  compiled_for: str
  device_kind: str
  mesh: Mapping[str, int]
  model: str
  batch: int
  figures: Figures = dataclasses.field(metadata={"flat": ()})  # its fields side by side with the row's own
  made: Made = dataclasses.field(metadata={"flat": ()})
  hbm_bytes: int
  usable_bytes: int
  fits: bool | None
  activation_sharding: Any = None
  remat: str | None = None
  searched: Searched | None = _how(flat=())
  offloaded: Offloaded | None = _how(flat=())
  measured: tuple[Measured, ...] | None = _how(only_when_set=True, last=True)
  ga: int | None = _when_set()  # the row's own GA, where --global-batch chose it (else the plan's --ga)
  splits: tuple[Split, ...] | None = _when_set()  # every split --global-batch compiled, in order

  @property
  def estimated(self) -> bool:
    """Whether the figures are an estimate (extrapolated per layer: ``--estimate``)."""
    return self.made.estimate is not None

  @property
  def verdict(self) -> bool | None:
    """Whether the row fits, the one reading of it: ``fits`` for a compiled row; for an estimate (whose
    ``fits`` is None: it decides nothing) what its line says; None where a refusal left no figures."""
    return self.made.fits_estimate if self.estimated else self.fits

