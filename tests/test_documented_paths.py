"""A newcomer's first script, written from the README and getting started: every way those pages
build the optimizer trains three steps bit-identically to ``nnx.Optimizer`` built the same way, or
is refused with the fix in the message."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_zero1 import Zero1Error, Zero1Optimizer, Zero1Warning
from tests.support.helpers import assert_trees_equal

AUTO = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
EXPLICIT = jax.make_mesh((8,), ("data",))  # jax.make_mesh's default axis type
STEPS = 3


def new_model():
  return nnx.Sequential(nnx.Linear(16, 64, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(64, 16, rngs=nnx.Rngs(1)))


def place(model, mesh):
  """The placement a refusal names: every parameter on ``mesh`` by its named sharding."""
  nnx.update(model, jax.device_put(nnx.state(model), nnx.get_named_sharding(nnx.state(model), mesh)))
  return model


def loss_fn(model, x, y):
  return jnp.mean((model(x) - y) ** 2)


def data(mesh):
  x = jax.random.normal(jax.random.key(0), (32, 16))
  y = jax.random.normal(jax.random.key(1), (32, 16))
  if mesh is None:
    return x, y
  rows = NamedSharding(mesh, P("data"))
  return jax.device_put(x, rows), jax.device_put(y, rows)


def build(path, cls):
  """(model, optimizer, the mesh ``jax.set_mesh`` sets around the steps or None), as the docs build it."""
  plain = cls is nnx.Optimizer
  make = lambda model, mesh=None: (
      cls(model, optax.adamw(1e-3), wrt=nnx.Param) if plain or mesh is None
      else cls(model, optax.adamw(1e-3), mesh))
  if path in ("set_mesh, Auto", "set_mesh, Explicit"):  # the quick start
    mesh = AUTO if path.endswith("Auto") else EXPLICIT
    with jax.set_mesh(mesh):
      model = new_model()
      return model, make(model), mesh
  if path == "model under set_mesh, mesh argument":
    with jax.set_mesh(AUTO):
      model = new_model()
    return model, make(model, AUTO), AUTO
  if path == "placed, mesh argument":
    model = place(new_model(), AUTO)
    return model, make(model, AUTO), AUTO
  if path == "placed, the parameters' mesh":
    model = place(new_model(), AUTO)
    return model, make(model), AUTO
  if path == "placed on an Explicit mesh, no mesh context":
    model = place(new_model(), EXPLICIT)
    return model, make(model), None
  assert path == "one device, no mesh"
  model = new_model()
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    opt = make(model)
  assert plain or [w for w in caught if issubclass(w.category, Zero1Warning)]
  return model, opt, None


def train(path, cls):
  model, opt, mesh = build(path, cls)

  @nnx.jit
  def train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
    optimizer.update(model, grads)
    return loss

  x, y = data(mesh or (EXPLICIT if path.startswith("placed on an Explicit") else None))
  if mesh is None:
    losses = [float(train_step(model, opt, x, y)) for _ in range(STEPS)]
  else:
    with jax.set_mesh(mesh):
      losses = [float(train_step(model, opt, x, y)) for _ in range(STEPS)]
  return model, opt, losses


PATHS = ["set_mesh, Auto", "set_mesh, Explicit", "model under set_mesh, mesh argument",
         "placed, mesh argument", "placed, the parameters' mesh",
         "placed on an Explicit mesh, no mesh context", "one device, no mesh"]


@pytest.mark.parametrize("path", PATHS)
def test_every_documented_construction_is_bit_identical_to_nnx_optimizer(path):
  (m0, o0, l0), (m1, o1, l1) = train(path, nnx.Optimizer), train(path, Zero1Optimizer)
  np.testing.assert_array_equal(l0, l1)
  assert l1[-1] < l1[0]
  assert_trees_equal(m0, m1)
  assert_trees_equal(o0, o1)
  split = path != "one device, no mesh"
  mu = o1.opt_state[0].mu["layers"][0]["kernel"][...]
  assert len({s.data.nbytes for s in mu.addressable_shards}) == 1
  assert mu.addressable_shards[0].data.nbytes * (8 if split else 1) == mu.nbytes


@pytest.mark.parametrize("mesh", [AUTO, EXPLICIT], ids=["Auto", "Explicit"])
def test_a_model_built_off_the_mesh_with_the_mesh_as_argument_is_refused_with_the_fix(mesh):
  model = new_model()
  with pytest.raises(Zero1Error, match=r"not on the mesh.*jax\.set_mesh\(mesh\).*nnx\.get_named_sharding"):
    Zero1Optimizer(model, optax.adamw(1e-3), mesh)
