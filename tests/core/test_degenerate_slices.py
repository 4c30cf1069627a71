"""Leaves whose first divisible dimension would leave one row per device (issue 25).

A LoRA ``lora_b`` of shape ``(rank, out)`` with rank 4 on 4 replicas: splitting dimension 0
gives ``(1, out)`` slices. XLA then turns the transpose of the gradient (its dot produces it
as ``(out, rank)`` in memory) into a bitcast, the fused moment update loads its operands in
another order, and XLA's CPU backend contracts the other multiply of ``0.1*g + 0.9*mu`` into
the FMA: ``fma(mu, 0.9, round(0.1*g))`` instead of ``fma(g, 0.1, round(0.9*mu))``, a 1-ulp
difference from ``nnx.Optimizer``. The layout rule prefers a dimension that keeps more than
one row per device, so these leaves split their other dimension and stay bit-identical.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_zero1 import Zero1Optimizer, zero1_sharding

MESH = jax.make_mesh((4, 2), ("data", "tp"), axis_types=(AxisType.Auto,) * 2)
STEPS = 3


class Factor(nnx.Module):
  """One LoRA-like factor, zero-initialised as qwix initialises ``lora_b``."""

  def __init__(self, shape, sharding):
    value = jax.device_put(jnp.zeros(shape), NamedSharding(MESH, P(*sharding)))
    self.w = nnx.Param(value, sharding=sharding)


def train(cls, shape, sharding):
  with nnx.use_eager_sharding(False):
    model = Factor(shape, sharding)
  with jax.set_mesh(MESH):
    opt = cls(model, optax.adamw(1e-3), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, x, y):
      # The gradient of x @ w comes out of its dot transposed, as in a LoRA projection.
      grads = nnx.grad(lambda m: jnp.mean((x[:, : shape[0]] @ m.w[...] - y) ** 2))(model)
      opt.update(model, grads)

    for i in range(STEPS):
      batch = NamedSharding(MESH, P("data"))
      x = jax.device_put(jax.random.normal(jax.random.key(i + 1), (8, 64)), batch)
      y = jax.device_put(jax.random.normal(jax.random.key(i + 11), (8, shape[1])), batch)
      step(model, opt, x, y)
  return model, opt


# (shape, sharding, Zero-1 spec): before the rule's preference the first three split dimension
# 0 into one row per device and differed from nnx.Optimizer (141, 62 and 6 elements); the last
# keeps two rows per device on dimension 0 and was identical before too.
CASES = [
    ((4, 128), (None, "tp"), P(None, ("tp", "data"))),
    ((4, 64), (None, None), P(None, "data")),
    ((4, 12), (None, None), P(None, "data")),
    ((8, 128), (None, "tp"), P("data", "tp")),
]


@pytest.mark.parametrize("shape,sharding,spec", CASES, ids=[str(c[0]) for c in CASES])
def test_bit_identical_to_nnx_optimizer(shape, sharding, spec):
  plain, plain_opt = train(nnx.Optimizer, shape, sharding)
  zero1, opt = train(Zero1Optimizer, shape, sharding)
  np.testing.assert_array_equal(np.asarray(zero1.w[...]), np.asarray(plain.w[...]))
  assert zero1_sharding(shape, NamedSharding(MESH, P(*sharding))).spec == spec
  mu, plain_mu = (o.opt_state[0].mu["w"][...] for o in (opt, plain_opt))
  assert mu.sharding.spec == spec
  shard = mu.addressable_shards[0].data
  assert shard.nbytes * 4 == plain_mu.addressable_shards[0].data.nbytes  # a quarter per device
  assert min(shard.shape) > 1  # no dimension of one
