"""On a TPU VM whose chips are the target's (``v5e:1x1`` on a one-chip v5e) the plan compiles for them, not a
compile-only topology (an older libtpu refuses some shapes there), reading the usable memory from their
allocator; ``--measure`` runs each fitting row's one-program step for a few steady steps. One process at a
time may hold a TPU, and each run's allocator peak must be its own: a child process per use."""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from nnx_zero1_plan import compilers
from nnx_zero1_plan.child import MARK, child_env, plan_in_child, say
from nnx_zero1_plan.chips import chip_of
from nnx_zero1_plan.gpu_chips import GPU_CHIPS
from nnx_zero1_plan.inputs import ONE_SLICE, PlanError, error_line, parse_topology
from nnx_zero1_plan.request import PlanRequest
from nnx_zero1_plan.result import Plan
from nnx_zero1_plan.row import Measured, Row

__all__ = ["WARMUP", "TIMED", "LocalDevices", "chips_may_be_here", "local_devices", "not_the_target",
           "devices_for", "plan_here", "measured_batches", "measured_plan", "measure_one", "main"]

WARMUP, TIMED = 2, 8  # steps run first (the allocator's growth, the program's load), then the steps counted
_RUN_TIMEOUT_S = 900  # one run's child: the model built, the step compiled, ten steps


@dataclasses.dataclass(frozen=True)
class LocalDevices:
  """The devices jax sees on this machine: their platform (as the planner names it), kind and count."""

  platform: str  # "tpu", "cuda" or "cpu"
  device_kind: str
  count: int

  @classmethod
  def of(cls, devices: Sequence[Any]) -> LocalDevices:
    """The record of jax's devices (a GPU's platform ``"gpu"`` named ``"cuda"``, as a topology's)."""
    platform = devices[0].platform
    return cls("cuda" if platform == "gpu" else platform, devices[0].device_kind, len(devices))


def chips_may_be_here(platform: str) -> bool:
  """Whether this machine has the device files of ``platform``'s chips (a TPU VM's ``/dev/accel*`` or
  ``/dev/vfio/*``, a GPU's ``/dev/nvidia*``): only then is jax asked, as starting its TPU backend where
  there is no TPU takes time.

  Example::

    >>> chips_may_be_here("cpu")
    False
  """
  patterns = {"tpu": ("/dev/accel*", "/dev/vfio/[0-9]*"), "cuda": ("/dev/nvidia[0-9]*",)}.get(platform, ())
  return any(glob.glob(p) for p in patterns)


def _child(command: str, job: Mapping[str, Any] | None, timeout: float) -> tuple[dict[str, Any] | None, str]:
  """Runs ``python -m nnx_zero1_plan.local COMMAND`` with ``job`` on stdin; its answer (None: none) and
  its last line of other output, for the reason it gave none."""
  compilers.clear_stale_lockfile()  # a killed run's lockfile would stop the next process that opens the TPU
  try:
    done = subprocess.run([sys.executable, "-m", "nnx_zero1_plan.local", command], input=json.dumps(job),
                          capture_output=True, text=True, timeout=timeout, env=child_env(os.environ))
  except subprocess.TimeoutExpired:
    return None, f"no answer in {timeout:.0f} s"
  found = [line[len(MARK):] for line in done.stdout.splitlines() if line.startswith(MARK)]
  other = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
  return (json.loads(found[-1]) if found else None), (other[-1][:300] if other else f"exit {done.returncode}")


def local_devices() -> LocalDevices | None:
  """The devices jax sees on this machine, asked in a child process (this one keeps its own jax, and
  leaves the chips free); None where the child could not say.

  Example::

    local_devices()   # LocalDevices(platform='tpu', device_kind='TPU v5 lite', count=1) on a one-chip v5e
  """
  answer, _ = _child("probe", None, timeout=180)
  return None if answer is None else LocalDevices(**answer)


def not_the_target(local: LocalDevices | None, topology: str, slices: int = ONE_SLICE) -> str | None:
  """Why ``local`` are not ``topology``'s chips (platform, kind and count), in words; None where they are.

  Example::

    >>> not_the_target(LocalDevices("tpu", "TPU v5 lite", 1), "v5e:1x1") is None
    True
    >>> not_the_target(LocalDevices("cpu", "cpu", 2), "v5e:1x1")
    "this machine's devices are 2 x 'cpu' (cpu), not v5e:1x1's 1 v5e"
  """
  platform, chip, shape = parse_topology(topology, GPU_CHIPS)
  want = math.prod(shape) * (slices if platform == "tpu" else 1)
  if local is None:
    return f"jax sees no {platform.upper()} devices on this machine, not {topology}'s {want} {chip}"
  if local.platform == platform and chip_of(local.device_kind) == chip and local.count == want:
    return None
  return (f"this machine's devices are {local.count} x {local.device_kind!r} ({local.platform}), not "
          f"{topology}'s {want} {chip}")


def devices_for(request: PlanRequest, measure: bool = False) -> LocalDevices | None:
  """This machine's devices where they are the request's target's chips (jax asked with ``measure``, or
  where their device files are: :func:`chips_may_be_here`); None where they are not.

  Raises:
    PlanError: ``measure`` (``--measure``) and the devices are not the target's, or a ``maxtext:`` model
      (its steps run in MaxText's engine, not the planner's).
  """
  if measure and request.model_ref.kind == "maxtext":
    raise PlanError("--measure runs the planner's own step; a maxtext: model's runs in MaxText's engine "
                    "(time it with MaxText's train)")
  # --measure always asks (a refusal names what jax sees); a plan only where the chips' device files are.
  local = local_devices() if measure or chips_may_be_here(request.platform) else None
  why = not_the_target(local, request.topology, request.slices)
  if why and measure:
    raise PlanError(f"--measure runs each row's step on this machine's devices, which must be the target's: "
                    f"{why}")
  return None if why else local


