"""What crosses a pod's slow network (``nnx_zero1_plan.slow_network_bytes``), read off programs jax compiles
here on eight virtual CPU devices standing for two slices or nodes of four; the TPU compiler's multi-slice
transfers are ``test_pod_plans.py``'s (lane 2)."""

import re

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_zero1.testing import sent_bytes
from nnx_zero1_plan.chips import CHIPS
from nnx_zero1_plan.slow_network_bytes import across_bytes, dcn_bytes
from tests.support.docs_tables import table_under


def test_bytes_across_domains_follow_the_replica_groups_in_the_meshs_device_order():
  """On a (replica 2, data 4) mesh whose replica axis stands for two slices or nodes: a sum over data stays
  in each domain, a sum over replica crosses with every byte (pairs, one device per domain), and a sum
  over both crosses with (k-1)/(n-1) = 1/7 of its bytes, as hierarchical reduction sends them."""
  mesh = jax.make_mesh((2, 4), ("replica", "data"))
  domain_of = [d.id // 4 for d in mesh.devices.flat]  # the first four devices in domain 0, the rest in 1
  x = jax.device_put(jnp.ones((8, 1024), jnp.float32), NamedSharding(mesh, P(("replica", "data"))))

  def summed(axes):
    step = jax.shard_map(lambda b: jax.lax.psum(b, axes), mesh=mesh, in_specs=P(("replica", "data")),
                         out_specs=P(("replica", "data")))
    return across_bytes(jax.jit(step).lower(x).compile().as_text(), domain_of)["all-reduce"]

  within, across, both = summed("data"), summed("replica"), summed(("replica", "data"))
  shard = 1024 * 4  # one device's (1, 1024) float32 block
  assert within == {"count": 1, "bytes": shard * 2 * 3 // 4, "across_bytes": 0}
  assert across == {"count": 1, "bytes": shard * 2 * 1 // 2, "across_bytes": shard}
  assert both == {"count": 1, "bytes": shard * 2 * 7 // 8, "across_bytes": shard * 2 * 7 // 8 // 7}
  hlo = jax.jit(jax.shard_map(lambda b: jax.lax.psum(b, "data"), mesh=mesh, in_specs=P(("replica", "data")),
                              out_specs=P(("replica", "data")))).lower(x).compile().as_text()
  assert sent_bytes(hlo)["all-reduce"]["bytes"] == within["bytes"]


def test_megascale_transfers_count_a_ring_among_the_slices_per_loop_trip():
  """A two-slice TPU program's sends to the megascale runtime, by hand: each operand is what one device
  hands over; among k=4 slices a ring all-reduce sends 2(k-1)/k of it, an all-gather (k-1) times it (its
  shard of a k-times-larger result), a reduce-scatter (k-1)/k of it; the transfer in the loop body counts
  once per trip, its recv not at all."""
  hlo = """%body (p: (s32[], f32[256])) -> (s32[], f32[256]) {
  %g = (f32[256], token[]) send(%x), frontend_attributes={_xla_megascale_transfer_type="ALL_GATHER"}
  %r = (f32[256], token[]) recv(%t), frontend_attributes={_xla_megascale_transfer_type="ALL_GATHER"}
}
%cond (p: (s32[], f32[256])) -> pred[] {
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}
ENTRY %main (p: f32[1024]) -> f32[1024] {
  %a = (f32[1024], token[]) send(%p), frontend_attributes={_xla_megascale_transfer_type="ALL_REDUCE"}
  %s = (bf16[512], token[]) send(%p), frontend_attributes={_xla_megascale_transfer_type="REDUCE_SCATTER"}
  %w = (s32[], f32[256]) while(%init), condition=%cond, body=%body
}"""
  counted = dcn_bytes(hlo, 4)
  assert counted["all-reduce"] == {"count": 1, "bytes": 4096 * 2 * 3 // 4}
  assert counted["reduce-scatter"] == {"count": 1, "bytes": 1024 * 3 // 4}
  assert counted["all-gather"] == {"count": 3, "bytes": 3 * 1024 * 3}


_UNIT = {"Gbps": 1e9 / 8, "Gb/s": 1e9 / 8, "GBps": 1e9, "GB/s": 1e9}
_PLANNER_NAME = {"v5e": ["v5e"], "v6e": ["v6e"], "v5p": ["v5p"], "A100": ["a100-80g"],
                 "H100, H200": ["h100", "h200"], "B200": ["b200"]}


def _rate(words: str) -> tuple[str, float]:
  """A docs cell's network and its rate per chip and direction, in bytes per second: ``ICI 1,600 Gbps``,
  ``NVLink 450 GB/s each way``, ``DCN 25 Gbps per chip (2 x 100 Gbps per 8-chip host)`` (its parenthesis
  checked to give the same rate)."""
  m = re.match(r"(\S+) ([\d,]+) (Gbps|Gb/s|GBps|GB/s)", words)
  assert m, words
  rate = float(m[2].replace(",", "")) * _UNIT[m[3]]
  host = re.search(r"\((\d+) x (\d+) (Gbps) per (\d+)-chip host\)", words)
  if host:
    assert rate == int(host[1]) * int(host[2]) * _UNIT[host[3]] / int(host[4]), words
  both = re.search(r"\(([\d,]+) (GBps|GB/s) both", words)
  if both:
    assert rate == float(both[1].replace(",", "")) * _UNIT[both[2]] / 2, words
  return m[1], rate


def test_each_chips_link_rates_are_docs_pods_public_figures_in_words():
  """The rates the estimates divide by (``chips.CHIPS``, in bytes per second per direction) against
  docs/pods.md's table of the public figures as the vendors word them (Gbps, GB/s, per 8-chip host, both
  ways), converted here: the two are written apart and cannot drift apart unnoticed."""
  rows = table_under("docs/pods.md", "| chip | inside a slice or node |")
  assert {r[0] for r in rows} == set(_PLANNER_NAME)
  checked = set()
  for chips, fast, slow, _ in rows:
    for name in _PLANNER_NAME[chips]:
      links = CHIPS[name].links
      assert (links.fast, links.fast_bytes_per_s) == _rate(fast), name
      assert (links.slow, links.slow_bytes_per_s) == _rate(slow), name
      checked.add(name)
  assert checked == set(CHIPS)  # every chip the planner knows
