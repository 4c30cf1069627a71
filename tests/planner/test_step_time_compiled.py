"""The step-time model on programs the TPU compiler compiled for a compile-only v6e:2x2 (CI lane 2): a loop's
trip count multiplies its body, a collective's time is its bytes over its rings on the 2x2's links, an
offload's copies are counted. The arithmetic on hand-written programs is ``test_step_time.py`` (lane 1)."""

import json
import subprocess
import sys

import pytest

from tests.support.compiled_plans import HAS_LIBTPU, planner_env

_TIMES = """
import dataclasses, json
from nnx_zero1_plan import compilers
compilers.start_cpu_jax()
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
from nnx_zero1.testing import host_transfers, sent_bytes
from nnx_zero1_plan.chips import CHIPS
from nnx_zero1_plan.networks import rings_of
from nnx_zero1_plan.step_time import program_time, rates_for
from nnx_zero1_plan.targets import make_target

mesh = Mesh(np.array(make_target("v6e:2x2").devices), ("data",), axis_types=(AxisType.Explicit,))
rates = rates_for(CHIPS["v6e"])

def spec(shape, p, dtype=jnp.bfloat16, kind=None):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, p, memory_kind=kind))

def layers(trips):
  def f(w, x):
    return jax.lax.scan(lambda h, _: (jnp.tanh(h @ w), None), x, None, length=trips)[0]
  return jax.jit(f).lower(spec((1024, 1024), P()), spec((8192, 1024), P("data"))).compile().as_text()

reduce = jax.jit(jax.shard_map(lambda g: jax.lax.psum(g, "data"), mesh=mesh, in_specs=P("data"),
                               out_specs=P()))
reduced = reduce.lower(spec((4 * 2**20,), P("data"), jnp.float32)).compile().as_text()
to_device = jax.jit(lambda s: jax.device_put(s, NamedSharding(mesh, P(), memory_kind="device")) * 2)
offloaded = to_device.lower(spec((2048, 2048), P(), jnp.float32, "pinned_host")).compile().as_text()
walk = program_time(reduced, rates)
host = program_time(offloaded, dataclasses.replace(rates, host_bytes_per_s=1e9))
print("RESULT " + json.dumps({
    "compute": {n: program_time(layers(n), rates).compute_s for n in (4, 8)},
    "collective_s": walk.collective_s, "exposed_s": walk.exposed_collective_s,
    "sent": sum(c["bytes"] for c in sent_bytes(reduced).values()),
    "link": CHIPS["v6e"].links.link_bytes_per_s,
    "rings": [rings_of(line) for line in reduced.splitlines() if " all-reduce(" in line],
    "host_s": host.host_s, "copied": sum(c["bytes"] for c in host_transfers(offloaded).values()),
    "untimed_host": program_time(offloaded, rates).host_s}))
"""


@pytest.fixture(scope="module")
def times() -> dict:
  proc = subprocess.run([sys.executable, "-c", _TIMES], env=planner_env(), capture_output=True, text=True,
                        timeout=400)
  assert proc.returncode == 0, proc.stderr[-3000:]
  (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
  return json.loads(line[len("RESULT "):])


@pytest.mark.skipif(not HAS_LIBTPU, reason="needs libtpu: ./planner[aot], Python >= 3.12 (CI lane 2)")
def test_a_loops_trip_count_multiplies_its_body(times):
  # Twice the trips, about twice the compute: the body's cycles counted per trip (once, it would be ~1x).
  ratio = times["compute"]["8"] / times["compute"]["4"]
  assert 1.8 < ratio < 2.05, ratio


@pytest.mark.skipif(not HAS_LIBTPU, reason="needs libtpu: ./planner[aot], Python >= 3.12 (CI lane 2)")
def test_a_collectives_time_is_its_bytes_over_its_rings_on_the_links_of_a_2x2(times):
  assert times["sent"] == 2 * 2**22 * 3 // 4  # 4 MiB of f32 per chip, all-reduced by a ring of 4
  (rings,) = times["rings"]  # as the compiler named them; a 2x2's four chips are a cycle of four links
  assert times["collective_s"] == pytest.approx(times["sent"] / (rings * times["link"]) + 2 * 3 * 1e-6)
  assert times["exposed_s"] == pytest.approx(times["collective_s"])  # nothing to overlap it with


@pytest.mark.skipif(not HAS_LIBTPU, reason="needs libtpu: ./planner[aot], Python >= 3.12 (CI lane 2)")
def test_an_offloads_copies_are_counted_and_timed_where_the_host_link_has_a_rate(times):
  assert times["copied"] == 2048 * 2048 * 4  # the state's bytes, brought in once
  assert times["host_s"] == pytest.approx(times["copied"] / 1e9)
  assert times["untimed_host"] is None  # the TPU table has no public host-link rate: counted, not timed
