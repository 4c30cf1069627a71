"""``Zero1ModelAndOptimizer`` and ``zero1_optimizers()`` routing flax's ``nnx.ModelAndOptimizer``.

The first tests replay what flax's own ``tests/nnx/optimizer_test.py`` does with
``ModelAndOptimizer`` (train with ``update(grads)`` eagerly, under ``nnx.jit`` and
under ``jax.jit`` of split/merge; lbfgs with its line-search arguments; a
``TrainState`` subclass with metrics), with only the scope added around them.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from nnx_zero1 import Zero1Error, Zero1ModelAndOptimizer, Zero1Optimizer, bytes_per_device, zero1_optimizers
from tests.support.helpers import assert_trees_equal, assert_unchanged, snapshot

N = 4
MESH = jax.make_mesh((N,), ("data",), devices=jax.devices()[:N])


class TwoLayers(nnx.Module):
  def __init__(self, din, dout, rngs):
    self.first = nnx.Linear(din, 3, rngs=rngs)
    self.second = nnx.Linear(3, dout, rngs=rngs)

  def __call__(self, x):
    return self.second(self.first(x))


def _data():
  return jax.random.normal(jax.random.key(0), (1, 2)), jnp.ones((1, 4))


def _mse(model, x, y):
  return ((model(x) - y) ** 2).mean()


def _train_once(jit: str, state, x, y, **extra):
  """One step of ``state`` (a ModelAndOptimizer) the way flax's tests write it; returns the state."""
  if jit == "jax.jit":
    def step(graphdef, pure, x, y):
      state = nnx.merge(graphdef, pure)
      graphdef_m, params = nnx.split(state.model)
      loss = lambda p: _mse(nnx.merge(graphdef_m, p), x, y)
      grads = jax.grad(loss)(params)
      state.update(grads, **({k: f(loss, grads) for k, f in extra.items()}))
      return nnx.split(state)

    return nnx.merge(*jax.jit(step)(*nnx.split(state), x, y))

  def step(state, x, y):
    graphdef_m = nnx.graphdef(state.model)
    loss = lambda p: _mse(nnx.merge(graphdef_m, p), x, y)
    grads = nnx.grad(_mse)(state.model, x, y)
    state.update(grads, **({k: f(loss, grads) for k, f in extra.items()}))

  (nnx.jit(step) if jit == "nnx.jit" else step)(state, x, y)
  return state


JITS = ["eager", "nnx.jit", "jax.jit"]
MODELS = [lambda: nnx.Linear(2, 4, rngs=nnx.Rngs(0)), lambda: TwoLayers(2, 4, nnx.Rngs(0))]


@pytest.mark.parametrize("make_model", MODELS, ids=["Linear", "TwoLayers"])
@pytest.mark.parametrize("jit", JITS)
@pytest.mark.parametrize("tx", [optax.sgd, optax.adam], ids=["sgd", "adam"])
def test_flax_jit_under_the_scope(make_model, jit, tx):
  x, y = _data()
  with zero1_optimizers() as built:
    state = nnx.ModelAndOptimizer(make_model(), tx(1e-3))
  assert type(state) is Zero1ModelAndOptimizer and built == [state]
  before = _mse(state.model, x, y)
  state = _train_once(jit, state, x, y)
  assert _mse(state.model, x, y) < before


@pytest.mark.parametrize("make_model", MODELS, ids=["Linear", "TwoLayers"])
@pytest.mark.parametrize("jit", JITS)
def test_flax_linesearch_under_the_scope(make_model, jit):
  x, y = _data()
  with zero1_optimizers():
    state = nnx.ModelAndOptimizer(make_model(), optax.lbfgs(1e-3))
  before = _mse(state.model, x, y)
  extra = {"grad": lambda loss, g: g, "value": lambda loss, g: before, "value_fn": lambda loss, g: loss}
  state = _train_once(jit, state, x, y, **extra)
  assert _mse(state.model, x, y) < before


def test_flax_train_state_subclass_under_the_scope():
  class TrainState(nnx.ModelAndOptimizer):
    def __init__(self, model, tx, metrics):
      self.metrics = metrics
      super().__init__(model, tx)

    def update(self, *, grads, **updates):  # type: ignore[override]
      self.metrics.update(**updates)
      super().update(grads)

  x, y = _data()
  with zero1_optimizers():
    state = TrainState(TwoLayers(2, 4, nnx.Rngs(0)), optax.adam(1e-3), nnx.metrics.Average())
  grads = nnx.grad(_mse)(state.model, x, y)
  state.update(grads=grads, values=_mse(state.model, x, y))
  first = state.metrics.compute()
  state.update(grads=grads, values=_mse(state.model, x, y))
  assert state.metrics.compute() < first


def _replicated_model():
  model = nnx.Linear(8, 16, rngs=nnx.Rngs(0))
  nnx.update(model, jax.device_put(nnx.state(model), jax.NamedSharding(MESH, jax.P())))
  return model


def test_bit_identical_to_model_and_optimizer_with_moments_split():
  x = jnp.arange(32, dtype=jnp.float32).reshape(4, 8) / 32
  states = []
  with jax.set_mesh(MESH):
    for scoped in (False, True):
      if scoped:
        with zero1_optimizers():
          state = nnx.ModelAndOptimizer(_replicated_model(), optax.adamw(1e-2), wrt=nnx.Param)
      else:
        state = nnx.ModelAndOptimizer(_replicated_model(), optax.adamw(1e-2), wrt=nnx.Param)
      for _ in range(3):
        state.update(nnx.grad(lambda m: jnp.sum(m(x) ** 2))(state.model))
      states.append(state)
  plain, ours = states
  assert type(plain) is nnx.ModelAndOptimizer and isinstance(ours, Zero1Optimizer)
  assert isinstance(ours, nnx.ModelAndOptimizer) and ours.mesh == MESH
  assert_trees_equal(nnx.state(ours.model), nnx.state(plain.model))
  layout = lambda s: [(k, x.shape, x.dtype) for k, x in jax.tree.leaves_with_path(nnx.as_pure(nnx.state(s)))]
  assert layout(ours) == layout(plain)  # the checkpoint tree: same paths, shapes and dtypes
  mu = lambda s: s.opt_state[0].mu["kernel"][...]
  assert bytes_per_device(mu(ours)) * N == bytes_per_device(mu(plain))
  np.testing.assert_array_equal(np.asarray(mu(ours)), np.asarray(mu(plain)))


def test_mesh_without_the_data_axis_is_refused_and_nothing_changes():
  model = _replicated_model()
  before = snapshot(model)
  other = jax.make_mesh((N,), ("model",), devices=jax.devices()[:N])
  with pytest.raises(Zero1Error, match="'data'"):
    Zero1ModelAndOptimizer(model, optax.adam(1e-3), other)
  with pytest.raises(Zero1Error, match="'data'"), zero1_optimizers(other):
    nnx.ModelAndOptimizer(model, optax.adam(1e-3))
  assert_unchanged(before, model)
