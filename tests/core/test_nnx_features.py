"""The ``nnx.Optimizer`` features of flax 0.12 under ``Zero1Optimizer``: ``wrt`` filters,
``graph=``, ``nnx.split``/``nnx.merge``, ``nnx.scan`` over steps, ``nnx.vmap`` over an
ensemble, ``nnx.clone`` and ``nnx.state`` filters. Each runs the same program with both
optimizers and compares every array exactly."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_zero1 import Zero1Optimizer, bytes_per_device
from tests.support.helpers import MLP, batches, loss_fn, pure

MESH = jax.make_mesh((8,), ("data",))
DATA = batches(2)


BATCH = P("data")


def _on_mesh(*arrays, spec=BATCH):
  return [jax.device_put(a, NamedSharding(MESH, spec)) for a in arrays]


def eager_steps(cls, wrt=nnx.Param, graph=None):
  model = MLP(nnx.Rngs(0))
  opt = cls(model, optax.adam(1e-2), wrt=wrt, graph=graph)
  for x, y in DATA:
    x, y = _on_mesh(x, y)
    opt.update(model, nnx.grad(loss_fn, argnums=nnx.DiffState(0, wrt))(model, x, y))
  return model, opt


def split_merge(cls):
  model = MLP(nnx.Rngs(0))
  graphdef, state = nnx.split((model, cls(model, optax.adam(1e-2), wrt=nnx.Param)))

  @jax.jit
  def step(state, x, y):
    model, opt = nnx.merge(graphdef, state)
    opt.update(model, nnx.grad(loss_fn)(model, x, y))
    return nnx.state((model, opt))

  for x, y in DATA:
    state = step(state, *_on_mesh(x, y))
  return nnx.merge(graphdef, state)


def scan(cls):
  model = MLP(nnx.Rngs(0))
  opt = cls(model, optax.adam(1e-2), wrt=nnx.Param)
  xs, ys = _on_mesh(np.stack([x for x, _ in DATA]), np.stack([y for _, y in DATA]), spec=P(None, "data"))

  @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=nnx.Carry)
  def steps(carry, x, y):
    model, opt = carry
    opt.update(model, nnx.grad(loss_fn)(model, x, y))
    return model, opt

  steps((model, opt), xs, ys)
  return model, opt


def vmap(cls):
  models = nnx.vmap(lambda key: MLP(nnx.Rngs(key)))(jax.random.split(jax.random.key(0), 2))
  opts = nnx.vmap(lambda m: cls(m, optax.adam(1e-2), wrt=nnx.Param))(models)

  @nnx.vmap(in_axes=(0, 0, None, None))
  def step(model, opt, x, y):
    opt.update(model, nnx.grad(loss_fn)(model, x, y))

  for x, y in DATA:
    step(models, opts, *_on_mesh(x, y))
  return models, opts


def clone(cls):
  model, opt = eager_steps(cls)
  copy = nnx.clone(opt)
  x, y = _on_mesh(*DATA[0])
  copy.update(model, nnx.grad(loss_fn)(model, x, y))
  return model, opt, copy


def state_filters(cls):
  opt = cls(MLP(nnx.Rngs(0)), optax.adam(1e-2), wrt=nnx.Param)
  return tuple(nnx.state(opt, kind) for kind in (nnx.OptState, nnx.OptArray, nnx.OptVariable))


CASES = {
    "wrt=All(Param, PathContains)": lambda cls: eager_steps(cls, nnx.All(nnx.Param, nnx.PathContains("l1"))),
    "wrt=Any(Param)": lambda cls: eager_steps(cls, nnx.Any(nnx.Param)),
    "graph=False": lambda cls: eager_steps(cls, graph=False),
    "graph=True": lambda cls: eager_steps(cls, graph=True),
    "nnx.split/nnx.merge under jax.jit": split_merge,
    "nnx.scan over steps": scan,
    "nnx.vmap over an ensemble": vmap,
    "nnx.clone": clone,
    "nnx.state filters": state_filters,
}


@pytest.mark.parametrize("name", list(CASES))
def test_feature_works_as_under_nnx_optimizer(name):
  results = []
  for cls in (nnx.Optimizer, Zero1Optimizer):
    with jax.set_mesh(MESH):
      results.append(CASES[name](cls))
  plain = [x for obj in results[0] for x in pure(obj)]
  zero1 = [x for obj in results[1] for x in pure(obj)]
  assert len(plain) == len(zero1) > 0
  for x, y in zip(plain, zero1, strict=True):
    assert x.shape == y.shape and x.dtype == y.dtype
    np.testing.assert_array_equal(x, y)
  opts = [o for o in results[1] if isinstance(o, Zero1Optimizer)]
  for opt in opts:  # and the moments are split: 1/8 of their bytes per device
    mu = jax.tree.leaves(nnx.as_pure(opt.opt_state[0].mu))[0]
    assert bytes_per_device(mu) * 8 == mu.nbytes, name


def test_vmapped_ensemble_splits_each_members_moments():
  with jax.set_mesh(MESH):
    _, opts = vmap(Zero1Optimizer)
  mu = opts.opt_state[0].mu["l1"]["kernel"][...]
  assert mu.shape == (2, 16, 128) and mu.sharding.spec == P(None, "data", None)
  assert bytes_per_device(mu) * 8 == mu.nbytes
  assert jnp.issubdtype(mu.dtype, jnp.floating)
