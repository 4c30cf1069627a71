"""A compiled program's time on one device, from the compiler's own cost model, walked in schedule order: the
core advances by each instruction's estimate, collectives and host copies run on their own lanes beside it and
the core stalls at a ``-done`` only for what is left (docs/planner.md's "How fast"). A step without a time
says why (:data:`NO_ESTIMATE`, :data:`HOST_UNTIMED`, ...): nothing here guesses compute from a peak rate."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence

from nnx_zero1._src.companion import Instruction
from nnx_zero1_plan.chips import Chip
from nnx_zero1_plan.hlo_flops import dot_flops
from nnx_zero1_plan.inputs import BACKENDS
from nnx_zero1_plan.networks import (
  CollectiveTime,
  collective_time,
  crossed_seconds,
  over_the_slow_network,
  rings_of,
)
from nnx_zero1_plan.program_record import ProgramRecord
from nnx_zero1_plan.row import GPU_SOURCE, TPU_SOURCE, Figures, StepTime

# The compiler's estimate for an instruction it did not estimate (INT64_MAX).
NOT_ESTIMATED = 2**63 - 1

# What costs nothing and is not scheduled on its own: XLA's GPU scheduler gives these no estimate.
_FREE = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "partition-id",
                   "replica-id", "opt-barrier", "after-all", "add-dependency"})


@dataclasses.dataclass(frozen=True)
class Rates:
  """What turns a program's cycles and bytes into seconds on one device: the core's clock (None where the
  compiler gives no cycles), a collective's time (:func:`nnx_zero1_plan.networks.collective_time`), the host
  link's rate each way (None: copies counted, not timed), and the clock each class of work
  (``program_record.CYCLE_CLASSES``) runs the compiler's cycles at where the chip measured it (None: every
  cycle at ``clock_hz``)."""

  clock_hz: float | None
  collective_s: CollectiveTime
  host_bytes_per_s: float | None = None
  class_clocks_hz: Mapping[str, float] | None = None


@dataclasses.dataclass
class ProgramTime:
  """One program's time on one device, and its parts (seconds): the walk's end (compute and every stall, in
  schedule order), the core's estimated work, the collectives' and host copies' time, overlapped or not, and
  the part of each the core waited for (kind by kind for the collectives)."""

  total_s: float = 0.0
  compute_s: float | None = 0.0  # None where the compiler gives no cycles
  collective_s: float = 0.0
  exposed_collective_s: float = 0.0
  host_s: float | None = 0.0  # None: not timed (no host rate)
  exposed_host_s: float = 0.0
  unestimated: int = 0  # instructions the compiler did not estimate, counted as zero
  collectives: int = 0  # every loop trip counted
  exposed_by_kind: dict[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _Walk(ProgramTime):
  """A walk in progress (a computation's, or a step's programs'): its time so far (``total_s``: the core's
  now), when each lane is next free, and the transfers not yet waited for."""

  free: dict[str, float] = dataclasses.field(default_factory=dict)
  pending: dict[str, tuple[float, str, str]] = dataclasses.field(default_factory=dict)

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
      self.host_s = (self.host_s or 0.0) + seconds

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


def collective_seconds(i: Instruction, rates: Rates, devices: int) -> float:
  """A collective instruction's seconds on the network at ``rates``, in a program of ``devices``."""
  c = i.collective
  if c is None or len((groups := c.groups(devices))[0]) < 2:
    return 0.0
  return rates.collective_s(c.op, c.sent(devices), groups, rings_of(i.line), devices)


def compute_seconds(i: Instruction, rates: Rates, estimates: Mapping[str, float] | None = None
                    ) -> float | None:
  """An instruction's seconds: its estimate by name where XLA's GPU scheduler priced the program
  (``estimates``; 0.0 for what costs nothing), else its cycles at its class's clock (0.0 where it has none, or
  there is no clock); None where the compiler did not estimate it."""
  if estimates is not None:
    return 0.0 if i.op in _FREE else estimates.get(i.name)
  if i.cycles is None or rates.clock_hz is None:
    return 0.0
  return None if i.cycles >= NOT_ESTIMATED else i.cycles / (rates.class_clocks_hz or {}).get(i.work or "",
                                                                                              rates.clock_hz)


def program_time(program: ProgramRecord | str, rates: Rates, devices: int | None = None,
                 estimates: Mapping[str, float] | None = None) -> ProgramTime:
  """A compiled program's (its record, or ``compiled.as_text()``) time on one call on one device, over
  ``devices`` (its ``num_partitions`` where None): its schedule walked with the compiler's estimates
  (:func:`compute_seconds`: ``estimates`` by name where given, else the record's own from XLA's GPU scheduler,
  else its cycles at ``rates``)."""
  record = ProgramRecord.of(program)
  devices = devices or record.devices
  estimates = record.estimates if estimates is None else estimates
  timed = rates.clock_hz is not None or estimates is not None

  @functools.cache
  def walk(name: str) -> ProgramTime:
    w = _Walk()
    for i in record.computations.get(name, ()):
      if i.collective:
        w.start(i.name, collective_seconds(i, rates, devices), "network", i.collective.op)
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
      elif (seconds := compute_seconds(i, rates, estimates)) is None:
        w.unestimated += 1
      else:
        w.total_s += seconds
        w.compute_s = (w.compute_s or 0.0) + seconds
    for pending in list(w.pending):  # a transfer nothing waited for still ends the program
      w.wait(pending)
    parts = {f.name: getattr(w, f.name) for f in dataclasses.fields(ProgramTime)}
    return ProgramTime(**{**parts, "compute_s": w.compute_s if timed else None,
                          "host_s": w.host_s if rates.host_bytes_per_s else None})

  return walk(record.entry) if record.entry else ProgramTime(compute_s=None, host_s=None)


