"""What Zero-1 adds to a compiled train step, as a difference against nnx.Optimizer's HLO."""

import jax
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_zero1 import Zero1Optimizer
from nnx_zero1.testing import collectives
from tests.support.helpers import MLP, batches, train_step

MESH = jax.make_mesh((8,), ("data",))


def compiled_step_collectives(cls):
  x, y = batches(1)[0]
  with jax.set_mesh(MESH):
    model = MLP(nnx.Rngs(0))
    opt = cls(model, optax.adamw(1e-2), wrt=nnx.Param)
    shard = NamedSharding(MESH, P("data"))
    lowered = train_step.lower(model, opt, jax.device_put(x, shard), jax.device_put(y, shard))
    return model, opt, collectives(lowered.compile().as_text())


def test_zero1_adds_one_parameter_all_gather_and_nothing_else():
  _, _, plain = compiled_step_collectives(nnx.Optimizer)
  model, opt, zero1 = compiled_step_collectives(Zero1Optimizer)
  params = jax.tree.leaves(nnx.as_pure(nnx.state(model, nnx.Param)))
  split = [p for p, s in zip(params, opt.zero1_plan.zero1_param_shardings, strict=True) if any(s.spec)]
  assert len(split) == len(params) - 1  # only the 3-element bias cannot be split over 8

  # The gradient reduction is the data-parallel one nnx.Optimizer already has (on CPU,
  # all-reduce then a local slice); Zero-1 adds no reduction of its own.
  assert zero1["all-reduce"] == plain["all-reduce"]
  assert zero1["reduce-scatter"] == plain["reduce-scatter"] == {"count": 0, "bytes": 0}
  # Every split parameter is gathered back exactly once per step: one full copy of them.
  assert plain["all-gather"] == {"count": 0, "bytes": 0}
  assert zero1["all-gather"]["bytes"] == sum(p.nbytes for p in split)
  assert 1 <= zero1["all-gather"]["count"] <= len(split)


def test_an_async_all_reduce_on_gpu_counts_its_result_once():
  """XLA's GPU HLO writes an async all-reduce's shape as ((operands), result): the data once, not twice."""
  gpu = ("ENTRY %main {\n  %all-reduce-start.1 = ((f32[256]{0}), f32[256]{0}) all-reduce-start(%p), "
         "to_apply=%add\n}\n")
  combined = ("ENTRY %main {\n  %all-reduce-start.2 = ((f32[256]{0}, bf16[8]{0}), (f32[256]{0}, bf16[8]{0})) "
              "all-reduce-start(%p, %q), to_apply=%add\n}\n")
  cpu = "ENTRY %main {\n  %all-reduce-start.3 = f32[256]{0} all-reduce-start(%p), to_apply=%add\n}\n"
  assert collectives(gpu)["all-reduce"] == {"count": 1, "bytes": 1024}
  assert collectives(combined)["all-reduce"] == {"count": 1, "bytes": 1024 + 16}
  assert collectives(cpu)["all-reduce"] == {"count": 1, "bytes": 1024}



def test_sent_bytes_count_a_ring_over_each_collectives_own_group():
  """On a (replica 2, data 4) mesh, a sum over ``data`` is an all-reduce in groups of 4: a ring sends
  2(4-1)/4 of each device's block, not 2(8-1)/8 as one over all eight devices would."""
  import jax.numpy as jnp

  from nnx_zero1.testing import sent_bytes

  mesh = jax.make_mesh((2, 4), ("replica", "data"))
  x = jax.device_put(jnp.ones((8, 1024), jnp.float32), NamedSharding(mesh, P(("replica", "data"))))
  step = jax.shard_map(lambda b: jax.lax.psum(b, "data"), mesh=mesh, in_specs=P(("replica", "data")),
                       out_specs=P(("replica", "data")))
  hlo = jax.jit(step).lower(x).compile().as_text()
  shard = 1024 * 4  # one device's (1, 1024) float32 block
  assert sent_bytes(hlo)["all-reduce"] == {"count": 1, "bytes": shard * 2 * 3 // 4}
