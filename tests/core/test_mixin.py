"""ShardedOptimizerMixin on small hand-written trainers: what it routes, what it refuses,
and that it leaves no trace (other threads, module globals, after errors)."""

import inspect
import threading

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from flax.nnx import Optimizer

from nnx_zero1 import ShardedOptimizerMixin, Zero1Error, Zero1Optimizer, bytes_per_device
from tests.support.helpers import assert_trees_equal, pure

MESH = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
ORIGINALS = (nnx, Optimizer)  # routing rebinds no module global: these stay what they are


class Trainer:
  """Builds its optimizer the usual way, as ``nnx.Optimizer``."""

  def __init__(self, model, tx, *, wrt=nnx.Param):
    self.model = model
    self.optimizer = nnx.Optimizer(model, tx, wrt=wrt)


class ImportedNameTrainer:
  """Builds it through ``from flax.nnx import Optimizer``."""

  def __init__(self, model, tx):
    self.optimizer = Optimizer(model, tx, wrt=nnx.Param)


class NoOptimizerTrainer:
  def __init__(self, model, tx):
    self.model = model


class FailingTrainer:
  def __init__(self, model, tx):
    self.optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    raise RuntimeError("trainer failed after building its optimizer")


class Zero1Trainer(ShardedOptimizerMixin, Trainer):
  pass


def model():
  return nnx.Linear(8, 16, rngs=nnx.Rngs(0))


@pytest.fixture(autouse=True)
def module_globals_come_back():
  yield
  assert (globals()["nnx"], globals()["Optimizer"]) == ORIGINALS


def test_routes_nnx_optimizer_to_zero1_with_the_same_arguments():
  with jax.set_mesh(MESH):
    m = model()
    trainer = Zero1Trainer(m, optax.adam(1e-2), wrt=nnx.Param)
  opt = trainer.optimizer
  assert isinstance(opt, Zero1Optimizer) and opt.mesh == MESH and opt.data_axis == ("data",)
  assert opt.wrt is nnx.Param
  plain = nnx.Optimizer(m, optax.adam(1e-2), wrt=nnx.Param)
  assert jax.tree.structure(nnx.as_pure(nnx.state(opt))) == jax.tree.structure(nnx.as_pure(nnx.state(plain)))
  count = 4  # adam's step count: a scalar every device keeps whole
  zero1_bytes, plain_bytes = (bytes_per_device(nnx.as_pure(o.opt_state)) for o in (opt, plain))
  assert zero1_bytes - count == (plain_bytes - count) // 4


def test_constructor_signature_is_the_trainers():
  class OwnInit(Zero1Trainer):
    def __init__(self, model):
      super().__init__(model, optax.sgd(0.1))

  assert inspect.signature(Zero1Trainer) == inspect.signature(Trainer)
  assert list(inspect.signature(OwnInit).parameters) == ["model"]


def test_imported_optimizer_name_is_routed_too():
  class Zero1Imported(ShardedOptimizerMixin, ImportedNameTrainer):
    pass

  with jax.set_mesh(MESH):
    assert isinstance(Zero1Imported(model(), optax.sgd(0.1)).optimizer, Zero1Optimizer)


def test_one_step_matches_the_plain_trainer_bit_for_bit():
  x = jnp.arange(32, dtype=jnp.float32).reshape(4, 8) / 32
  loss = lambda m: jnp.sum(m(x) ** 2)
  trainers = []
  with jax.set_mesh(MESH):
    for cls in (Trainer, Zero1Trainer):
      trainer = cls(model(), optax.adamw(1e-2))
      trainer.optimizer.update(trainer.model, nnx.grad(loss)(trainer.model))
      trainers.append(trainer)
  assert_trees_equal(trainers[0].model, trainers[1].model)
  assert_trees_equal(trainers[0].optimizer, trainers[1].optimizer)


def test_options_come_from_class_attributes_and_the_hook():
  mesh = jax.make_mesh((2, 2), ("replica", "data"), devices=jax.devices()[:4])

  class Attrs(Zero1Trainer):
    zero1_data_axis = ("replica", "data")

  class Hook(Zero1Trainer):
    def zero1_options(self, model, tx, **kwargs):
      return {"data_axis": "replica", "strict": True}

  with jax.set_mesh(mesh):
    assert Attrs(model(), optax.sgd(0.1)).optimizer.data_axis == ("replica", "data")
    assert Hook(model(), optax.sgd(0.1)).optimizer.data_axis == ("replica",)


