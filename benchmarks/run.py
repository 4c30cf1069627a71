"""Training plain ``nnx.Optimizer`` and ``Zero1Optimizer`` side by side and measuring both.

One cell of the bench is one (dp, ga): every arm gets a freshly built model
(same seed), the same batches, one compiled step, and its steps interleaved
with the other arms' (in alternating order) so that a change in machine load
hits all arms alike and step i of two arms is a fair pair.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks import measure
from benchmarks.model import loss_fn
from benchmarks.settings import (
  ACCUMULATE_OPTIONS,
  LEVER_REFERENCE,
  OPTIMIZERS,
  STEP_ARMS,
  Settings,
  lever,
  make_optimizer,
  new_model,
  row_fields,
  tokens,
)
from nnx_zero1 import bytes_per_device
from nnx_zero1._src.report import memory_kind_of
from nnx_zero1.testing import collectives
from nnx_zero1_plan import step_jit

__all__ = [
    "StepArm", "accumulated_layout", "run_cell", "batch_sharding", "state_shardings",
    "train_step_jit",
]

def accumulated_layout(step_tokens: np.ndarray, dp: int) -> np.ndarray:
  """One step's tokens (ga, batch, seq + 1) as the rows ``value_and_grad_accumulated`` splits.

  Its micro-batch k is the k-th slice of every replica's rows; laid out this
  way, that is ``step_tokens[k]``, the micro-batch every other arm trains on.

  Example::

    >>> t = np.arange(2 * 4).reshape(2, 4, 1)  # 2 micro-batches of 4 rows
    >>> accumulated_layout(t, dp=2)[:, 0].tolist()  # replica 0: rows 0-1 of each, then replica 1
    [0, 1, 4, 5, 2, 3, 6, 7]
  """
  ga, batch = step_tokens.shape[:2]
  per_replica = step_tokens.reshape(ga, dp, batch // dp, *step_tokens.shape[2:]).swapaxes(0, 1)
  return per_replica.reshape(ga * batch, *step_tokens.shape[2:])


def batch_sharding(mesh, deferred: bool) -> NamedSharding:
  """Where one step's tokens go: rows over the data axis, for (ga * batch, seq + 1) when the
  reduction is deferred (``accumulated_layout``), else (ga, batch, seq + 1) split on the batch.

  Example::

    >>> batch_sharding(jax.make_mesh((1,), ("data",)), deferred=False).spec
    P(None, 'data')
  """
  return NamedSharding(mesh, P("data") if deferred else P(None, "data"))


def state_shardings(state: Any, mesh) -> Any:
  """The shardings of a split (model, optimizer) state, concrete or abstract, all on ``mesh``.

  Scalars that optax makes on the default device (adam's count) join the mesh, replicated.

  Example::

    >>> import jax.numpy as jnp
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> state_shardings({"count": jax.ShapeDtypeStruct((), jnp.int32)}, mesh)["count"].spec
    P()
  """
  replicated = NamedSharding(mesh, P())
  return jax.tree.map(
      lambda x: x.sharding if isinstance(getattr(x, "sharding", None), NamedSharding) else replicated, state
  )


def train_step_jit(graphdef, shardings: Any, mesh, arm: str, ga: int):
  """The arm's one jitted train step, which the CPU bench runs: the planner's one-program step.

  ``(state, batch) -> (state, loss)``, the state donated and kept on ``shardings``
  (:func:`nnx_zero1_plan.step_jit` with the arm's lever and the
  bench's loss).

  Example::

    step = train_step_jit(graphdef, state_shardings(state, mesh), mesh, "zero1-accum", ga=8)
    compiled = step.lower(state, batch).compile()
  """
  return step_jit(graphdef, shardings, batch_sharding(mesh, STEP_ARMS[arm][1]), lever(arm), loss_fn, ga)


class StepArm:
  """One arm that trains with a single compiled step: ``nnx.Optimizer`` or ``Zero1Optimizer``,
  accumulating with a ``lax.scan`` of ``nnx.value_and_grad`` or with ``value_and_grad_accumulated``.

  The model and optimizer are split once (``nnx.split``) and the step is one
  ``jax.jit`` of ``nnx.merge`` + micro-batch loop + ``optimizer.update``,
  compiled ahead of time with the state's own shardings in and out and the
  state donated, as a training loop would run it.

  Example::

    arm = StepArm("zero1", settings, mesh, tokens(settings, ga, 0))
    loss = arm.step(arm.prepare(tokens(settings, ga, 1)))
  """

  def __init__(self, name: str, settings: Settings, mesh, example: np.ndarray):
    self.name = name
    self.dp = mesh.shape["data"]
    self.deferred = STEP_ARMS[name][1]
    model = new_model(settings, mesh)
    optimizer = make_optimizer(name, model, OPTIMIZERS[settings.optimizer](), mesh)
    self.graphdef, state = nnx.split((model, optimizer))
    self.batch_sharding = batch_sharding(mesh, self.deferred)
    shardings = state_shardings(state, mesh)
    self.state = jax.device_put(state, shardings)
    step = train_step_jit(self.graphdef, shardings, mesh, name, example.shape[0])
    start = time.perf_counter()
    with jax.set_mesh(mesh):  # Explicit-mode ops (the embedding lookup) read the mesh from here
      self.compiled = step.lower(self.state, self.prepare(example)).compile()
    self.compile_s = time.perf_counter() - start

  def prepare(self, step_tokens: np.ndarray) -> jax.Array:
    """Puts one step's tokens on the mesh (outside the timed region)."""
    if self.deferred:
      step_tokens = accumulated_layout(step_tokens, self.dp)
    return jax.device_put(step_tokens, self.batch_sharding)

  def step(self, batch: jax.Array) -> jax.Array:
    """One optimizer step; returns the mean micro-batch loss (not yet synchronised)."""
    self.state, loss = self.compiled(self.state, batch)
    return loss

  def optimizer_bytes(self) -> int:
    """Optimizer-state bytes on the fullest device."""
    return bytes_per_device(nnx.state(nnx.merge(self.graphdef, self.state)[1]))

  def optimizer_bytes_by_memory_kind(self) -> dict[str, int]:
    """Optimizer-state bytes on the fullest device, per memory kind (``device``, ``pinned_host``)."""
    leaves = jax.tree.leaves(nnx.as_pure(nnx.state(nnx.merge(self.graphdef, self.state)[1])))
    kinds = sorted({memory_kind_of(x) for x in leaves})
    return {kind: bytes_per_device([x for x in leaves if memory_kind_of(x) == kind]) for kind in kinds}

  def grad_accumulator_bytes(self) -> int:
    """The gradient accumulator's bytes per device, from its layout: a whole float32 copy of the
    parameters per replica (one row), or their Zero-1 slices with ``shard_accumulator``."""
    model, optimizer = nnx.merge(self.graphdef, self.state)
    params = jax.tree.leaves(nnx.as_pure(nnx.state(model, nnx.Param)))
    if self.name in ACCUMULATE_OPTIONS:
      layouts = optimizer.zero1_plan.zero1_param_shardings
      return sum(int(np.prod(s.shard_shape(p.shape))) * 4 for p, s in zip(params, layouts, strict=True))
    return sum(int(np.prod(p.shape)) * 4 for p in params)

  def params(self) -> list[np.ndarray]:
    """The parameters, as host arrays."""
    model = nnx.merge(self.graphdef, self.state)[0]
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]

  def memory(self) -> dict[str, int]:
    """Per-device bytes of the compiled step."""
    return measure.memory(self.compiled)

  def collectives(self) -> dict[str, dict[str, int]]:
    """Collectives of one step."""
    hlo = self.compiled.as_text()
    assert hlo is not None  # None only for executables XLA cannot print
    return collectives(hlo)


def _row(arm, times: list[float], loss: float, base_loss: float, same: bool, dp: int, ga: int,
         settings: Settings, diff: float, equal_to: list[str]) -> dict[str, Any]:
  mem = arm.memory()
  levers = {}
  if isinstance(arm, StepArm):  # fields the engine arms do not measure
    levers = {
        "opt_state_bytes_by_memory_kind": arm.optimizer_bytes_by_memory_kind(),
        "grad_accumulator_bytes_per_device": arm.grad_accumulator_bytes() if arm.deferred else None,
    }
  return {
      **levers,
      **row_fields(arm.name, dp, ga, settings, arm.optimizer_bytes(), mem),
      "step_ms": measure.median_ms(times),
      "step_times_ms": [round(t * 1e3, 3) for t in times],  # paired with the other arms' by index
      "step_ms_min": round(min(times) * 1e3, 3),  # less sensitive to other load on a shared machine
      "compile_s": round(arm.compile_s, 3),
      "collectives": arm.collectives(),
      "loss": loss,
      "loss_diff": abs(loss - base_loss),
      "params_equal": same,
      "params_max_diff": diff,  # max |param - the reference arm's param| after the last step
      "params_equal_arms": equal_to,  # the other arms whose final parameters are bit-identical
      "param_bytes": sum(p.nbytes for p in arm.params()),
  }


def _make_arm(name: str, settings: Settings, mesh, example: np.ndarray):
  if name in STEP_ARMS:
    return StepArm(name, settings, mesh, example)
  from benchmarks import engine_arms  # only when the MaxText-style adapter is asked for

  return engine_arms.EngineArm(name, settings, mesh, example)


def run_cell(
    settings: Settings, dp: int, ga: int, arms: Sequence[str] = ("baseline", "zero1"), tick=None
) -> list[dict[str, Any]]:
  """Trains every arm at one (dp, ga) and returns one row per arm; ``arms[0]`` is the reference.

  Each arm is built and compiled, then the arms take their steps in turn
  (step i of every arm, then step i + 1, the order reversed every other step
  so no arm always runs first), so a change in machine load hits every arm
  alike. ``tick()`` is called after each compile and each step.

  Example::

    >>> rows = run_cell(Settings(model="tiny", steps=1, warmup=0), dp=1, ga=1)  # doctest: +SKIP
  """
  tick = tick or (lambda: None)
  devices = jax.devices()
  if len(devices) < dp:
    raise ValueError(f"dp={dp} needs {dp} devices; this process has {len(devices)}")
  if settings.batch % dp:
    raise ValueError(f"the global micro-batch of {settings.batch} sequences does not split over dp={dp}")
  axis_type = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}[settings.mesh]
  mesh = jax.make_mesh((dp,), ("data",), axis_types=(axis_type,), devices=devices[:dp])
  built = []
  for name in arms:
    built.append(_make_arm(name, settings, mesh, tokens(settings, ga, 0)))
    tick()
  times: dict[str, list[float]] = {arm.name: [] for arm in built}
  losses: dict[str, float] = {}
  others = measure.load_meter()
  for i in range(settings.warmup + settings.steps):
    step_tokens = tokens(settings, ga, i)
    for arm in built if i % 2 == 0 else built[::-1]:
      batch = arm.prepare(step_tokens)
      loss, seconds = measure.time_call(functools.partial(arm.step, batch))
      losses[arm.name] = float(loss)
      if i >= settings.warmup:
        times[arm.name].append(seconds)
      tick()
  other_load = others()
  reference = built[0]
  final = {arm.name: arm.params() for arm in built}
  equal = lambda a, b: all(np.array_equal(x, y) for x, y in zip(final[a], final[b], strict=True))
  rows = []
  for arm in built:
    diff = max(float(np.max(np.abs(x - y))) for x, y in zip(final[arm.name], final[reference.name]))
    equal_to = [other.name for other in built if other is not arm and equal(arm.name, other.name)]
    rows.append(_row(arm, times[arm.name], losses[arm.name], losses[reference.name],
                     equal(arm.name, reference.name), dp, ga, settings, diff, equal_to))
  # What other processes took of the machine while the steps were timed: the verdicts say
  # "inconclusive" rather than judge step times a busy machine skewed.
  share = None if other_load is None else round(other_load, 3)
  return _with_lever_ratios([{**r, "other_cpu_share": share} for r in rows])


def _with_lever_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """Adds ``step_ms_vs_zero1_accum`` to every row when the cell ran ``zero1-accum``.

  Example::

    >>> rows = [{"arm": "zero1-accum", "step_ms": 2.0}, {"arm": "zero2-accum", "step_ms": 3.0}]
    >>> _with_lever_ratios(rows)[1]
    {'arm': 'zero2-accum', 'step_ms': 3.0, 'step_ms_vs_zero1_accum': 1.5}
  """
  reference = next((r for r in rows if r["arm"] == LEVER_REFERENCE), None)
  if reference is None or not reference["step_ms"]:
    return rows
  return [{**r, "step_ms_vs_zero1_accum": round(r["step_ms"] / reference["step_ms"], 3)} for r in rows]


