"""Gradient reduction on a pod (issue 54): each device's bytes on each network no more than
``nnx.Optimizer``'s, wherever Zero-1 splits the state.

8 virtual CPU devices as ``replica=2 x data=4``, ``replica`` standing for two TPU slices or GPU nodes
(devices 0-3 in one, 4-7 in the other). The batch is split over both axes. ``value_and_grad_accumulated``
reduces as the networks want it:

- Zero-1 over ``data`` (inside each slice): a reduce-scatter over ``data`` and an all-reduce of the
  slice over ``replica``, where before the batch's ``replica`` blocked the deferred reduction;
- Zero-1 over ``("replica", "data")``: a reduce-scatter over ``data``, then one over ``replica``,
  where one reduce-scatter over both is an all-reduce inside each TPU slice.

Bytes across are the planner's count, ``nnx_zero1_plan.slow_network_bytes.across_bytes``
(a group spanning k of the 2 domains sends (k-1)/(n-1) of its ring bytes across), inside the rest: what
crosses a pod's slow network is the planner's accounting, one home for it, and lane 1 installs the planner
with the optimizer.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_zero1 import Zero1Optimizer, bytes_per_device, value_and_grad_accumulated
from nnx_zero1._src.stages import scatter_by_stages
from nnx_zero1.testing import collectives, loop_collectives
from nnx_zero1_plan.slow_network_bytes import across_bytes
from tests.support.accumulate import VOCAB, token_batches
from tests.support.helpers import Decoder, assert_trees_equal, lm_loss

AXES = ("replica", "data")
DOMAIN_OF = [0, 0, 0, 0, 1, 1, 1, 1]  # the mesh's devices in order: replica 0, then replica 1
M = 2  # micro-batches
ROWS = 32


def pod_mesh(kind=AxisType.Explicit):
  return jax.make_mesh((2, 4), AXES, devices=jax.devices()[:8], axis_types=(kind, kind))


def build(cls, mesh, **kwargs):
  with jax.set_mesh(mesh):
    model = Decoder(nnx.Rngs(0), vocab=VOCAB)
    nnx.update(model, jax.device_put(nnx.state(model), NamedSharding(mesh, P())))
    return model, cls(model, optax.adamw(1e-2), wrt=nnx.Param, **kwargs)


def on_pod(batch, mesh):
  return jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P(AXES))), batch)


@nnx.jit(static_argnames=("axes",))
def accum_step(model, opt, batch, axes=None):
  loss, grads = value_and_grad_accumulated(lm_loss, model, batch, micro_batches=M, optimizer=opt,
                                           data_axis=axes)
  opt.update(model, grads)
  return loss


def params(model):
  return nnx.state(model, nnx.Param)


def networks(hlo):
  """``(inside, across)``: the bytes one device sends per step inside its domain and between domains."""
  counted = across_bytes(hlo, DOMAIN_OF)
  total = sum(c["bytes"] for c in counted.values())
  across = sum(c["across_bytes"] for c in counted.values())
  return total - across, across


def step_hlo(cls, mesh, axes=None, **kwargs):
  model, opt = build(cls, mesh, **kwargs)
  batch = on_pod(token_batches(1, rows=ROWS)[0], mesh)
  with jax.set_mesh(mesh):
    hlo = accum_step.lower(model, opt, batch, axes=axes).compile().as_text()
  return hlo, [x.nbytes for x in jax.tree.leaves(params(model))]


def assert_deferred(hlo, sizes):
  """The micro-batch loop holds no collective as large as the smallest gradient."""
  in_loop = loop_collectives(hlo)
  largest = max((v["bytes"] for v in in_loop.values()), default=0)
  assert largest < min(sizes), f"gradients reduced in the loop: {in_loop}"


@pytest.fixture(scope="module")
def baseline_hlo():
  """``nnx.Optimizer`` with the same deferred accumulation."""
  return step_hlo(nnx.Optimizer, pod_mesh())


def test_the_baseline_all_reduces_each_gradient_inside_then_across(baseline_hlo):
  """A plain optimizer's all-reduce over ``("replica", "data")``, as the TPU compiler lowers one: a
  reduce-scatter over ``data``, the quarter all-reduced over ``replica``, all-gathered over ``data``."""
  hlo, sizes = baseline_hlo
  assert_deferred(hlo, sizes)
  step = collectives(hlo)
  assert step["reduce-scatter"] == {"count": len(sizes), "bytes": sum(sizes) // 4}
  assert sum(sizes) // 4 <= step["all-reduce"]["bytes"] < sum(sizes) // 4 + 1024  # the quarters, the loss
  assert step["all-gather"] == {"count": len(sizes), "bytes": sum(sizes)}


@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto])
def test_zero1_inside_the_slice_reduce_scatters_there_and_all_reduces_the_slice_across(kind, baseline_hlo):
  """Zero-1 over ``data`` with the batch over ``("replica", "data")``: deferred (on an Explicit mesh the
  batch's axes are seen; on an Auto mesh they are named), one reduce-scatter per leaf over ``data`` (1/4
  of it per device), the quarter all-reduced over ``replica``, the parameters gathered over ``data``: no
  more bytes than the baseline's on either network."""
  mesh = pod_mesh(kind)
  hlo, sizes = step_hlo(Zero1Optimizer, mesh, axes=None if kind == AxisType.Explicit else AXES)
  assert_deferred(hlo, sizes)
  step = collectives(hlo)
  assert step["reduce-scatter"] == {"count": len(sizes), "bytes": sum(sizes) // 4}
  assert sum(sizes) // 4 <= step["all-reduce"]["bytes"] < sum(sizes) // 4 + 1024  # the quarters, the loss
  assert step["all-gather"] == {"count": len(sizes), "bytes": sum(sizes)}
  inside, across = networks(hlo)
  base_inside, base_across = networks(baseline_hlo[0])
  assert across <= base_across and inside <= base_inside, ((inside, across), (base_inside, base_across))


def test_zero1_over_both_axes_reduce_scatters_inside_then_across(baseline_hlo):
  """Zero-1 over ``("replica", "data")``: two reduce-scatters per leaf, over ``data`` (a quarter per
  device) and then over ``replica`` (an eighth), the parameters gathered over all 8: no more bytes than
  the baseline's on either network, and across it a half of the all-reduce's each way."""
  hlo, sizes = step_hlo(Zero1Optimizer, pod_mesh(), data_axis=AXES)
  assert_deferred(hlo, sizes)
  step = collectives(hlo)
  assert step["reduce-scatter"] == {"count": 2 * len(sizes), "bytes": sum(sizes) // 4 + sum(sizes) // 8}
  assert step["all-reduce"]["bytes"] < 1024  # the loss only
  inside, across = networks(hlo)
  base_inside, base_across = networks(baseline_hlo[0])
  assert across <= base_across and inside <= base_inside, ((inside, across), (base_inside, base_across))


@pytest.mark.parametrize("axes", [("data",), AXES], ids=["zero1", "zero1-pod"])
def test_pod_accumulation_trains_like_nnx_optimizer(axes):
  """Four adamw steps, value by value: ``nnx.Optimizer``'s accumulated gradients are summed in the order
  Zero-1's are (inside each slice first, then across), so the parameters, the moments and the losses are
  equal to the bit; each device holds 1/4 or 1/8 of the moments."""
  mesh = pod_mesh()
  batches = [on_pod(b, mesh) for b in token_batches(4, rows=ROWS, seed=5)]
  runs = []
  for cls, kwargs in ((nnx.Optimizer, {}), (Zero1Optimizer, {"data_axis": axes})):
    model, opt = build(cls, mesh, **kwargs)
    with jax.set_mesh(mesh):
      losses = [float(accum_step(model, opt, b)) for b in batches]
    runs.append((model, opt, losses))
  (plain, plain_opt, plain_losses), (model, opt, losses) = runs
  assert losses == plain_losses
  assert_trees_equal(params(model), params(plain))
  assert_trees_equal(opt.opt_state, plain_opt.opt_state)
  parts = 4 * len(axes)
  mu = lambda o: jax.tree.leaves(nnx.as_pure(o.opt_state[0].mu))
  for z, p in zip(mu(opt), mu(plain_opt), strict=True):
    assert bytes_per_device(z) * parts == bytes_per_device(p)
  for leaf in jax.tree.leaves(nnx.as_pure(params(model))):
    assert leaf.sharding.is_fully_replicated


def test_scatter_by_stages_gives_each_device_its_block_of_the_sum():
  """On every layout of two axes, on either dimension: each device's block is the one ``psum_scatter``
  over both gives it, and the sum (float64) of its block, within float32 rounding of another order."""
  mesh = pod_mesh()
  x = jax.device_put(jnp.asarray(np.random.default_rng(0).standard_normal((8, 16, 24)), jnp.float32),
                     NamedSharding(mesh, P(AXES)))
  exact = np.asarray(x, np.float64).sum(0)
  for over, dim in [(AXES, 0), (AXES, 1), (("data", "replica"), 1)]:
    spec = P(*[over if d == dim else None for d in range(2)])
    staged = jax.jit(jax.shard_map(lambda r, over=over, dim=dim: scatter_by_stages(r[0], over, dim),
                                   mesh=mesh, in_specs=P(AXES), out_specs=spec))(x)
    once = jax.jit(jax.shard_map(lambda r, over=over, dim=dim: jax.lax.psum_scatter(
        r[0], over, scatter_dimension=dim, tiled=True), mesh=mesh, in_specs=P(AXES), out_specs=spec))(x)
    assert staged.sharding.spec == spec
    np.testing.assert_allclose(np.asarray(staged), np.asarray(once), rtol=0, atol=2e-6)
    for shard in staged.addressable_shards:  # each device's own block, where the layout puts it
      np.testing.assert_allclose(np.asarray(shard.data), exact[shard.index], rtol=0, atol=2e-6)