def plan_here(request: PlanRequest, progress: Callable[[str], None] | None = None,
              measure: bool = False) -> Plan:
  """The plan made where the target's chips are this machine's (:func:`devices_for`): a TPU's compiled for
  them (a GPU's deviceless, as anywhere), then with ``measure`` each fitting row run on them
  (:func:`measured_plan`)."""
  result = plan_in_child(request, progress, local=request.platform == "tpu")
  return measured_plan(result, request, progress) if measure else result


def measured_batches(row: Row) -> tuple[int, ...]:
  """The micro-batches ``--measure`` runs a row at: its own where it fits, and the largest a search found
  (none for a two-program step, which the planner's runner does not run, or an estimate).

  Example::

    >>> from nnx_zero1_plan.row import Figures, Made
    >>> row = Row("zero1", "one", "v5e:1x1", "TPU v5 lite", {"data": 1}, "m:f", 8, Figures(), Made(), 9, 9,
    ...           True)
    >>> measured_batches(row), measured_batches(dataclasses.replace(row, step="split"))
    ((8,), ())
  """
  if row.step != "one" or row.estimated:
    return ()
  batches = [row.batch] if row.verdict else []
  largest = row.searched.max_micro_batch if row.searched is not None else None
  return tuple(batches + ([largest] if largest and largest not in batches else []))


def measured_plan(result: Plan, request: PlanRequest, progress: Callable[[str], None] | None = None) -> Plan:
  """``result`` with each row's runs (:func:`measured_batches`), each in a child process of its own."""
  say = progress or (lambda line: None)
  rows = []
  for row in result.rows:
    runs = []
    for batch in measured_batches(row):
      say(f"running {row.lever} ({row.step}) at micro-batch {batch}: {WARMUP} + {TIMED} steps ...")
      job = {"request": request.to_json(), "lever": row.lever, "remat": row.remat, "batch": batch,
             "offload_fraction": row.offloaded.offload_fraction if row.offloaded else 0.0}
      answer, last = _child("measure", job, _RUN_TIMEOUT_S)
      run = Measured(**answer) if answer else Measured(batch, None, error=f"the run's process failed: {last}")
      said = run.error or f"{(run.step_s or 0.0) * 1e3:,.1f} ms, the median of {TIMED}"
      say(f"ran {row.lever} ({row.step}) at micro-batch {batch}: {said}")
      runs.append(run)
    rows.append(dataclasses.replace(row, measured=tuple(runs)) if runs else row)
  return dataclasses.replace(result, rows=rows)


def measure_one(request: PlanRequest, lever_name: str, remat: str | None, batch: int,
                offload_fraction: float = 0.0) -> Measured:
  """One lever's one-program step at ``batch`` on this process's devices, the target's chips: built,
  compiled and run (:func:`nnx_zero1_plan.steps.run_steps`); a refusal is the answer, not raised.

  Example::

    measure_one(PlanRequest("examples.planner_decoder:build", "v5e:1x1"), "zero1", None, 8)
  """
  import jax
  import numpy as np

  from nnx_zero1_plan.levers import with_offload
  from nnx_zero1_plan.planned_model import describe_tunix_or_own, on_devices
  from nnx_zero1_plan.steps import abstract_batch, placed_state, run_steps, step_jit
  from nnx_zero1_plan.targets import local_target

  target = local_target(request.topology, request.slices)
  planned = on_devices(describe_tunix_or_own(request, remat, estimate=False), target)
  source, mesh = planned.source_at(batch), planned.device_mesh
  assert mesh is not None  # on_devices laid it out
  lever = with_offload(lever_name, offload_fraction)
  try:
    abstract, state = placed_state(lever, lambda: source.build(None), request.optimizer, mesh)
    spec = abstract_batch(lever, mesh, batch, request.seq_len, request.ga)
    tokens = jax.device_put(np.random.default_rng(0).integers(0, 1000, spec.shape, dtype=np.int32),
                            spec.sharding)
    step = step_jit(abstract.graphdef, abstract.shardings, spec.sharding, lever, source.loss_fn, request.ga)
    with jax.set_mesh(mesh):
      compiled = step.lower(state, tokens).compile()
  except (jax.errors.JaxRuntimeError, ValueError) as e:  # the compiler's or the allocator's refusal
    return Measured(batch, None, error=error_line(e))
  _, runs = run_steps(compiled, state, tokens, warmup=WARMUP, timed=TIMED)
  return Measured(batch, runs.step_s, runs.peak_bytes, runs.error)


def main(argv: Sequence[str] | None = None) -> int:
  """A child: ``probe`` (the devices jax sees) or ``measure`` (a job on stdin), its answer on one line."""
  command = (sys.argv[1:] if argv is None else argv)[0]
  if command == "probe":
    import jax

    answer: Any = dataclasses.asdict(LocalDevices.of(jax.devices()))
  else:
    job = json.loads(sys.stdin.read())
    request = PlanRequest.from_json(job.pop("request"))
    answer = dataclasses.asdict(measure_one(request, job.pop("lever"), **job))
  say(answer)
  return 0


if __name__ == "__main__":
  sys.exit(main())
