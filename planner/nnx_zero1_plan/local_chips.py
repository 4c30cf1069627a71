"""Whether this machine's devices are a target's chips: the platform, kind and count jax reports, against the
topology's. Pure, so both the caller's process (which never imports jax) and the planning process ask it."""

from __future__ import annotations

import dataclasses
import glob
import math
from collections.abc import Sequence
from typing import Any

from nnx_zero1_plan.chips import chip_of
from nnx_zero1_plan.inputs import ONE_SLICE, Backend, Topology


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


def chips_may_be_here(backend: Backend) -> bool:
  """Whether this machine has the device files of ``backend``'s chips: only then is jax asked, as starting its
  TPU backend where there is no TPU takes time."""
  return any(glob.glob(p) for p in backend.device_files)


def not_the_target(local: LocalDevices | None, topology: str, parsed: Topology,
                   slices: int = ONE_SLICE) -> str | None:
  """Why ``local`` are not ``topology``'s chips (``parsed``: it parsed, a request's ``topology_ref``):
  platform, kind and count, in words; None where they are."""
  platform, chip, shape = parsed
  want = math.prod(shape) * (slices if parsed.backend.domain == "slices" else 1)
  if local is None:
    return f"jax sees no {platform.upper()} devices on this machine, not {topology}'s {want} {chip}"
  if local.platform == platform and chip_of(local.device_kind) == chip and local.count == want:
    return None
  return (f"this machine's devices are {local.count} x {local.device_kind!r} ({local.platform}), not "
          f"{topology}'s {want} {chip}")
