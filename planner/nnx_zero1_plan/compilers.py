"""The TPU and GPU compilers in a CPU-only process, for ahead-of-time compiles."""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import sys
from collections.abc import Iterator, Mapping
from typing import TextIO

LOCKFILE = "/tmp/libtpu_lockfile"

# The TPU host libtpu is told it runs on, with one worker (TPU_WORKER_HOSTNAMES=localhost): without them it
# prints six lines about the host metadata it could not read. Not the compile target: plans for v4, v5e and
# v6e topologies were measured byte-identical whatever this names.
HOST_ACCELERATOR_TYPE = "v6e-4"

# Compile only: jax stays on the CPU backend, libtpu skips the cloud metadata server it would ask for a
# TPU's identity and loads although another process (a second compile) has it loaded, the CUDA plugin looks
# for no GPU, and libtpu writes no log files (by default it fills /tmp/tpu_logs with one set per process).
ENV = {"JAX_PLATFORMS": "cpu", "TPU_SKIP_MDS_QUERY": "1", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
       "CUDA_VISIBLE_DEVICES": "-1", "TPU_WORKER_HOSTNAMES": "localhost",
       "TPU_ACCELERATOR_TYPE": HOST_ACCELERATOR_TYPE, "TPU_MIN_LOG_LEVEL": "3"}
# The settings of ENV a caller's own value replaces (how much libtpu logs). The others win: a planning process
# that saw the caller's GPUs or TPUs would start on them or stop at a lockfile.
CALLERS_OWN = frozenset({"TPU_MIN_LOG_LEVEL"})


class AotUnavailable(RuntimeError):
  """The ahead-of-time mode cannot run here; the message says what to install."""


def install_hint(jax_version: str) -> str:
  """What to install for ahead-of-time TPU compiles next to this jax."""
  return f'pip install "./planner[aot]" (or: pip install "jax[tpu]=={jax_version}"; Python >= 3.12)'


def gpu_install_hint(jax_version: str) -> str:
  """What to install for deviceless NVIDIA GPU compiles next to this jax."""
  return (f"pip install --no-deps jax-cuda13-plugin=={jax_version} jax-cuda13-pjrt=={jax_version} "
          "(Python >= 3.12)")


# Each compiler by its package: its module, what it compiles for, and its install line.
_COMPILERS = {
    "libtpu": ("libtpu", "TPUs needs the TPU compiler (libtpu)", install_hint),
    "jax-cuda13-plugin": ("jax_cuda13_plugin", "NVIDIA GPUs needs XLA's GPU compiler", gpu_install_hint)}


def require(package: str) -> str:
  """The version of the compiler ``package`` (one of ``_COMPILERS``); :class:`AotUnavailable`, naming the
  install command, where it is not installed."""
  # jax's version from its metadata: this module runs in the caller's process too, which never imports jax.
  module, what, hint = _COMPILERS[package]
  if importlib.util.find_spec(module) is None:
    raise AotUnavailable(f"compiling for {what}, which is not installed: "
                         f"{hint(importlib.metadata.version('jax'))}")
  return importlib.metadata.version(package)


def require_libtpu() -> str:
  """libtpu's version (``'0.0.50.1'`` with jax 0.12.0.1); :class:`AotUnavailable`, naming the install
  command, where it is not installed."""
  return require("libtpu")


def _has_open(pid: str, path: str) -> bool:
  fd_dir = f"/proc/{pid}/fd"
  with contextlib.suppress(OSError):
    for name in os.listdir(fd_dir):
      with contextlib.suppress(OSError):
        if os.readlink(os.path.join(fd_dir, name)) == path:
          return True
  return False


def _locking_pids(inode: int) -> list[int]:
  """Processes holding a POSIX or flock lock on the file with this inode (``/proc/locks``)."""
  pids = []
  with contextlib.suppress(OSError), open("/proc/locks") as locks:
    for fields in map(str.split, locks):
      # "1: FLOCK  ADVISORY  WRITE 4242 fd:01:1234 0 EOF": pid, then major:minor:inode.
      idx = next((i for i, f in enumerate(fields) if f.count(":") == 2), None)
      if idx is not None and fields[idx].rsplit(":", 1)[1] == str(inode):
        pids.append(int(fields[idx - 1]))
  return pids


def lockfile_holders(path: str = LOCKFILE) -> list[int]:
  """Live processes that have ``path`` open or locked (empty when none, or no such file)."""
  try:
    inode = os.stat(path).st_ino
  except FileNotFoundError:
    return []
  real = os.path.realpath(path)
  opened = (int(pid) for pid in os.listdir("/proc") if pid.isdigit() and _has_open(pid, real))
  holders = {*_locking_pids(inode), *opened}
  return sorted(p for p in holders if os.path.exists(f"/proc/{p}"))


def clear_stale_lockfile(path: str = LOCKFILE) -> bool:
  """Removes libtpu's lockfile when no live process holds it; True when one was removed. A process killed
  while libtpu was loaded leaves the file behind, and the next process that loads libtpu aborts."""
  if not os.path.exists(path) or lockfile_holders(path):
    return False
  try:
    os.remove(path)
  except FileNotFoundError:  # another process removed it first
    return False
  return True


def planning_environment(environ: Mapping[str, str], lockfile: str = LOCKFILE) -> dict[str, str]:
  """A planning process's environment, before it loads a compiler: ``environ`` under :data:`ENV`, but for
  the caller's own :data:`CALLERS_OWN` values; libtpu's ``lockfile`` is removed when stale (one a live
  process holds, a trainer's perhaps, stays: libtpu loads beside it)."""
  clear_stale_lockfile(lockfile)
  return {**environ, **ENV, **{key: environ[key] for key in CALLERS_OWN if key in environ}}


def start_cpu_jax() -> None:
  """Makes this process a planning process (:func:`planning_environment`) and keeps jax on its CPU backend;
  call before jax starts (a ``RuntimeError`` where another backend has started already).

  Example::

    start_cpu_jax()
    jax.experimental.topologies.get_topology_desc("v6e:2x2", "tpu")
  """
  os.environ.update(planning_environment(os.environ))
  keep_jax_on_cpu()


def keep_jax_on_cpu() -> None:
  """Keeps jax on its CPU backend (nothing runs; the compilers only compile); a ``RuntimeError`` where another
  backend has started already."""
  import jax

  try:
    jax.config.update("jax_platforms", "cpu")
  except RuntimeError:  # a backend has started already: it must be the CPU one
    if jax.default_backend() != "cpu":
      raise


@contextlib.contextmanager
def compiler_messages_to(path: str) -> Iterator[TextIO]:
  """The compilers' own messages into the file at ``path`` for the block, not onto the terminal: XLA's
  compilers log through C++ onto file descriptor 2, which no Python setting reaches, so for the block that
  descriptor is the file, and the stream yielded writes to the terminal's stderr, for the planner's lines."""
  sys.stderr.flush()
  terminal = os.dup(2)
  try:
    with open(path, "a") as log:
      os.dup2(log.fileno(), 2)
      with os.fdopen(os.dup(terminal), "w", buffering=1) as stream:
        yield stream
  finally:
    sys.stderr.flush()
    os.dup2(terminal, 2)
    os.close(terminal)
