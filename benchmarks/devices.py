"""Getting enough (virtual CPU) devices for the bench, before or after jax has started.

``python -m benchmarks.bench`` imports the bench's modules, and with them
``nnx_zero1`` and jax, before ``main`` runs, so setting ``XLA_FLAGS`` in
``main`` would be too late for the flag's usual place. But importing jax
does not start a backend: the device count is fixed only when the first
device or array is made. So the bench asks for its devices through jax's
``jax_num_cpu_devices`` option as the very first jax call. If the backend has
already started (``main()`` called from a process that used jax) with too few
devices, the bench runs itself again in a fresh interpreter with
``XLA_FLAGS=--xla_force_host_platform_device_count=N``.
"""

from __future__ import annotations

import os
import re
import sys

__all__ = [
    "CHILD_ENV", "cpu_async_dispatch", "flag_device_count", "request_cpu_devices", "rerun_command",
    "synchronous_cpu_dispatch",
]

_ASYNC_DISPATCH = "jax_cpu_enable_async_dispatch"

CHILD_ENV = "NNX_ZERO1_BENCH_RERUN"
_COUNT_FLAG = "--xla_force_host_platform_device_count"


def flag_device_count(xla_flags: str) -> int:
  """The virtual CPU device count ``XLA_FLAGS`` asks for (0 when it does not).

  Example::

    >>> flag_device_count("--xla_force_host_platform_device_count=8 --foo")
    8
    >>> flag_device_count("")
    0
  """
  found = re.findall(_COUNT_FLAG + r"=(\d+)", xla_flags)
  return int(found[-1]) if found else 0


def request_cpu_devices(n: int) -> bool:
  """Makes this process have at least ``n`` CPU devices if it still can; True when it will.

  Before jax's backend starts this always succeeds (``jax_num_cpu_devices``,
  unless ``XLA_FLAGS`` already asks for enough). Afterwards it only reports
  whether the running backend has ``n`` devices. On a GPU/TPU host the CPU
  count is irrelevant: the accelerator's devices are used, and ``run`` refuses
  a dp larger than their number.

  Example::

    >>> import jax
    >>> request_cpu_devices(1)
    True
  """
  import jax

  if flag_device_count(os.environ.get("XLA_FLAGS", "")) >= n:
    return True
  try:
    jax.config.update("jax_num_cpu_devices", n)
    return True
  except RuntimeError:  # the backend has started; its device count is fixed now
    return jax.device_count() >= n


def rerun_command(n: int, argv: list[str]) -> tuple[list[str], dict[str, str]]:
  """The command and environment that run the bench again with ``n`` virtual CPU devices.

  Example::

    >>> cmd, env = rerun_command(8, ["--quick"])
    >>> cmd[1:], flag_device_count(env["XLA_FLAGS"]), env[CHILD_ENV]
    (['-m', 'benchmarks.bench', '--quick'], 8, '1')
  """
  env = dict(os.environ)
  kept = re.sub(_COUNT_FLAG + r"=\d+", "", env.get("XLA_FLAGS", "")).strip()
  env["XLA_FLAGS"] = f"{kept} {_COUNT_FLAG}={n}".strip()
  env[CHILD_ENV] = "1"
  return [sys.executable, "-m", "benchmarks.bench", *argv], env


def synchronous_cpu_dispatch() -> bool:
  """Turns jax's asynchronous CPU dispatch off, as the test suite does; True when it is off.

  Virtual CPU devices share one thread pool of the host's size. With asynchronous
  dispatch the next program's launches can take the pool threads that the running
  program's collective waits for: a deadlock (or XLA's abort) on a busy machine
  with few cores. Synchronous dispatch launches one program at a time; the bench
  times each step until its result is ready anyway, so its timings are unchanged.

  Returns:
    Whether dispatch is synchronous now (False only where the option is gone).

  Example::

    >>> synchronous_cpu_dispatch()
    True
  """
  import jax

  if _ASYNC_DISPATCH not in jax.config.values:  # a jax without the option has nothing to turn off
    return False
  jax.config.update(_ASYNC_DISPATCH, False)
  return not cpu_async_dispatch()


def cpu_async_dispatch() -> bool:
  """Whether this process dispatches CPU programs asynchronously (jax's default).

  Example::

    >>> synchronous_cpu_dispatch() and not cpu_async_dispatch()
    True
  """
  import jax

  return bool(jax.config.values.get(_ASYNC_DISPATCH, False))
