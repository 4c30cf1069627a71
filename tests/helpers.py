"""Shared test fixtures: a small MLP, deterministic data, and a jitted train loop
that runs the plain ``nnx.Optimizer`` and ``Zero1Optimizer`` the same way."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


class MLP(nnx.Module):
  """16 -> 128 -> 128 -> 3. The last bias (3) divides by no data size > 1 and stays replicated.

  Every split leaf keeps >= 16 elements per device at dp=8: on CPU, XLA contracts
  multiply-adds into FMAs in vectorised loop bodies but may round a remainder shorter
  than the SIMD width differently, which would break bit-identity for reasons that
  have nothing to do with Zero-1 (see README, "Limitations").
  """

  def __init__(self, rngs: nnx.Rngs, kernel_sharding=None):
    init = nnx.initializers.lecun_normal()
    if kernel_sharding is not None:
      init = nnx.with_partitioning(init, kernel_sharding)
    self.l1 = nnx.Linear(16, 128, kernel_init=init, rngs=rngs)
    self.l2 = nnx.Linear(128, 128, rngs=rngs)
    self.l3 = nnx.Linear(128, 3, rngs=rngs)

  def __call__(self, x):
    return self.l3(jax.nn.gelu(self.l2(jax.nn.gelu(self.l1(x)))))


def batches(n_steps: int, batch: int = 16, seed: int = 0):
  """Deterministic (x, y) batches."""
  rng = np.random.default_rng(seed)
  return [
      (rng.standard_normal((batch, 16), dtype=np.float32), rng.standard_normal((batch, 3), dtype=np.float32))
      for _ in range(n_steps)
  ]


def loss_fn(model, x, y):
  return jnp.mean((model(x) - y) ** 2)


@nnx.jit
def train_step(model, opt, x, y):
  loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
  opt.update(model, grads)
  return loss


def train(model, opt, mesh, data, step=train_step, data_axis="data"):
  """Runs ``step`` over ``data`` with the batch sharded over ``data_axis``; returns the losses."""
  shard = NamedSharding(mesh, P(data_axis))
  losses = []
  for x, y in data:
    losses.append(step(model, opt, jax.device_put(x, shard), jax.device_put(y, shard)))
  return np.array(losses)


def pure(tree):
  """The arrays of an nnx state or module, as a flat list of numpy arrays."""
  if isinstance(tree, nnx.Module | nnx.Optimizer):
    tree = nnx.state(tree)
  return [np.asarray(x) for x in jax.tree.leaves(nnx.as_pure(tree))]


def assert_trees_equal(a, b):
  """Bit-identical, leaf by leaf."""
  la, lb = pure(a), pure(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb, strict=True):
    np.testing.assert_array_equal(x, y)


def assert_trees_close(a, b, atol=1e-6, rtol=1e-6):
  la, lb = pure(a), pure(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb, strict=True):
    np.testing.assert_allclose(x, y, atol=atol, rtol=rtol)


def shardings(tree):
  """The sharding of every array leaf of an nnx state or module."""
  if isinstance(tree, nnx.Module | nnx.Optimizer):
    tree = nnx.state(tree)
  return [x.sharding for x in jax.tree.leaves(nnx.as_pure(tree))]


def snapshot(*objs):
  """Values and shardings of every array of some modules / optimizers, to check nothing changed."""
  return [(np.asarray(x), x.sharding) for obj in objs for x in jax.tree.leaves(nnx.as_pure(nnx.state(obj)))]


def assert_unchanged(before, *objs):
  """Every array equals its ``snapshot`` value (NaN-equal) and has the same sharding."""
  after = snapshot(*objs)
  assert len(after) == len(before)
  for (a, sa), (b, sb) in zip(before, after, strict=True):
    np.testing.assert_array_equal(a, b)
    assert sa == sb, (sa, sb)
