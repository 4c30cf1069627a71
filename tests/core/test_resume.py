"""Resume at any data-parallel size: a checkpoint written at dp=8 restores straight onto
dp=4, 2, 1 and into a plain ``nnx.Optimizer`` (and back) through real orbax on disk,
with ``abstract_state`` as the restore target; training continues as if never stopped."""

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_zero1 import Zero1Error, Zero1Optimizer, abstract_state, bytes_per_device, report, restore_into
from tests.support.helpers import MLP, assert_trees_close, assert_unchanged, batches, pure, snapshot, train

STEPS = 2  # per leg
DATA = batches(4 * STEPS)


def mesh_of(dp):
  return jax.make_mesh((dp,), ("data",), devices=jax.devices()[:dp])


def build(dp, zero1=True, seed=None):
  """A model and optimizer on a dp-device mesh; by default initialised unlike the checkpoint."""
  mesh = mesh_of(dp)
  with jax.set_mesh(mesh):
    model = MLP(nnx.Rngs(100 + dp if seed is None else seed))
  tx = optax.adamw(1e-3)
  opt = Zero1Optimizer(model, tx, mesh) if zero1 else nnx.Optimizer(model, tx, wrt=nnx.Param)
  return mesh, model, opt


def save(checkpointer, path, model, opt):
  """Saves both; returns their values, to check the restore is exact."""
  checkpointer.save(path, {"model": nnx.state(model), "opt": nnx.state(opt)})
  checkpointer.wait_until_finished()
  return pure(model), pure(opt)


def assert_restored_exactly(saved, model, opt):
  for want, got in zip(saved, (pure(model), pure(opt)), strict=True):
    assert len(want) == len(got)
    for a, b in zip(want, got, strict=True):
      np.testing.assert_array_equal(a, b)


def restore(checkpointer, path, model, opt):
  """Restores onto the layout ``model`` and ``opt`` have now; returns orbax's arrays."""
  target = {"model": abstract_state(model), "opt": abstract_state(opt)}
  restored = checkpointer.restore(path, target)
  restore_into(model, restored["model"])
  restore_into(opt, restored["opt"])
  return restored


@pytest.fixture(scope="module")
def reference():
  """An uninterrupted Zero-1 run at dp=8: (model, optimizer) snapshots after each leg."""
  mesh, model, opt = build(8, seed=0)
  legs = []
  for leg in range(4):
    train(model, opt, mesh, DATA[leg * STEPS:(leg + 1) * STEPS])
    legs.append((nnx.clone(model), nnx.clone(opt)))
  return legs


def assert_layout_of(opt, dp):
  """Per-device bytes of every split leaf are 1/dp of the leaf, and the state sits on the plan."""
  rows = report(opt).rows
  assert any(r.sharded for r in rows)
  for r in rows:
    assert r.bytes_per_device == (r.full_bytes // dp if r.sharded else r.full_bytes), r
  for x, row in zip(jax.tree.leaves(nnx.as_pure(opt.opt_state)), opt.zero1_plan.state_leaves, strict=True):
    assert x.sharding.is_equivalent_to(row.sharding, x.ndim), row.path


def test_chain_8_4_2_1_equals_an_uninterrupted_run(tmp_path, reference):
  checkpointer = ocp.StandardCheckpointer()
  mesh, model, opt = build(8, seed=0)
  saved = None
  for leg, dp in enumerate([8, 4, 2, 1]):
    if dp != 8:
      mesh, model, opt = build(dp)
      fresh_bytes = bytes_per_device(nnx.as_pure(opt.opt_state))
      restored = restore(checkpointer, tmp_path / f"leg{leg - 1}", model, opt)
      assert_restored_exactly(saved, model, opt)
      # orbax read straight into the Zero-1 layout: no replicated copy of the moments
      assert bytes_per_device(nnx.as_pure(restored["opt"]["opt_state"])) == fresh_bytes
      assert bytes_per_device(nnx.as_pure(opt.opt_state)) == fresh_bytes
      assert_layout_of(opt, dp)
      assert opt.mesh.shape["data"] == dp
    train(model, opt, mesh, DATA[leg * STEPS:(leg + 1) * STEPS])
    ref_model, ref_opt = reference[leg]
    assert_trees_close(model, ref_model)
    assert_trees_close(opt, ref_opt)
    saved = save(checkpointer, tmp_path / f"leg{leg}", model, opt)
  assert int(opt.step[...]) == 4 * STEPS


def test_zero1_to_plain_and_plain_to_zero1(tmp_path, reference):
  checkpointer = ocp.StandardCheckpointer()
  mesh, model, opt = build(8, seed=0)
  train(model, opt, mesh, DATA[:STEPS])
  saved = save(checkpointer, tmp_path / "zero1", model, opt)

  mesh, model, plain = build(8, zero1=False)
  restore(checkpointer, tmp_path / "zero1", model, plain)
  assert_restored_exactly(saved, model, plain)
  replicated = bytes_per_device(nnx.as_pure(plain.opt_state))
  assert replicated == sum(x.nbytes for x in jax.tree.leaves(nnx.as_pure(plain.opt_state)))
  train(model, plain, mesh, DATA[STEPS:2 * STEPS])
  assert_trees_close(model, reference[1][0])
  assert_trees_close(plain, reference[1][1])
  saved = save(checkpointer, tmp_path / "plain", model, plain)

  mesh, model, opt = build(4)
  restore(checkpointer, tmp_path / "plain", model, opt)
  assert_restored_exactly(saved, model, opt)
  assert_layout_of(opt, 4)
  assert bytes_per_device(nnx.as_pure(opt.opt_state)) < replicated / 3
  train(model, opt, mesh, DATA[2 * STEPS:3 * STEPS])
  assert_trees_close(model, reference[2][0])
  assert_trees_close(opt, reference[2][1])


def test_restore_into_places_a_replicated_state_and_refuses_a_mismatch():
  mesh, _, opt = build(4)
  placed = [x.sharding for x in jax.tree.leaves(nnx.as_pure(opt.opt_state))]
  restore_into(opt, jax.device_put(nnx.state(opt), NamedSharding(mesh, P())))
  assert [x.sharding for x in jax.tree.leaves(nnx.as_pure(opt.opt_state))] == placed
  assert_layout_of(opt, 4)
  before = snapshot(opt)
  other = Zero1Optimizer(nnx.Linear(16, 3, rngs=nnx.Rngs(0)), optax.adamw(1e-3), mesh_of(1))
  with pytest.raises(Zero1Error, match=r"does not match.*mesh axes \('data',\) \(shape \{'data': 4\}\)"):
    restore_into(opt, nnx.state(other))
  assert_unchanged(before, opt)
