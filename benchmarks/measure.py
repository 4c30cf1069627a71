"""Measuring a compiled training step: collectives, memory and time, as small pure functions.

The HLO parsing is :mod:`nnx_zero1.testing`'s, shared with the tests.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from nnx_zero1_plan import memory

__all__ = [
    "load_meter",
    "memory",
    "median_ms",
    "time_call",
]


def median_ms(seconds: list[float]) -> float:
  """The median of step times given in seconds, in milliseconds.

  Example::

    >>> median_ms([0.010, 0.030, 0.020])
    20.0
  """
  return round(statistics.median(seconds) * 1e3, 3)


def time_call(fn: Callable[[], Any]) -> tuple[Any, float]:
  """Runs ``fn()`` until its result is ready; returns (result, seconds).

  Example::

    >>> import jax.numpy as jnp
    >>> out, seconds = time_call(lambda: jnp.ones(2) + 1)
    >>> seconds >= 0
    True
  """
  import jax  # only here, so importing this module never initialises a backend

  start = time.perf_counter()
  out = jax.block_until_ready(fn())
  return out, time.perf_counter() - start


def _machine_busy_seconds() -> float | None:
  """CPU seconds every process on this machine has used since boot (Linux ``/proc/stat``); None elsewhere."""
  try:
    with open("/proc/stat") as f:
      fields = [int(v) for v in f.readline().split()[1:]]
  except (OSError, ValueError):
    return None
  user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
  return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def load_meter() -> Callable[[], float | None]:
  """Starts measuring how busy *other* processes keep the machine; call the result to read it.

  The reading is the share of all CPUs' time that processes other than this one
  used since the start (0.0: the machine was ours; 0.5: half its CPU time went
  elsewhere). Step times taken meanwhile are comparable only when it is small.

  Returns:
    A function returning that share, or None where it cannot be read (no ``/proc/stat``).

  Example::

    >>> read = load_meter()
    >>> share = read()
    >>> share is None or 0.0 <= share
    True
  """
  start, busy, own = time.perf_counter(), _machine_busy_seconds(), sum(os.times()[:2])

  def read() -> float | None:
    wall, now = time.perf_counter() - start, _machine_busy_seconds()
    if busy is None or now is None or wall <= 0:
      return None
    others = max(0.0, (now - busy) - (sum(os.times()[:2]) - own))
    return others / (wall * (os.cpu_count() or 1))

  return read

