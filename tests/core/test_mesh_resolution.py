"""Where ``Zero1Optimizer`` finds its mesh when none is given, and data-parallel size 1:
a model on one device with no mesh trains exactly like ``nnx.Optimizer``."""

import traceback
import warnings

import jax
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_zero1 import (
  Zero1Error,
  Zero1ModelAndOptimizer,
  Zero1Optimizer,
  Zero1Warning,
  abstract_state,
  bytes_per_device,
  report,
  zero1_optimizers,
)
from nnx_zero1._src.compat import jit_cache_size
from tests.support.helpers import (
  MLP,
  assert_trees_equal,
  assert_unchanged,
  batches,
  loss_fn,
  pure,
  snapshot,
  train,
)

MESH = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])


def new_step():
  @nnx.jit
  def step(model, opt, x, y):
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
    opt.update(model, grads)
    return loss

  return step


def test_one_device_no_mesh_is_nnx_optimizer_bit_for_bit():
  data = batches(3)
  runs = []
  for cls in (nnx.Optimizer, Zero1Optimizer):
    model = MLP(nnx.Rngs(0))
    opt = cls(model, optax.adamw(1e-2), wrt=nnx.Param)
    step = new_step()
    losses = [step(model, opt, x, y) for x, y in data]
    assert jit_cache_size(step.jitted_fn) == 1
    runs.append((model, opt, losses))
  (m0, o0, l0), (m1, o1, l1) = runs
  assert [float(x) for x in l0] == [float(x) for x in l1]
  assert_trees_equal(m0, m1)
  assert_trees_equal(o0, o1)
  kinds = {type(x.sharding).__name__ for x in jax.tree.leaves(nnx.as_pure(nnx.state(o1))) +
           jax.tree.leaves(nnx.as_pure(nnx.state(m1)))}
  assert kinds == {"SingleDeviceSharding"}
  r = report(o1)
  assert r.data_size == 1 and r.sharded_bytes == 0 and r.per_device_bytes == r.unsharded_bytes
  assert all(row.reason in ("scalar", "data-parallel size 1 (one device, no mesh)") for row in r.rows)
  assert {type(t.sharding).__name__ for t in jax.tree.leaves(abstract_state(o1))} == {"SingleDeviceSharding"}


def _zero1_warnings(build) -> list:
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    build()
  return [w for w in caught if issubclass(w.category, Zero1Warning)]


def test_one_device_while_eight_are_visible_warns_once_and_names_the_fix():
  model = MLP(nnx.Rngs(0))
  ours = _zero1_warnings(lambda: Zero1Optimizer(model, optax.adam(1e-2)))
  assert len(ours) == 1, [str(w.message) for w in ours]
  message = str(ours[0].message)
  assert "8 are visible" in message and "jax.set_mesh(mesh)" in message and "strict=True" in message
  with jax.set_mesh(MESH):  # a mesh: nothing to say
    placed = MLP(nnx.Rngs(0))
  assert not _zero1_warnings(lambda: Zero1Optimizer(placed, optax.adam(1e-2), MESH))


@pytest.mark.parametrize("build", [
    lambda model: Zero1Optimizer(model, optax.adam(1e-2)),
    lambda model: Zero1ModelAndOptimizer(model, optax.adam(1e-2)),
    lambda model: nnx.eval_shape(lambda: Zero1Optimizer(model, optax.adam(1e-2))),
], ids=["Zero1Optimizer", "Zero1ModelAndOptimizer", "nnx.eval_shape"])
def test_the_one_device_warning_points_at_the_users_line(build):
  # flax's metaclass __call__ and its transforms lie between the user's call and the warning.
  model = MLP(nnx.Rngs(0))
  ours = _zero1_warnings(lambda: build(model))
  assert len(ours) == 1 and ours[0].filename == __file__, [(w.filename, w.lineno) for w in ours]
  with zero1_optimizers():  # routed from code the user calls: flax's frames and ours, then the user's
    ours = _zero1_warnings(lambda: nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param))
  assert len(ours) == 1 and ours[0].filename == __file__, [(w.filename, w.lineno) for w in ours]


def test_errors_and_warnings_print_their_public_names():
  assert f"{Zero1Error.__module__}.{Zero1Error.__qualname__}" == "nnx_zero1.Zero1Error"
  assert f"{Zero1Warning.__module__}.{Zero1Warning.__qualname__}" == "nnx_zero1.Zero1Warning"
  try:
    Zero1Optimizer(MLP(nnx.Rngs(0)), optax.adam(1e-2), strict=True)
  except Zero1Error:
    printed = traceback.format_exc()
  assert "\nnnx_zero1.Zero1Error: strict=True" in printed, printed[-500:]


def test_strict_refuses_one_device_without_a_mesh():
  model = MLP(nnx.Rngs(0))
  before = pure(model)
  with pytest.raises(Zero1Error, match="one device.*no mesh is set"):
    Zero1Optimizer(model, optax.adam(1e-2), strict=True)
  assert_trees_equal(model, before)


def test_no_mesh_takes_the_parameters_mesh_and_trains_like_with_it():
  runs = []
  for mesh_arg in (MESH, None):
    with jax.set_mesh(MESH):
      model = MLP(nnx.Rngs(0))
    assert jax.sharding.get_mesh().empty
    opt = Zero1Optimizer(model, optax.adamw(1e-2), mesh_arg)
    assert opt.mesh == MESH
    with jax.set_mesh(MESH):
      train(model, opt, MESH, batches(2))
    runs.append((model, opt))
  assert_trees_equal(runs[0][0], runs[1][0])
  assert_trees_equal(runs[0][1], runs[1][1])
  assert bytes_per_device(nnx.as_pure(runs[1][1].opt_state)) == report(runs[1][1]).per_device_bytes


def test_the_current_mesh_comes_before_the_parameters_mesh():
  other = jax.make_mesh((2,), ("data",), devices=jax.devices()[4:6])
  model = nnx.Linear(16, 16, rngs=nnx.Rngs(0))
  nnx.update(model, jax.device_put(nnx.state(model), NamedSharding(other, P())))
  with jax.set_mesh(other):
    assert Zero1Optimizer(model, optax.sgd(0.1, momentum=0.9)).mesh == other
  with jax.set_mesh(MESH), pytest.raises(Zero1Error, match="not in the mesh"):
    Zero1Optimizer(model, optax.sgd(0.1, momentum=0.9))


@pytest.mark.parametrize("given", ["argument", "jax.set_mesh"])
def test_a_model_off_the_mesh_is_refused_with_the_fix_before_anything_changes(given):
  # Left on one device, the parameters would reach the jitted step unplaced while the moments are
  # split over the mesh: jit picks their layout, and the step is no longer nnx.Optimizer's.
  model = MLP(nnx.Rngs(0))
  before = snapshot(model)
  with pytest.raises(Zero1Error) as info:
    if given == "argument":
      Zero1Optimizer(model, optax.adamw(1e-3), MESH)
    else:
      with jax.set_mesh(MESH):
        Zero1Optimizer(model, optax.adamw(1e-3))
  message = str(info.value)
  assert "one device" in message and "('data',)" in message, message
  assert "jax.set_mesh(mesh)" in message and "nnx.get_named_sharding" in message, message
  assert_unchanged(before, model)
  # The named-sharding fix, as the message spells it, is accepted.
  nnx.update(model, jax.device_put(nnx.state(model), nnx.get_named_sharding(nnx.state(model), MESH)))
  assert Zero1Optimizer(model, optax.adamw(1e-3), MESH).mesh == MESH
