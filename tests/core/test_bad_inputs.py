"""Bad inputs: each is a clear ``Zero1Error`` naming the problem and the mesh's axes,
raised before the model or the optimizer changed (values and shardings), or the
documented behaviour, compared value by value with ``nnx.Optimizer``."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_zero1 import Zero1Error, Zero1Optimizer, bytes_per_device, report
from tests.support.helpers import (
  MLP,
  assert_trees_equal,
  assert_unchanged,
  batches,
  loss_fn,
  names_a_fix,
  snapshot,
  train_step,
)

MESH = jax.make_mesh((8,), ("data",))
MESH4 = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
AXES = "('data',)"


def model_on(mesh, seed=0):
  with jax.set_mesh(mesh):
    return MLP(nnx.Rngs(seed))


def grads_of(model, mesh, step=0):
  x, y = batches(step + 1)[step]
  shard = NamedSharding(mesh, P("data"))
  with jax.set_mesh(mesh):
    return nnx.grad(loss_fn)(model, jax.device_put(x, shard), jax.device_put(y, shard))


@pytest.fixture(scope="module")
def built():
  """One model, Zero-1 optimizer and matching gradients; refused calls must leave them as they are."""
  model = model_on(MESH)
  return model, Zero1Optimizer(model, optax.adamw(1e-3), MESH), grads_of(model, MESH)


def refused(call, *words, objs):
  """Runs ``call``, expects a Zero1Error whose message has every word and a fix; checks ``objs`` unchanged."""
  before = snapshot(*objs)
  with pytest.raises(Zero1Error) as info:
    call()
  for word in words:
    assert re.search(re.escape(word), str(info.value)), (word, str(info.value))
  assert names_a_fix(str(info.value)), str(info.value)
  assert_unchanged(before, *objs)
  return str(info.value)


@nnx.jit
def jit_update(model, opt, grads):
  opt.update(model, grads)


# -- construction ---------------------------------------------------------------------------------


def test_no_mesh_and_parameters_spread_over_devices_without_a_named_sharding():
  model = nnx.Linear(16, 16, rngs=nnx.Rngs(0))
  model.bias.set_value(jax.device_put(model.bias[...], jax.devices()[1]))
  assert jax.sharding.get_mesh().empty
  no_mesh = lambda: Zero1Optimizer(model, optax.adamw(1e-3))
  refused(no_mesh, "needs a device mesh", "devices [0, 1]", "jax.set_mesh", objs=[model])


def test_no_mesh_and_parameters_on_two_meshes():
  model = model_on(MESH)
  model.l3.bias.set_value(jax.device_put(model.l3.bias[...], NamedSharding(MESH4, P())))
  two_meshes = lambda: Zero1Optimizer(model, optax.adamw(1e-3))
  refused(two_meshes, "2 different meshes", "{'data': 4}", "{'data': 8}", objs=[model])


def test_mesh_without_the_data_axis():
  model = model_on(MESH)
  batch_mesh = jax.make_mesh((8,), ("batch",))
  refused(lambda: Zero1Optimizer(model, optax.adamw(1e-3), batch_mesh), "'data'", "('batch',)", objs=[model])
  refused(
      lambda: Zero1Optimizer(model, optax.adamw(1e-3), MESH, data_axis="dp"), "'dp'", AXES, objs=[model]
  )


def test_tuple_data_axis_naming_an_unknown_axis():
  model = model_on(MESH)
  refused(
      lambda: Zero1Optimizer(model, optax.adamw(1e-3), MESH, data_axis=("replica", "data")),
      "'replica'",
      AXES,
      objs=[model],
  )


def test_wrt_selecting_nothing():
  model = model_on(MESH)
  refused(
      lambda: Zero1Optimizer(model, optax.adamw(1e-3), MESH, wrt=nnx.LoRAParam),
      "selects no parameters",
      AXES,
      objs=[model],
  )


def test_model_on_devices_outside_the_mesh():
  model = MLP(nnx.Rngs(0))
  nnx.update(model, jax.device_put(nnx.state(model), jax.devices()[6]))
  refused(lambda: Zero1Optimizer(model, optax.adamw(1e-3), MESH4), "devices [6]", AXES, objs=[model])


# -- update ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_gradient_tree_that_does_not_match(built, jitted):
  model, opt, grads = built
  update = jit_update if jitted else lambda m, o, g: o.update(m, g)
  missing = nnx.State({k: v for k, v in nnx.state(grads).items() if k != "l3"})
  refused(lambda: update(model, opt, missing), "gradients do not match", AXES, objs=[model, opt])
  pure_dict = nnx.to_pure_dict(grads)
  refused(lambda: update(model, opt, pure_dict), "gradients do not match", AXES, objs=[model, opt])


@pytest.mark.parametrize(
    "bad",
    [lambda g: g.T, lambda g: g[:1], lambda g: g[:1].astype(jnp.bfloat16)],
    ids=["transposed", "too-short", "too-short-bfloat16"],
)
def test_gradient_of_wrong_shape(built, bad):
  model, opt, grads = built
  wrong = jax.tree.map(lambda g: g, grads)
  wrong.l1.kernel.value = bad(wrong.l1.kernel.value)  # 16 x 128: transposing changes its shape
  refused(lambda: opt.update(model, wrong), "gradient for ['l1']['kernel']", AXES, objs=[model, opt])


def test_update_with_a_different_model(built):
  model, opt, _ = built
  with jax.set_mesh(MESH):
    other = nnx.Linear(16, 3, rngs=nnx.Rngs(0))
  other_grads = grads_of(other, MESH)
  refused(lambda: opt.update(other, other_grads), "differ from the ones", AXES, objs=[model, opt, other])
  refused(lambda: jit_update(other, opt, other_grads), "differ from the ones", AXES, objs=[model, opt, other])


def test_gradients_and_params_on_devices_outside_the_mesh():
  model = model_on(MESH4)
  opt = Zero1Optimizer(model, optax.adamw(1e-3), MESH4)
  grads = grads_of(model, MESH4)
  outside = jax.device_put(grads, jax.devices()[6])
  refused(lambda: opt.update(model, outside), "gradient", "devices [6]", AXES, objs=[model, opt])
  moved = model_on(MESH, seed=0)
  nnx.update(moved, jax.device_put(nnx.state(moved), jax.devices()[7]))
  refused(lambda: opt.update(moved, grads), "parameter", "devices [7]", AXES, objs=[model, opt, moved])


# -- optimizer state restored onto the wrong place ------------------------------------------------


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_state_on_another_mesh_is_refused(jitted):
  model = model_on(MESH)
  opt = Zero1Optimizer(model, optax.adamw(1e-3), MESH)
  grads = grads_of(model, MESH)
  nnx.update(opt, jax.device_put(nnx.state(opt), NamedSharding(MESH4, P())))
  update = jit_update if jitted else lambda m, o, g: o.update(m, g)
  message = refused(lambda: update(model, opt, grads), "{'data': 4}", AXES, objs=[model, opt])
  assert "abstract_state" in message


def test_state_on_another_devices_is_refused():
  model = model_on(MESH4)
  opt = Zero1Optimizer(model, optax.adamw(1e-3), MESH4)
  grads = grads_of(model, MESH4)
  other = jax.make_mesh((4,), ("data",), devices=jax.devices()[4:])
  nnx.update(opt, jax.device_put(nnx.state(opt), NamedSharding(other, P())))
  refused(lambda: opt.update(model, grads), "optimizer state", "devices [4, 5, 6, 7]", objs=[model, opt])


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_state_on_another_layout_of_the_mesh_is_put_back(jitted):
  """Documented behaviour: state on the optimizer's mesh but another layout (e.g. restored
  replicated) is re-placed onto the Zero-1 layout by ``update``; values are unaffected."""
  data = batches(2)
  models = [model_on(MESH) for _ in range(2)]
  opts = [Zero1Optimizer(m, optax.adamw(1e-3), MESH) for m in models]
  wrong = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(MESH, P())), nnx.state(opts[1]))
  nnx.update(opts[1], wrong)
  for x, y in data:
    x, y = (jax.device_put(a, NamedSharding(MESH, P("data"))) for a in (x, y))
    for model, opt in zip(models, opts):
      if jitted:
        train_step(model, opt, x, y)
      else:
        with jax.set_mesh(MESH):
          opt.update(model, nnx.grad(loss_fn)(model, x, y))
  assert_trees_equal(models[0], models[1])
  assert_trees_equal(opts[0], opts[1])
  state = jax.tree.leaves(nnx.as_pure(opts[1].opt_state))
  assert [x.sharding for x in state] == [x.sharding for x in jax.tree.leaves(nnx.as_pure(opts[0].opt_state))]
  for x, row in zip(state, opts[1].zero1_plan.state_leaves, strict=True):
    assert x.sharding.is_equivalent_to(row.sharding, x.ndim), (row.path, x.sharding, row.sharding)


# -- documented behaviour -------------------------------------------------------------------------


def poison(array, where, values):
  host = np.array(array)
  host[where] = values
  return jax.device_put(host, array.sharding)


def test_nan_and_inf_gradients_behave_exactly_as_nnx_optimizer():
  plain_model, zero1_model = model_on(MESH), model_on(MESH)
  plain = nnx.Optimizer(plain_model, optax.adamw(1e-3), wrt=nnx.Param)
  zero1 = Zero1Optimizer(zero1_model, optax.adamw(1e-3), MESH)
  grads = grads_of(plain_model, MESH)
  poisoned = jax.tree.map(lambda g: g, grads)
  poisoned.l1.kernel.value = poison(poisoned.l1.kernel.value, (0, slice(0, 3)), [np.nan, np.inf, -np.inf])
  poisoned.l3.bias.value = poison(poisoned.l3.bias.value, 1, np.inf)
  for g in (poisoned, grads):  # a clean step after the poisoned one: NaN propagates the same way
    jit_update(plain_model, plain, g)
    jit_update(zero1_model, zero1, g)
  assert np.isnan(np.asarray(zero1_model.l1.kernel.value)).any()
  assert_trees_equal(plain_model, zero1_model)  # assert_array_equal treats NaN as equal to NaN
  assert_trees_equal(plain, zero1)


def test_data_axis_of_size_one_is_legal_and_saves_nothing():
  mesh = jax.make_mesh((1, 8), ("data", "tp"))
  plain_model, zero1_model = model_on(mesh), model_on(mesh)
  plain = nnx.Optimizer(plain_model, optax.adamw(1e-3), wrt=nnx.Param)
  zero1 = Zero1Optimizer(zero1_model, optax.adamw(1e-3), mesh)
  r = report(zero1)
  assert r.data_size == 1
  assert r.per_device_bytes == r.unsharded_bytes == bytes_per_device(nnx.as_pure(plain.opt_state))
  grads = grads_of(plain_model, mesh)
  jit_update(plain_model, plain, grads)
  jit_update(zero1_model, zero1, grads)
  assert_trees_equal(plain_model, zero1_model)
  assert_trees_equal(plain, zero1)
