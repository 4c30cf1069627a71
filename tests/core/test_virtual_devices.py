"""The suite's eight virtual CPU devices on a host with fewer cores: a long queue of eager ops with
collectives completes. XLA's CPU client gives each device's part of a program a thread from a pool sized by
the host's cores (at least the device count), and a queued part holds its thread while it waits, so on a
2-core host such a queue deadlocks unless the pool has threads to spare (conftest.py's ``PJRT_NPROC``). Run
in a child process with a time limit, so a regression fails here instead of hanging the suite."""

import os
import subprocess
import sys

QUEUE = """
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
x = jax.device_put(jnp.ones((8, 256)), NamedSharding(jax.make_mesh((8,), ("data",)), P("data")))
for _ in range(4):  # hundreds of eager all-reduces queued before one is waited for
  jax.block_until_ready([x.sum(axis=0) * i + x.sum() for i in range(300)])
print(jax.device_count(), "devices: done")
"""


def test_a_long_queue_of_eager_collectives_on_the_virtual_devices_completes():
  assert int(os.environ["PJRT_NPROC"]) >= 16  # what conftest.py sets, which the child inherits
  done = subprocess.run([sys.executable, "-c", QUEUE], capture_output=True, text=True, timeout=240,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert done.returncode == 0 and "8 devices: done" in done.stdout, done.stderr[-2000:]
