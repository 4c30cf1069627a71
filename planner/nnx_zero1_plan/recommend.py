"""The configuration a plan recommends, by a stated order (:data:`BY_THROUGHPUT`, else :data:`ORDER`); a
Zero-1 lever that splits nothing, or saves little (:func:`saves_little`), is no candidate."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from nnx_zero1_plan import bands
from nnx_zero1_plan.bands import SAME_SPEED, differ_in, kind_bytes, parts_of, told_apart
from nnx_zero1_plan.cells import gib, ms
from nnx_zero1_plan.levers import LEVERS, narrowed_dtypes, splits_nothing
from nnx_zero1_plan.printed_code import lever_code
from nnx_zero1_plan.request import PlanRequest, ResolvedRequest, command_line, remats
from nnx_zero1_plan.row import Point, Record, Row

ORDER: tuple[str, ...] = (
    "fits", "largest micro-batch", "fewest bytes sent over the slow network per token (pods; within 1%)",
    "fewest collective bytes sent per token (within 1%)",
    "fewest bytes copied to and from host memory per step (offloaded state; within 1%)",
    "most headroom at that micro-batch", "no remat", "the lighter lever")
_SAME_BYTES = 0.01  # collective bytes this close are a tie: the headroom decides
BY_THROUGHPUT: tuple[str, ...] = ("fits", "most predicted tokens per second per device",
                                  "equal to it within what the plan can tell (within 2%, or each part within "
                                  "its band): most headroom", "no remat", "the lighter lever")
# Where every point that fits has a time calibrated on the chip (--measure, --calibration), that time ranks.
BY_CALIBRATED: tuple[str, ...] = ("fits", "most tokens per second per device, timed as calibrated",
                                  *BY_THROUGHPUT[2:])
_RECOMPUTE = 0.05  # compute per sequence this much above the cheapest fitting point: the compiler recomputes
_THIN = 0.01  # a pick leaving less than this share of the usable memory free is marked thin
# A Zero-1 saving under this share of the baseline's peak is within the compiler's own scatter near its limit
# (it lands within about 1.5% either side: docs/planner.md's search): it buys no micro-batch one can count on.
_LITTLE = 0.015


@dataclasses.dataclass(frozen=True)
class Recommendation(Record):
  """The configuration a plan recommends (plan.json's ``recommendation``): the lever, step shape, micro-batch
  (its search's edge where there was one) and remat policy to run, the code that builds it and the command
  that reproduces it, the order it was picked by and why (:func:`baseline_beats`, :func:`why_picked`), and
  notes: edges not confirmed, levers left out for splitting nothing, recompute, a narrowed hop."""

  lever: str
  step: str
  micro_batch: int
  remat: str | None
  code: str
  cli: str
  order: tuple[str, ...]
  baseline_beats: tuple[str, ...]
  why: tuple[str, ...]
  notes: tuple[str, ...]


def micro_batch_of(row: Row, batch: int) -> int | None:
  """The micro-batch a row stands for: its search's edge, else ``batch`` where the row fits."""
  if row.searched is not None:
    return row.searched.max_micro_batch
  return batch if row.fits else None


def _points(row: Row) -> tuple[Point, ...]:
  return row.searched.search if row.searched is not None else ()


def _fitting(rows: Sequence[Row]) -> list[tuple[Row, Point]]:
  """Each row's points that fit, its own compile's and its search's, as ``(row, point)``."""
  return [(r, p) for r in rows for p in (*_points(r), _own(r)) if p.fits]


def fitted_at(row: Row) -> set[int]:
  """The micro-batches at which the row's own whole compiles fitted (its search's, and its own)."""
  return {p.batch for _, p in _fitting([row])}


def recompute_note(row: Row, micro: int) -> str | None:
  """Where a row's compute per sequence at ``micro`` is over 5% above its cheapest fitting compile's (the
  compiler rematerialises to fit), one sentence saying so; None otherwise, or where no compile has flops."""
  points = {p.batch: p.flops_per_device / p.batch for p in _points(row) if p.fits and p.flops_per_device}
  if micro not in points or len(points) < 2:
    return None
  cheapest = min(points, key=lambda b: points[b])
  extra = points[micro] / points[cheapest] - 1
  if extra <= _RECOMPUTE:
    return None
  return (f"{row.lever} at micro-batch {micro} computes {points[micro] / 1e12:.2f} TFLOP per sequence per "
          f"device against {points[cheapest] / 1e12:.2f} at {cheapest}: {extra:+.0%} recompute, a larger "
          "micro-batch trades memory for it")


def thin_note(row: Row, micro: int) -> str | None:
  """Where a row at ``micro`` leaves less than 1% of the usable memory free, one sentence saying so (near its
  limit a compiler lands within about 1.5% either side of it: docs/planner.md's search); None otherwise."""
  room, usable = figures_at(row, micro).headroom_bytes_per_device, row.usable_bytes
  if room is None or not usable or room >= _THIN * usable:
    return None
  return (f"thin: {row.lever} at micro-batch {micro} leaves {gib(room)} GiB of "
          f"{gib(usable)} GiB usable free ({room / usable:.2%}, under 1%); near its limit the "
          "compiler lands within about 1.5% either side: a smaller micro-batch or --margin leaves room")


def _states(row: Row, rows: Sequence[Row]) -> tuple[int, int, Row] | None:
  """A Zero-1 row's optimizer state per device, its baseline's (the same step and remat policy) and that
  baseline; None for a baseline, state in host memory, no baseline planned, or a state not known."""
  base = _baseline(row, rows)
  if row.lever == "baseline" or row.figures.host_state_bytes or base is None:
    return None
  mine, theirs = row.figures.opt_state_bytes_per_device, base.figures.opt_state_bytes_per_device
  return None if mine is None or theirs is None else (mine, theirs, base)


def _baseline(row: Row, rows: Sequence[Row]) -> Row | None:
  """The baseline of the row's step and remat policy, where the plan has one."""
  return next((r for r in rows if r.lever == "baseline" and (r.step, r.remat) == (row.step, row.remat)), None)


def baseline_by_another_name(row: Row, rows: Sequence[Row]) -> bool:
  """Whether a Zero-1 row's layout split nothing (:func:`~nnx_zero1_plan.levers.splits_nothing`), none of
  its state in host memory, beside a baseline planned with it: the baseline by another name, no candidate."""
  return (_baseline(row, rows) is not None and not row.figures.host_state_bytes
          and splits_nothing(row.lever, row.mesh, row.figures.state_split))


def saves_little(row: Row, rows: Sequence[Row]) -> str | None:
  """Where a Zero-1 row's optimizer state per device is smaller than the fitting baseline's by less than 1.5%
  of the baseline's peak (LoRA's small state), one line saying so; None otherwise (also where a search found
  the row a larger micro-batch than the baseline's: then the saving is what fits)."""
  states = _states(row, rows)
  if states is None or baseline_by_another_name(row, rows):
    return None
  mine, theirs, base = states
  edge = lambda r: micro_batch_of(r, r.batch) or 0
  peak = base.figures.peak_bytes_per_device
  if not base.fits or edge(row) > edge(base) or not peak or theirs - mine >= _LITTLE * peak:
    return None
  saved = theirs - mine
  return (f"{row.lever} saves little here: {gib(saved)} GiB of optimizer state per device, "
          f"{saved / peak:.1%} of the baseline's {gib(peak)} GiB peak (under 1.5%, the compiler's own "
          "scatter near its limit): nnx.Optimizer is as good")


def row_sent_bytes(row: Row) -> int:
  """The collective bytes one device sends per step on every network together, one basis on every backend (a
  pod's networks': a TPU program's megascale transfers are not among its collectives)."""
  if row.made.network_per_step is not None:
    return row.made.network_per_step.bytes
  return 0 if row.figures.collectives is None else row.figures.collectives.sent_bytes


def row_across_bytes(row: Row) -> int:
  """The bytes one device sends per step between slices or nodes (0 on one slice or node)."""
  return 0 if row.figures.collectives is None else row.figures.collectives.across_bytes


def _own(row: Row) -> Point:
  return Point.of(row.batch, bool(row.fits), row.figures)


def figures_at(row: Row, batch: int) -> Point:
  """The row's figures at ``batch``: its search's compile there, else its own (at its own batch)."""
  return next((p for p in _points(row) if p.batch == batch), None) or _own(row)


def baseline_beats(rows: Sequence[Row], batch: int) -> list[str]:
  """One sentence for each Zero-1 lever among ``rows`` (of one step shape) that fits a smaller micro-batch
  than ``nnx.Optimizer``, saying why: its temporaries against the arguments it saves, at the baseline's
  largest micro-batch where a search compiled both there, else at the plan's."""
  base = next((r for r in rows if r.lever == "baseline"), None)
  if base is None:
    return []
  out, at_base = [], micro_batch_of(base, batch) or 0
  for r in rows:
    at_lever = micro_batch_of(r, batch) or 0
    if r.lever == "baseline" or at_lever >= at_base or at_base in fitted_at(r):
      continue  # (its own compile fitted at the baseline's: it does not fit less)
    b, z, compared = figures_at(base, at_base), figures_at(r, at_base), at_base
    if b.batch != at_base or z.batch != at_base:  # no search compiled both there: the plan's own
      b, z, compared = _own(base), _own(r), batch
    beats = (f"baseline fits micro-batch {at_base} where {r.lever} fits {at_lever or 'none'}: at micro-batch "
             f"{compared} ({r.step} step)")
    if z.temp_bytes_per_device is None or b.temp_bytes_per_device is None:
      out.append(f"{beats} the compiler refused {r.lever}: {(z.error or 'no figures')[:160]}")
      continue
    temp = z.temp_bytes_per_device - b.temp_bytes_per_device
    args = (b.argument_bytes_per_device or 0) - (z.argument_bytes_per_device or 0)
    saved = (f"more than the {gib(args)} GiB its arguments save" if temp > args
             else f"and its arguments save {gib(args)} GiB")
    out.append(f"{beats} {r.lever}'s temporaries are {temp / 2**30:+.2f} GiB against the baseline's, {saved}")
  return out


def host_bytes_of(row: Row) -> int:
  """The bytes a row's step copies between host and device memory: its offloaded state, in and out."""
  return 2 * (row.figures.host_argument_bytes_per_device or 0)


def narrowed_note(lever: str) -> str | None:
  """What a lever that narrows a hop between slices or nodes gives up (None: nothing)."""
  narrowed = narrowed_dtypes(LEVERS[lever]) if lever in LEVERS else {}
  if not narrowed:
    return None
  what = {"across_dtype": "its gradients", "params_across_dtype": "its new parameters (the masters exact)"}
  spelled = {"int8": "int8 blocks with float32 scales"}
  hops = " and ".join(what[o] for o in narrowed)
  dtypes = " and ".join(spelled.get(d, d) for d in dict.fromkeys(narrowed.values()))  # each dtype said once
  return (f"{lever} is not bit-identical: {hops} cross between slices or nodes in {dtypes} "
          f"({', '.join(narrowed)}; docs/pods.md measures the loss against the exact reduction)")


def _differ(mine: int, theirs: int) -> bool:
  """Whether two byte counts are more than 1% apart (of the larger): closer is a tie."""
  return abs(mine - theirs) > _SAME_BYTES * max(mine, theirs, 1)


def why_picked(best: Row, rivals: Sequence[Row], micro: int) -> list[str]:
  """One sentence for each lever that fits the same micro-batch as the pick: the headroom each leaves there
  and the bytes each sends, and which of :data:`ORDER` decided."""
  room = lambda row: gib(figures_at(row, micro).headroom_bytes_per_device, none="?")
  out = []
  for rival in rivals:
    (my_across, their_across), (mine, theirs), (my_host, their_host) = (
        (bytes_of(best), bytes_of(rival)) for bytes_of in (row_across_bytes, row_sent_bytes, host_bytes_of))
    if _differ(my_across, their_across):
      sent = (f"{best.lever} sends {gib(my_across)} GiB per step over the slow network and "
              f"{rival.lever} {gib(their_across)}")
      reason = "its fewer bytes between slices or nodes"
    elif _differ(mine, theirs):
      sent = f"{best.lever} sends {gib(mine)} GiB of collectives per step and {rival.lever} {gib(theirs)}"
      reason = "its fewer collective bytes"
    else:
      sent, reason = f"both send {gib(mine)} GiB of collectives per step", "its headroom"
      if _differ(my_host, their_host):
        sent += (f"; {best.lever} copies {gib(my_host)} GiB to and from host memory per step and "
                 f"{rival.lever} {gib(their_host)}")
        reason = "its fewer bytes over the host link"
    out.append(f"at micro-batch {micro} {best.lever} leaves {room(best)} GiB free and {rival.lever} "
               f"{room(rival)} GiB; {sent}: {best.lever} for {reason}")
  return out


def plan_code(request: PlanRequest, lever: str, offload_fraction: float | None = None,
              activation_sharding: Mapping[str, Any] | str | None = None) -> str:
  """The code that trains as ``request`` (resolved: its mesh sized) planned ``lever`` (:func:`lever_code`):
  its model, mesh, optimizer and target; a recommendation's and a way out's."""
  return lever_code(lever, request.model_ref, offload_fraction, request.mesh_sizes, request.optimizer,
                    backend=request.backend, domains=request.domains,
                    activation_sharding=activation_sharding, lora=request.lora)


def _ms(seconds: float | None) -> str:
  return "?" if seconds is None else f"{ms(seconds)} ms"


def _throughput(point: Point, calibrated: bool) -> float:
  """A point's tokens per second per device, by its calibrated time or the cost model's."""
  tokens = point.tokens_per_s_per_device or 0.0
  return tokens * (point.predicted_step_s or 0.0) / (point.calibrated_step_s or 1.0) if calibrated else tokens


def _speed(row: Row, point: Point, calibrated: bool) -> str:
  """A point's time in words (``zero1 at 128: 412.0 ms, 318,000 tok/s per device``; on a pod, the slow
  network's share)."""
  words = (f"{row.lever} at {point.batch}: {_ms(bands.step_s(point, calibrated))}"
           f"{' calibrated' * calibrated}, {_throughput(point, calibrated):,.0f} tok/s per device")
  t = row.figures.step_time
  if t is not None and t.slow_network and row.figures.predicted_step_s and point.batch == row.batch:
    words += f" ({t.slow_network} {_ms(t.slow_s)} of it, {t.slow_s / row.figures.predicted_step_s:.0%})"
  return words


def _parts(c: tuple[Row, Point], calibrated: bool) -> dict[str, float]:
  """A point's time by source (:func:`~nnx_zero1_plan.bands.parts_of`), its collectives' kinds its row's."""
  return parts_of(c[1], calibrated, kind_bytes(c[0].figures.collectives)) or {}


def _per_token(c: tuple[Row, Point], calibrated: bool) -> dict[str, float]:
  """A point's time by source per token one device trains."""
  tokens = (c[1].tokens_per_s_per_device or 0.0) * (c[1].predicted_step_s or 0.0) or 1.0
  return {k: v / tokens for k, v in _parts(c, calibrated).items()}


def by_throughput(rows: Sequence[Row]) -> tuple[Row, Point, list[str], tuple[str, ...]] | None:
  """The (lever, micro-batch) by :data:`BY_THROUGHPUT` (:data:`BY_CALIBRATED` where every point has a
  calibrated time) among the points that fit: of those the fastest is not told apart from (each part of the
  step within its band), the most headroom; why, against each other lever's fastest point; and the order.
  None where a fitting point has no predicted time (the order is then :data:`ORDER`)."""
  points = _fitting(rows)
  if not points or any(p.tokens_per_s_per_device is None for _, p in points):
    return None
  calibrated = bands.judged_by_calibrated(p for _, p in points)
  speed = lambda c: _throughput(c[1], calibrated)
  fastest = max(points, key=speed)
  told = lambda c, d: told_apart(_per_token(c, calibrated), _per_token(d, calibrated))
  best, at = min((c for c in points if told(c, fastest) is None), key=lambda c: _roomier(*c))
  why = []
  for rival in dict.fromkeys(r.lever for r, _ in points if r.lever != best.lever):
    theirs = max((c for c in points if c[0].lever == rival), key=speed)
    if abs(1 - speed(theirs) / speed((best, at))) <= SAME_SPEED:
      reason = f"within 2%, {best.lever} for its headroom"
    elif told((best, at), theirs) is None:
      parts = differ_in(_parts((best, at), calibrated), _parts(theirs, calibrated), (best.lever, rival))
      reason = f"equal within what the plan can tell: they differ in {parts}: {best.lever} for its headroom"
    else:  # told apart: by how much, the bands of the parts they differ in notwithstanding
      more = speed((best, at)) / speed(theirs) - 1
      reason = (f"{best.lever} for its throughput, {more:.1%} more tokens per second, more than the bands of "
                "the parts they differ in allow")
    why.append(f"{_speed(best, at, calibrated)}; {_speed(*theirs, calibrated)}: {reason}")
  return best, at, why, BY_CALIBRATED if calibrated else BY_THROUGHPUT


def _roomier(row: Row, point: Point) -> tuple[int, bool]:
  """Both orders' last words as a sort key: most headroom, no remat (the lighter lever: ``min`` keeps the
  rows' order)."""
  return -(point.headroom_bytes_per_device or 0), remats(row.remat)


def recommend(rows: Sequence[Row], request: ResolvedRequest, *,
              activation_sharding: Mapping[str, Any] | str | None = None,
              step: str | None = None) -> Recommendation | None:
  """The configuration to run among the rows of one ``step`` shape (by default the first its model's kind
  compiles, where there are such rows), by :data:`BY_THROUGHPUT` or :data:`ORDER` (a searched row stands at
  its edge); None when no row fits. ``activation_sharding``: a ``tunix:`` model's, for its code."""
  if step is None:
    shapes = [r.step for r in rows]
    step = request.model_ref.kind.steps[0]
    step = step if step in shapes else (shapes[0] if shapes else step)
  same_step = [r for r in rows if r.step == step]
  little = {r.lever: note for r in same_step if (note := saves_little(r, same_step)) is not None}
  candidates = [r for r in same_step if not baseline_by_another_name(r, same_step) and r.lever not in little]
  edges = [micro_batch_of(r, r.batch) for r in candidates]
  if not any(edges):
    return None
  fastest = by_throughput(candidates)
  if fastest is not None:
    best, at, why, order = fastest
    micro = at.batch
  else:
    micro, order = max(m for m in edges if m), ORDER
    # Every lever whose own compile fitted at the best micro-batch stands there, above its edge or not; the
    # tokens per step are the same for each, so bytes per step rank as bytes per token.
    level = standing = [r for r, m in zip(candidates, edges) if m == micro or micro in fitted_at(r)]
    # The slow network's bytes first, then all collectives', then the host link's.
    for bytes_of in (row_across_bytes, row_sent_bytes, host_bytes_of):
      fewest = min(map(bytes_of, level))
      level = [r for r in level if bytes_of(r) <= fewest * (1 + _SAME_BYTES)]
    best = min(level, key=lambda r: _roomier(r, figures_at(r, micro)))
    why = why_picked(best, [r for r in standing if r is not best], micro)
  unconfirmed = [f"{r.lever}'s edge is not confirmed ({r.searched.search_unfinished}): it fits at least "
                 f"{micro_batch_of(r, r.batch)}" for r in candidates
                 if r.searched is not None and r.searched.search_unfinished]
  skipped = [little.get(r.lever) or f"{r.lever} holds the baseline's optimizer state per device (its layout "
             "splits nothing): not a candidate" for r in same_step if r not in candidates]
  offload = None if best.offloaded is None else best.offloaded.offload_fraction
  code = plan_code(request, best.lever, offload, activation_sharding)
  if best.ga is not None:  # --global-batch chose the split: the code says it, the command reproduces it
    code += (f"\n# micro-batch {micro} x GA {best.ga} = {request.global_batch} sequences a step: your "
             f"trainer's gradient accumulation, or optax.MultiSteps(tx, every_k_schedule={best.ga})")
  return Recommendation(
      lever=best.lever, step=step, micro_batch=micro, remat=best.remat, code=code,
      cli=command_line(request, levers=[best.lever], steps=[step], batch=micro, remat=best.remat,
                       ga=best.ga or request.ga, global_batch=None),
      order=order, baseline_beats=tuple(baseline_beats(same_step, request.batch)), why=tuple(why),
      notes=(*unconfirmed, *skipped, *filter(None, [thin_note(best, micro), recompute_note(best, micro),
                                                    narrowed_note(best.lever)])))
