"""Loading the TPU compiler (libtpu) in a CPU-only process, for ahead-of-time compiles.

Two things stand between ``pip install ".[aot]"`` and a compile:
libtpu must be installed (the ``aot`` extra brings the one that matches jax),
and a process killed while libtpu was loaded leaves its lockfile behind, which
makes the next process that loads libtpu abort. A lockfile no live process has
open is stale and is removed before libtpu loads.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os

__all__ = ["LOCKFILE", "ENV", "AotUnavailable", "install_hint", "require_libtpu", "lockfile_holders",
           "clear_stale_lockfile", "prepare_environment"]

LOCKFILE = "/tmp/libtpu_lockfile"

# Compile only: jax stays on the CPU backend, libtpu skips the cloud metadata server it would ask
# for a TPU's identity, and loads although another process (a second compile) has it loaded.
ENV = {"JAX_PLATFORMS": "cpu", "TPU_SKIP_MDS_QUERY": "1", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


class AotUnavailable(RuntimeError):
  """The ahead-of-time mode cannot run here; the message says what to install."""


def install_hint(jax_version: str) -> str:
  """What to install for ahead-of-time TPU compiles next to this jax.

  Example::

    >>> install_hint("0.12.0.1")
    'pip install ".[aot]" (or: pip install "jax[tpu]==0.12.0.1"; Python >= 3.12)'
  """
  return f'pip install ".[aot]" (or: pip install "jax[tpu]=={jax_version}"; Python >= 3.12)'


def require_libtpu() -> str:
  """libtpu's version; raises ``AotUnavailable`` naming the install command when it is missing.

  Example::

    version = require_libtpu()  # '0.0.50.1' with jax 0.12.0.1

  Raises:
    AotUnavailable: libtpu is not installed in this environment.
  """
  import jax

  if importlib.util.find_spec("libtpu") is None:
    raise AotUnavailable(f"--aot needs the TPU compiler (libtpu), which is not installed: "
                         f"{install_hint(jax.__version__)}")
  return importlib.metadata.version("libtpu")


def _open_fd_targets(pid: str) -> list[str]:
  """The files a process has open; empty when it is gone or not ours to read."""
  fd_dir = f"/proc/{pid}/fd"
  try:
    names = os.listdir(fd_dir)
  except OSError:
    return []
  targets = []
  for name in names:
    try:
      targets.append(os.readlink(os.path.join(fd_dir, name)))
    except OSError:
      continue
  return targets


def _locking_pids(inode: int) -> list[int]:
  """Processes holding a POSIX or flock lock on the file with this inode (``/proc/locks``)."""
  try:
    with open("/proc/locks") as f:
      lines = f.read().splitlines()
  except OSError:
    return []
  pids = []
  for line in lines:
    fields = line.split()
    # "1: FLOCK  ADVISORY  WRITE 4242 fd:01:1234 0 EOF": pid, then major:minor:inode.
    idx = next((i for i, f in enumerate(fields) if f.count(":") == 2), None)
    if idx is not None and fields[idx].rsplit(":", 1)[1] == str(inode):
      pids.append(int(fields[idx - 1]))
  return pids


def lockfile_holders(path: str = LOCKFILE) -> list[int]:
  """Live processes that have ``path`` open or locked (empty when none, or no such file).

  Example::

    >>> lockfile_holders("/nonexistent/libtpu_lockfile")
    []
  """
  try:
    inode = os.stat(path).st_ino
  except FileNotFoundError:
    return []
  holders = set(_locking_pids(inode))
  real = os.path.realpath(path)
  for pid in filter(str.isdigit, os.listdir("/proc")):
    if real in _open_fd_targets(pid):
      holders.add(int(pid))
  return sorted(p for p in holders if os.path.exists(f"/proc/{p}"))


def clear_stale_lockfile(path: str = LOCKFILE) -> bool:
  """Removes libtpu's lockfile when no live process holds it; True when one was removed.

  A process killed while libtpu was loaded leaves the file behind and the next
  process that loads libtpu aborts ("Internal error when accessing libtpu
  multi-process lockfile"). A lockfile a live process holds is left alone.

  Example::

    >>> clear_stale_lockfile("/nonexistent/libtpu_lockfile")
    False
  """
  if not os.path.exists(path) or lockfile_holders(path):
    return False
  try:
    os.remove(path)
  except FileNotFoundError:  # another process removed it first
    return False
  return True


def prepare_environment() -> None:
  """Sets :data:`ENV` (keeping values already set) and clears a stale lockfile; call before jax starts.

  Example::

    prepare_environment()
    import jax; jax.experimental.topologies.get_topology_desc("v6e:2x2", "tpu")
  """
  for key, value in ENV.items():
    os.environ.setdefault(key, value)
  clear_stale_lockfile()
