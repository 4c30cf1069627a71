"""A compiled program's time on one device, from the compiler's own cost model, walked in schedule order: the
core advances by each instruction's estimate, collectives and host copies run on their own lanes beside it and
the core stalls at a ``-done`` only for what is left (docs/planner.md's "How fast"). A step without a time
says why (:data:`NO_ESTIMATE`, :data:`HOST_UNTIMED`, ...): nothing here guesses compute from a peak rate."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence

from nnx_zero1._src.companion import Instruction
from nnx_zero1_plan.chips import Chip
from nnx_zero1_plan.hlo_flops import dot_flops
from nnx_zero1_plan.inputs import BACKENDS
from nnx_zero1_plan.networks import CollectiveTime, rings_of, tpu_collective_time
from nnx_zero1_plan.program_record import ProgramRecord
from nnx_zero1_plan.row import GPU_SOURCE, TPU_SOURCE, StepTime

# The compiler's estimate for an instruction it did not estimate (INT64_MAX).
NOT_ESTIMATED = 2**63 - 1

# What costs nothing and is not scheduled on its own: XLA's GPU scheduler gives these no estimate.
_FREE = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "partition-id",
                   "replica-id", "opt-barrier", "after-all", "add-dependency"})


@dataclasses.dataclass(frozen=True)
class Rates:
  """What turns a program's cycles and bytes into seconds on one device.

  Attributes:
    clock_hz: the core's clock (cycles per second); None where the compiler gives no cycles.
    network_bytes_per_s: one device's rate for a collective over a group of ``n`` devices, per direction,
      where ``collective_s`` is None (a GPU: its switch's rate whatever the group).
    host_bytes_per_s: the host link's rate each way (copies to and from host memory, each direction on its
      own lane); None where it was not measured (the copies are then counted, not timed).
    class_clocks_hz: the clock each class of work (``program_record.CYCLE_CLASSES``) runs the compiler's
      cycles at, where a microbenchmark measured it on the chip; None: every cycle at ``clock_hz``.
    collective_s: a collective's seconds on the links its groups use (a TPU slice's:
      :func:`nnx_zero1_plan.networks.tpu_collective_time`); None: ``network_bytes_per_s``.
  """

  clock_hz: float | None
  network_bytes_per_s: Callable[[int], float]
  host_bytes_per_s: float | None = None
  class_clocks_hz: Mapping[str, float] | None = None
  collective_s: CollectiveTime | None = None


@dataclasses.dataclass(frozen=True)
class ProgramTime:
  """One program's time on one device, and its parts (seconds).

  Attributes:
    total_s: the walk's end: compute and every stall, in schedule order.
    compute_s: the core's estimated work (None where the compiler gives no cycles).
    collective_s: every collective's time on the network, overlapped or not.
    exposed_collective_s: the part of it the core waited for.
    host_s: the copies to and from host memory (None: not timed, no host rate).
    exposed_host_s: the part of them the core waited for.
    unestimated: instructions whose estimate was the compiler's "not estimated", counted as zero.
    collectives: collectives run (every loop trip counted).
    exposed_by_kind: the exposed collective seconds, by kind of collective.
  """

  total_s: float
  compute_s: float | None
  collective_s: float
  exposed_collective_s: float
  host_s: float | None
  exposed_host_s: float
  unestimated: int
  collectives: int
  exposed_by_kind: Mapping[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _Walk:
  """A walk in progress (a computation's, or a step's programs'): its :class:`ProgramTime` so far
  (``total_s``: the core's time now), when each lane is next free, and the transfers not yet waited for."""

  total_s: float = 0.0
  compute_s: float = 0.0
  collective_s: float = 0.0
  exposed_collective_s: float = 0.0
  host_s: float = 0.0
  exposed_host_s: float = 0.0
  unestimated: int = 0
  collectives: int = 0
  free: dict[str, float] = dataclasses.field(default_factory=dict)
  pending: dict[str, tuple[float, str, str]] = dataclasses.field(default_factory=dict)
  exposed_by_kind: dict[str, float] = dataclasses.field(default_factory=dict)

  def add(self, other: ProgramTime, times: int) -> None:
    """A whole walk (a callee's, a step's program), ``times`` over, run on the core (its transfers inside)."""
    for part in dataclasses.fields(ProgramTime):
      if part.name != "exposed_by_kind":
        setattr(self, part.name, getattr(self, part.name) + times * (getattr(other, part.name) or 0))
    for kind, seconds in other.exposed_by_kind.items():
      self.exposed_by_kind[kind] = self.exposed_by_kind.get(kind, 0.0) + times * seconds

  def start(self, name: str, seconds: float, on: str, kind: str = "") -> None:
    """An async transfer of ``seconds`` started now on ``on`` (the network, or one way of the host link)."""
    end = max(self.total_s, self.free.get(on, 0.0)) + seconds
    self.free[on] = end
    self.pending[name] = (end, on, kind)
    if on == "network":
      self.collective_s += seconds
      self.collectives += 1
    else:
      self.host_s += seconds

  def wait(self, name: str) -> None:
    """The core waits for a started transfer to end."""
    end, on, kind = self.pending.pop(name, (self.total_s, "network", ""))
    stall = max(0.0, end - self.total_s)
    self.total_s += stall
    if on == "network":
      self.exposed_collective_s += stall
      if stall:
        self.exposed_by_kind[kind] = self.exposed_by_kind.get(kind, 0.0) + stall
    else:
      self.exposed_host_s += stall


def network_seconds(i: Instruction, rates: Rates, devices: int) -> float:
  """A collective instruction's seconds on the network, at ``rates``, in a program of ``devices``."""
  c = i.collective
  if c is None or len(c.groups(devices)[0]) < 2:
    return 0.0
  groups, sent = c.groups(devices), c.sent(devices)
  return (sent / rates.network_bytes_per_s(len(groups[0])) if rates.collective_s is None
          else rates.collective_s(c.op, sent, groups, rings_of(i.line), devices))


def program_time(program: ProgramRecord | str, rates: Rates, devices: int | None = None,
                 estimates: Mapping[str, float] | None = None) -> ProgramTime:
  """A compiled program's time on one device: its schedule walked with the compiler's estimates.

  Args:
    program: the program's record, or ``compiled.as_text()`` (read here: :class:`ProgramRecord`).
    rates: the clock and the networks' and host link's rates.
    devices: the program's devices (its ``num_partitions`` where None).
    estimates: each instruction's estimated seconds by name, where the compiler gives them apart from the
      program (XLA's GPU scheduler: :func:`nnx_zero1_plan.gpu_schedule.scheduled_seconds`); None: the
      cycles in the program (the TPU compiler's) at ``rates.clock_hz``.

  Returns:
    The :class:`ProgramTime` of one call.

  Example::

    >>> hlo = '''HloModule m, num_partitions=4
    ... ENTRY %main (p: f32[1024]) -> f32[1024] {
    ...   %f = f32[1024]{0} fusion(%p), kind=kLoop, calls=%g, backend_config={"estimated_cycles":"1000"}
    ...   %ar = f32[1024]{0} all-reduce-start(%f), replica_groups={{0,1,2,3}}, to_apply=%add
    ...   %h = f32[1024]{0} fusion(%p), kind=kLoop, calls=%g, backend_config={"estimated_cycles":"500"}
    ...   ROOT %d = f32[1024]{0} all-reduce-done(%ar)
    ... }'''
    >>> t = program_time(hlo, Rates(clock_hz=1e9, network_bytes_per_s=lambda n: 6144 / 1e-6))
    >>> round(t.compute_s * 1e6, 3), round(t.collective_s * 1e6, 3), round(t.exposed_collective_s * 1e6, 3)
    (1.5, 1.0, 0.5)
  """
  record = ProgramRecord.of(program)
  devices = devices or record.devices

  def compute_seconds(i: Instruction) -> float | None:
    """One instruction's estimated seconds (0.0: nothing to count; None: the compiler did not estimate it)."""
    if estimates is not None:
      return 0.0 if i.op in _FREE else estimates.get(i.name)
    if i.cycles is None or rates.clock_hz is None:
      return 0.0
    return None if i.cycles >= NOT_ESTIMATED else i.cycles / (rates.class_clocks_hz or {}).get(i.work or "",
                                                                                                rates.clock_hz)

  @functools.cache
  def walk(name: str) -> ProgramTime:
    w = _Walk()
    for i in record.computations.get(name, ()):
      if i.collective:
        w.start(i.name, network_seconds(i, rates, devices), "network", i.collective.op)
        if not i.collective.start:
          w.wait(i.name)
      elif i.host:
        if rates.host_bytes_per_s is not None:
          w.start(i.name, i.host_bytes / rates.host_bytes_per_s, i.host)
      elif i.op.endswith("-done"):
        w.wait(i.args.split(",")[0].strip().lstrip("%"))
      elif i.op in ("while", "call", "conditional"):  # the callee's walk, as many times as it runs
        for call in i.calls:
          w.add(walk(call.computation), call.times)
      elif (seconds := compute_seconds(i)) is None:
        w.unestimated += 1
      else:
        w.total_s += seconds
        w.compute_s += seconds
    for pending in list(w.pending):  # a transfer nothing waited for still ends the program
      w.wait(pending)
    timed = rates.clock_hz is not None or estimates is not None
    return ProgramTime(w.total_s, w.compute_s if timed else None, w.collective_s, w.exposed_collective_s,
                       w.host_s if rates.host_bytes_per_s else None, w.exposed_host_s, w.unestimated,
                       w.collectives, dict(w.exposed_by_kind))

  return walk(record.entry) if record.entry else ProgramTime(0.0, None, 0.0, 0.0, None, 0.0, 0, 0)


def cycle_class(program: ProgramRecord | str) -> set[str]:
  """The classes of work (:data:`~nnx_zero1_plan.program_record.CYCLE_CLASSES`) of a compiled program's
  estimated instructions.

  Example::

    >>> cycle_class("\\n".join(["ENTRY %main (p: f32[8]) -> f32[8] {",
    ...   '  ROOT %f = f32[8]{0} fusion(%p), calls=%g, backend_config={"estimated_cycles":"12"}', "}"]))
    {'vector'}
  """
  return {i.work for body in ProgramRecord.of(program).computations.values() for i in body if i.work}


NO_SCHEDULE = ("XLA's GPU scheduler dumped no estimates for one of the step's programs (on jax 0.12.0.1 it "
               "writes none for a program without collectives to schedule, and only the loop bodies of a "
               "program with loops): no time rather than a part of one")
HOST_UNTIMED = ("the step copies state between host and device memory, and this chip's host link was never "
                "measured: no time rather than one without its copies (the v5e's is, benchmarks.chip_rates)")
NO_ESTIMATE = ("the compiler gives no estimate of the program's compute (XLA's GPU and CPU compilers carry "
               "no cycles in the compiled program); not guessed from a peak rate")


def rates_for(chip: Chip) -> Rates:
  """The rates a chip's programs are timed at: its clock, and its collectives' time on its fast network (a
  TPU's on the links its group's rings use, :func:`nnx_zero1_plan.networks.tpu_collective_time`; a GPU's at
  its NVLink rate whatever the group: a switch).

  Example::

    >>> from nnx_zero1_plan.chips import CHIPS
    >>> round(rates_for(CHIPS["v6e"]).collective_s("all-gather", 3 * 10**6, ((0, 1, 2, 3),), 1, 4) * 1e6, 1)
    36.3
  """
  fast, link, compute = chip.links.fast_bytes_per_s, chip.links.link_bytes_per_s, chip.compute
  if BACKENDS[chip.platform].ring_links:  # a full ring's rate stands beside its collectives' own time
    ring = 2 * (link or 0.0)  # every such chip of the table has its link's rate
    return Rates(compute.clock_hz, lambda n: ring, compute.host_bytes_per_s, compute.class_clocks_hz,
                 tpu_collective_time(chip.links, compute.ports // 2))
  return Rates(compute.clock_hz, lambda n: fast, compute.host_bytes_per_s)


@dataclasses.dataclass(frozen=True)
class PredictedTime:
  """A step's predicted time as a row carries it: each field the :class:`~nnx_zero1_plan.row.Figures` one."""

  predicted_step_s: float | None = None
  tokens_per_s_per_device: float | None = None
  mfu: float | None = None
  step_time: StepTime | None = None
  time_absent: str | None = None


def predict_step_time(programs: Sequence[tuple[str, ProgramRecord | str, int]], chip: Chip, *, devices: int,
                      tokens_per_device: float, compute_dtype: str, slow_bytes: int = 0,
                      scheduled: Mapping[str, Mapping[str, float]] | None = None) -> PredictedTime:
  """A step's predicted time on one device: its programs' walks (:func:`program_time`), each as many times
  as one step runs it, and the slow network's bytes over its rate, exposed.

  Args:
    programs: ``(name, record or text, times)`` for each program one step runs, in order (a text is read
      here: :class:`~nnx_zero1_plan.program_record.ProgramRecord`).
    chip: the target's chip (its clock, rates and peak).
    devices: the devices the programs run on (a collective over all of them names no groups).
    tokens_per_device: the tokens one device trains on per step.
    compute_dtype: the dtype the step computes in (``bfloat16``, ``float32``), for the MFU's peak.
    slow_bytes: the bytes one device sends per step between slices or nodes.
    scheduled: XLA's GPU scheduler's estimates, ``{module: {instruction: seconds}}``
      (:func:`nnx_zero1_plan.gpu_schedule.scheduled_seconds`); None for a TPU program, which carries its own.

  Returns:
    The row's time figures (:class:`PredictedTime`; ``time_absent`` says why where there is no time).
  """
  records = [(name, ProgramRecord.of(program), times) for name, program, times in programs]
  estimates = [_module_estimates(record, scheduled) for _, record, _ in records]
  # A TPU program carries the compiler's cycles in its text; a GPU program's come from its scheduler's dump.
  if not all("estimated_cycles" in r.text or own for (_, r, _), own in zip(records, estimates, strict=True)):
    return PredictedTime(time_absent=NO_ESTIMATE if scheduled is None else NO_SCHEDULE)
  rates = rates_for(chip)
  if rates.host_bytes_per_s is None and any(  # the step copies between host and device memory
      i.host for _, record, _ in records for name in record.runs for i in record.computations[name]):
    return PredictedTime(time_absent=HOST_UNTIMED)
  step = _Walk()
  for (_, record, times), own in zip(records, estimates, strict=True):
    step.add(program_time(record, rates, devices, own), times)
  slow_s = slow_bytes / chip.links.slow_bytes_per_s
  # A GPU pod's program spans its nodes: the walk timed the bytes that cross them at NVLink's rate, and the
  # slow network's time counts them again at InfiniBand's; count them once, there.
  crossing = BACKENDS[chip.platform].crosses_in_program
  crossed = slow_bytes / rates.network_bytes_per_s(2) if crossing else 0.0
  crossed_exposed = min(crossed, step.exposed_collective_s)
  predicted = step.total_s - crossed_exposed + slow_s
  flops = sum(times * dot_flops(record) for _, record, times in records)
  peak = chip.compute.peak_flops_per_s.get(compute_dtype, chip.compute.peak_flops_per_s["bfloat16"])
  parts = StepTime(
      source=TPU_SOURCE if scheduled is None else GPU_SOURCE,
      programs=[name if times == 1 else f"{name} x{times}" for name, _, times in records],
      compute_s=step.compute_s, fast_network=chip.links.fast, fast_s=max(0.0, step.collective_s - crossed),
      fast_exposed_s=step.exposed_collective_s - crossed_exposed, slow_s=slow_s,
      slow_network=chip.links.slow if slow_bytes else None, host_exposed_s=step.exposed_host_s,
      host_s=step.host_s if rates.host_bytes_per_s else None, unestimated_ops=step.unestimated,
      clock_ghz=None if rates.clock_hz is None else round(rates.clock_hz / 1e9, 4),
      roofline_s=flops / peak if flops else None,
      fast_exposed_by_kind=_by_kind(step.exposed_by_kind, step.exposed_collective_s - crossed_exposed))
  return PredictedTime(predicted, tokens_per_device / predicted, flops / predicted / peak if flops else None,
                       parts)


def _by_kind(exposed: Mapping[str, float], fast_s: float) -> dict[str, float] | None:
  """The exposed collectives kind by kind, scaled to ``fast_s`` (a GPU pod's crossing bytes counted on the
  slow network); None where none is exposed."""
  total = sum(exposed.values())
  return {k: round(v * fast_s / total, 9) for k, v in sorted(exposed.items()) if v} if total else None


def _module_estimates(record: ProgramRecord, scheduled: Mapping[str, Mapping[str, float]] | None
                      ) -> Mapping[str, float] | None:
  """A program's instructions' estimates from the GPU scheduler's dump, where most of its entry's costly
  instructions have one (None otherwise: a program partly unestimated has no time)."""
  own = (scheduled or {}).get(record.module) if record.module else None
  if not own or record.entry is None:
    return None
  names = [i.name for i in record.computations[record.entry]
           if i.op not in _FREE and not i.collective and not i.op.endswith("-done")]
  return own if not names or sum(n in own for n in names) >= len(names) / 2 else None