def cycle_class(program: ProgramRecord | str) -> set[str]:
  """The classes of work (:data:`~nnx_zero1_plan.program_record.CYCLE_CLASSES`) of a compiled program's
  estimated instructions."""
  return {i.work for body in ProgramRecord.of(program).computations.values() for i in body if i.work}


NO_SCHEDULE = ("XLA's GPU scheduler dumped no estimates for one of the step's programs (on jax 0.12.0.1 it "
               "writes none for a program without collectives to schedule, and only the loop bodies of a "
               "program with loops): no time rather than a part of one")
HOST_UNTIMED = ("the step copies state between host and device memory, and this chip's host link was never "
                "measured: no time rather than one without its copies (the v5e's is, benchmarks.chip_rates)")
NO_ESTIMATE = ("the compiler gives no estimate of the program's compute (XLA's GPU and CPU compilers carry "
               "no cycles in the compiled program); not guessed from a peak rate")


def rates_for(chip: Chip) -> Rates:
  """The rates a chip's programs are timed at: its clocks, its collectives' time on its fast network and its
  host link's rate."""
  compute = chip.compute
  return Rates(compute.clock_hz, collective_time(chip), compute.host_bytes_per_s, compute.class_clocks_hz)


def predict_step_time(programs: Sequence[tuple[str, ProgramRecord | str, int]], chip: Chip, *, devices: int,
                      tokens_per_device: float, compute_dtype: str, slow_bytes: int = 0,
                      figures: Figures | None = None) -> Figures:
  """``figures`` with a step's predicted time on one device (``time_absent`` says why where there is none):
  its programs' walks (:func:`program_time`), each as many times as one step runs it, and the slow network's
  bytes over its rate, exposed. ``programs``: ``(name, record or text, times)`` for each program one step
  runs, in order; ``compute_dtype`` gives the MFU's peak; ``slow_bytes``: what one device sends per step
  between slices or nodes. A GPU program's record carries its scheduler's estimates
  (``ProgramRecord.estimates``)."""
  figures = Figures() if figures is None else figures
  records = [(name, ProgramRecord.of(program), times) for name, program, times in programs]
  in_cycles = BACKENDS[chip.platform].prices_in_cycles
  # A TPU program carries the compiler's cycles in its text; a GPU program's come from its scheduler's dump.
  if not all("estimated_cycles" in r.text if in_cycles else _estimated(r) for _, r, _ in records):
    return dataclasses.replace(figures, time_absent=NO_ESTIMATE if in_cycles else NO_SCHEDULE)
  rates = rates_for(chip)
  if rates.host_bytes_per_s is None and any(  # the step copies between host and device memory
      i.host for _, record, _ in records for name in record.runs for i in record.computations[name]):
    return dataclasses.replace(figures, time_absent=HOST_UNTIMED)
  step = _Walk()
  for _, record, times in records:
    step.add(program_time(record, rates, devices), times)
  predicted, slow_s, crossed_exposed = over_the_slow_network(step.total_s, step.exposed_collective_s, chip,
                                                             slow_bytes)
  fast_exposed = step.exposed_collective_s - crossed_exposed
  flops = sum(times * dot_flops(record) for _, record, times in records)
  peak = chip.compute.peak_flops_per_s.get(compute_dtype, chip.compute.peak_flops_per_s["bfloat16"])
  parts = StepTime(
      source=TPU_SOURCE if in_cycles else GPU_SOURCE,
      programs=[name if times == 1 else f"{name} x{times}" for name, _, times in records],
      compute_s=step.compute_s or 0.0, fast_network=chip.links.fast,
      fast_s=max(0.0, step.collective_s - crossed_seconds(chip, slow_bytes)), fast_exposed_s=fast_exposed,
      slow_s=slow_s, slow_network=chip.links.slow if slow_bytes else None, host_exposed_s=step.exposed_host_s,
      host_s=step.host_s if rates.host_bytes_per_s else None, unestimated_ops=step.unestimated,
      clock_ghz=None if rates.clock_hz is None else round(rates.clock_hz / 1e9, 4),
      roofline_s=flops / peak if flops else None,
      fast_exposed_by_kind=_by_kind(step.exposed_by_kind, fast_exposed))
  return dataclasses.replace(figures, predicted_step_s=predicted, tokens_per_s_per_device=tokens_per_device /
                             predicted, mfu=flops / predicted / peak if flops else None, step_time=parts)


def _by_kind(exposed: Mapping[str, float], fast_s: float) -> dict[str, float] | None:
  """The exposed collectives kind by kind, scaled to ``fast_s`` (a GPU pod's crossing bytes counted on the
  slow network); None where none is exposed."""
  total = sum(exposed.values())
  return {k: round(v * fast_s / total, 9) for k, v in sorted(exposed.items()) if v} if total else None


def launches_kernel(i: Instruction) -> bool:
  """Whether an instruction runs as a kernel of its own: not free, not a collective nor a transfer's end."""
  return i.op not in _FREE and not i.collective and not i.op.endswith("-done")


def _estimated(record: ProgramRecord) -> bool:
  """Whether most of a GPU program's entry's kernels have the scheduler's estimate (a program partly
  unestimated has no time)."""
  own = record.estimates
  if not own or record.entry is None:
    return False
  names = [i.name for i in record.computations[record.entry] if launches_kernel(i)]
  return not names or sum(n in own for n in names) >= len(names) / 2
