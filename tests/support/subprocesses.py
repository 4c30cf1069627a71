"""Running ``examples/train_with_checkpoints.py`` in child processes: with timeouts,
and children that are always killed, whatever the test does."""

from __future__ import annotations

import contextlib
import fcntl
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_with_checkpoints.py"
TIMEOUT = 180  # seconds for one child; the machine may be shared and slow


# The coordinators' ports: below Linux's ephemeral range (32768-60999 by default), so no port the OS hands
# out for another socket is one of these; a test claims one with an flock on a file of its own, which the
# kernel releases when the test's process ends, however it ends (a lock that cannot go stale).
PORTS = range(23456, 23456 + 256)


def _bindable(port: int) -> bool:
  with socket.socket() as s:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
      s.bind(("127.0.0.1", port))
    except OSError:
      return False
  return True


@contextlib.contextmanager
def reserved_port() -> Iterator[int]:
  """A localhost port for a coordinator, held for this test until the block ends.

  A port picked by binding port 0 and closing the socket is free only until another process binds it:
  two pytest-xdist workers could each start a coordinator on it. Here no other test process can claim the
  port while the block runs, and none of the OS's ephemeral ports is one of :data:`PORTS`.

  Raises:
    RuntimeError: every port of :data:`PORTS` is claimed or bound.
  """
  for port in PORTS:
    lock = open(Path(tempfile.gettempdir()) / f"nnx_zero1_tests_port_{port}.lock", "w")
    try:
      fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      lock.close()
      continue
    try:
      if _bindable(port):
        yield port
        return
    finally:
      lock.close()
  raise RuntimeError(f"no free port among {PORTS.start}..{PORTS.stop - 1}")


class Child:
  """One run of the training script; its stdout lines arrive on a queue as they are printed."""

  def __init__(self, *args: str):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the script sets its own
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    self.proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), *args], env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    self.lines: list[str] = []
    self._queue: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=self._read, daemon=True).start()

  def _read(self) -> None:
    for line in self.proc.stdout:
      self._queue.put(line.rstrip("\n"))
    self._queue.put(None)

  def wait_for_line(self, text: str, timeout: float = TIMEOUT) -> None:
    """Blocks until a printed line starts with ``text``."""
    deadline = time.monotonic() + timeout
    while True:
      line = self._queue.get(timeout=max(deadline - time.monotonic(), 0.01))
      if line is None:
        raise AssertionError(f"child ended before printing {text!r}:\n" + "\n".join(self.lines[-40:]))
      self.lines.append(line)
      if line.startswith(text):
        return

  def finish(self, timeout: float = TIMEOUT) -> str:
    """Waits for a clean exit; returns everything it printed."""
    self.proc.wait(timeout=timeout)
    with contextlib.suppress(queue.Empty):
      while (line := self._queue.get(timeout=5)) is not None:
        self.lines.append(line)
    output = "\n".join(self.lines)
    assert self.proc.returncode == 0, output[-4000:]
    return output

  def kill(self) -> None:
    if self.proc.poll() is None:
      self.proc.send_signal(signal.SIGKILL)
      self.proc.wait(timeout=30)


@contextlib.contextmanager
def children():
  """Collects started children and SIGKILLs any still running on the way out."""
  started: list[Child] = []

  def start(*args: str) -> Child:
    started.append(Child(*args))
    return started[-1]

  try:
    yield start
  finally:
    for child in started:
      child.kill()


def load(path) -> dict[str, np.ndarray]:
  with np.load(path) as data:
    return {k: data[k] for k in data.files}
