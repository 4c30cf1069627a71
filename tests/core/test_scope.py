"""``zero1_optimizers()``: which ``nnx.Optimizer`` constructions it routes (wherever written, this
thread or asyncio task only), which it leaves alone, and what it refuses up front."""

import asyncio
import threading

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from flax.nnx import Optimizer as ImportedBeforeAnyScope

from nnx_zero1 import Zero1Error, Zero1Optimizer, zero1_optimizers
from tests.support.helpers import assert_trees_equal

MESH = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])


def model():
  with jax.set_mesh(MESH):  # on the mesh the scopes name
    return nnx.Linear(8, 16, rngs=nnx.Rngs(0))


def plain(m):
  return nnx.Optimizer(m, optax.adam(1e-2), wrt=nnx.Param)


def test_routes_every_spelling_and_yields_what_it_built():
  m = model()
  with zero1_optimizers(MESH) as built:
    a = plain(m)
    b = ImportedBeforeAnyScope(m, optax.sgd(0.1), wrt=nnx.Param)
    c = nnx.Optimizer[nnx.Linear](m, optax.sgd(0.1), wrt=nnx.Param)
  assert built == [a, b, c]
  assert all(type(o) is Zero1Optimizer and o.mesh == MESH and o.data_axis == ("data",) for o in built)
  assert isinstance(a, nnx.Optimizer) and isinstance(a, ImportedBeforeAnyScope)


def test_outside_the_scope_nothing_changes():
  m = model()
  with zero1_optimizers(MESH):
    pass
  opt = plain(m)
  assert type(opt) is nnx.Optimizer and nnx.Optimizer is ImportedBeforeAnyScope
  assert not isinstance(m, nnx.Optimizer) and issubclass(Zero1Optimizer, nnx.Optimizer)
  with pytest.raises(TypeError):  # nnx.Optimizer's own argument checks still apply
    nnx.Optimizer(m, optax.sgd(0.1))


def test_same_arguments_and_bit_identical_step():
  x = jnp.arange(32, dtype=jnp.float32).reshape(4, 8) / 32
  loss = lambda m: jnp.sum(m(x) ** 2)
  models, opts = [], []
  with jax.set_mesh(MESH):
    for scoped in (False, True):
      m = model()
      if scoped:
        with zero1_optimizers():
          opt = nnx.Optimizer(m, optax.adamw(1e-2), wrt=nnx.Param, graph=True)
      else:
        opt = nnx.Optimizer(m, optax.adamw(1e-2), wrt=nnx.Param, graph=True)
      opt.update(m, nnx.grad(loss)(m))
      models.append(m)
      opts.append(opt)
  assert type(opts[1]) is Zero1Optimizer and opts[1].graph is True and opts[1].mesh == MESH
  assert_trees_equal(*models)
  assert_trees_equal(*opts)


def test_subclasses_and_rebuilt_objects_are_not_routed():
  class MyOptimizer(nnx.Optimizer):
    pass

  m = model()
  outside = plain(m)
  with zero1_optimizers(MESH) as built:
    mine = MyOptimizer(m, optax.sgd(0.1), wrt=nnx.Param)
    merged = nnx.merge(*nnx.split(outside))
  assert type(mine) is MyOptimizer and type(merged) is nnx.Optimizer and built == []


def test_nested_scopes_innermost_wins_and_errors_restore():
  mesh2 = jax.make_mesh((2, 2), ("replica", "data"), devices=jax.devices()[:4])
  m = model()
  with zero1_optimizers(MESH):
    with zero1_optimizers(mesh2, ("replica", "data")):
      inner = plain(m)
    outer = plain(m)
    with pytest.raises(RuntimeError), zero1_optimizers(mesh2, "replica"):
      raise RuntimeError("inside")
    after = plain(m)
  assert inner.data_axis == ("replica", "data") and outer.mesh == MESH and after.mesh == MESH
  assert type(plain(m)) is nnx.Optimizer


def test_other_threads_get_the_plain_optimizer():
  m = model()
  seen = {}
  inside, done = threading.Event(), threading.Event()

  def other():
    assert inside.wait(timeout=60)
    seen["other"] = type(plain(m))
    done.set()

  worker = threading.Thread(target=other)
  worker.start()
  with zero1_optimizers(MESH):
    inside.set()
    assert done.wait(timeout=60)
    seen["here"] = type(plain(m))
  worker.join()
  assert seen == {"other": nnx.Optimizer, "here": Zero1Optimizer}


def test_asyncio_tasks_see_the_scope_they_were_created_in():
  m = model()

  async def build():
    await asyncio.sleep(0)
    return type(plain(m))

  async def main():
    outside = asyncio.create_task(build())  # created outside: its context has no scope
    with zero1_optimizers(MESH):
      inside = asyncio.create_task(build())
      results = await asyncio.gather(outside, inside)
    return results

  assert asyncio.run(main()) == [nnx.Optimizer, Zero1Optimizer]


def test_bad_requests_are_refused_at_entry():
  with pytest.raises(Zero1Error, match=r"'data'.*\('tp',\)"):
    with zero1_optimizers(jax.make_mesh((4,), ("tp",), devices=jax.devices()[:4])):
      pass
  with pytest.raises(Zero1Error, match="names an axis twice"):
    with zero1_optimizers(MESH, ("data", "data")):
      pass
  with pytest.raises(Zero1Error, match="jax.sharding.Mesh"):
    with zero1_optimizers("data"):
      pass
  assert type(plain(model())) is nnx.Optimizer


def test_a_construction_that_cannot_apply_raises_inside_the_scope():
  m = nnx.Linear(8, 16, rngs=nnx.Rngs(0))  # one device, no mesh
  with zero1_optimizers(strict=True), pytest.raises(Zero1Error, match="one device"):
    plain(m)