def test_mesh_without_the_data_axis_raises_before_the_trainer_runs():
  mesh = jax.make_mesh((4,), ("tp",), devices=jax.devices()[:4])
  started = []

  class Watched(ShardedOptimizerMixin, Trainer):
    def zero1_options(self, *args, **kwargs):
      started.append(True)
      return super().zero1_options(*args, **kwargs)

  m = model()
  before = pure(m)
  with jax.set_mesh(mesh), pytest.raises(Zero1Error, match=r"'data'.*\('tp',\)"):
    Watched(m, optax.adam(1e-2))
  assert started == [True]
  assert_trees_equal(m, before)


def test_no_mesh_one_device_is_data_parallel_size_1_and_strict_refuses_it():
  trainer = Zero1Trainer(model(), optax.adam(1e-2))
  assert isinstance(trainer.optimizer, Zero1Optimizer) and trainer.optimizer.zero1_plan.single_device

  class Strict(Zero1Trainer):
    zero1_strict = True

  m = model()
  before = pure(m)
  with pytest.raises(Zero1Error, match="one device"):
    Strict(m, optax.adam(1e-2))
  assert_trees_equal(m, before)


def test_optimizer_built_in_another_module_is_routed_too():
  namespace = {}
  exec("def build(model, tx):\n  from flax import nnx\n  return nnx.Optimizer(model, tx, wrt=nnx.Param)\n",
       namespace)

  class Delegating:
    def __init__(self, model, tx):
      self.optimizer = namespace["build"](model, tx)

  class Zero1Delegating(ShardedOptimizerMixin, Delegating):
    pass

  with jax.set_mesh(MESH):
    assert isinstance(Zero1Delegating(model(), optax.sgd(0.1)).optimizer, Zero1Optimizer)


def test_trainer_that_builds_no_optimizer_raises():
  class Zero1NoOptimizer(ShardedOptimizerMixin, NoOptimizerTrainer):
    pass

  with jax.set_mesh(MESH), pytest.raises(Zero1Error, match="built no nnx.Optimizer"):
    Zero1NoOptimizer(model(), optax.adam(1e-2))


def test_everything_is_put_back_when_the_trainer_raises():
  class Zero1Failing(ShardedOptimizerMixin, FailingTrainer):
    pass

  with jax.set_mesh(MESH), pytest.raises(RuntimeError, match="trainer failed"):
    Zero1Failing(model(), optax.adam(1e-2))
  with jax.set_mesh(MESH):
    assert type(Trainer(model(), optax.adam(1e-2)).optimizer) is nnx.Optimizer


def test_other_threads_get_the_plain_optimizer_meanwhile():
  inside, release = threading.Event(), threading.Event()
  built = {}

  class Pausing(Trainer):
    def __init__(self, model, tx):
      super().__init__(model, tx)
      inside.set()
      assert release.wait(timeout=60)

  class Zero1Pausing(ShardedOptimizerMixin, Pausing):
    pass

  def build_zero1():
    with jax.set_mesh(MESH):
      built["zero1"] = Zero1Pausing(model(), optax.sgd(0.1))

  worker = threading.Thread(target=build_zero1)
  worker.start()
  try:
    assert inside.wait(timeout=60)
    assert (nnx, Optimizer) == ORIGINALS  # the worker is inside its __init__; no global was rebound
    with jax.set_mesh(MESH):
      built["plain"] = Trainer(model(), optax.sgd(0.1))
      built["nested"] = Zero1Trainer(model(), optax.sgd(0.1))
    # type checks against the routed name still answer as for nnx.Optimizer
    assert isinstance(built["plain"].optimizer, nnx.Optimizer) and issubclass(Zero1Optimizer, Optimizer)
    assert not isinstance(built["plain"].model, nnx.Optimizer)
  finally:
    release.set()
    worker.join()
  assert type(built["plain"].optimizer) is nnx.Optimizer
  assert isinstance(built["nested"].optimizer, Zero1Optimizer)
  assert isinstance(built["zero1"].optimizer, Zero1Optimizer)
