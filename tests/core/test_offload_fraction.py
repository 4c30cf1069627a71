"""``offload_state_to_host=f``: the largest state leaves, f of the state's bytes, in host memory between
steps; the rest on device. Bit-identical to the state kept on device, the same checkpoint tree, and the
same effect from every entry point (per-device bytes by memory kind, from ``addressable_shards``)."""

import random

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from nnx_zero1 import (
  ShardedOptimizerMixin,
  Zero1Error,
  Zero1ModelAndOptimizer,
  Zero1Optimizer,
  abstract_state,
  report,
  restore_into,
  zero1_optimizers,
)
from nnx_zero1._src.storage import offloaded_leaves
from tests.support.helpers import (
  MLP,
  PlainTrainer,
  assert_fraction_kept_on_device,
  assert_trees_equal,
  assert_unchanged,
  batches,
  bytes_by_kind,
  snapshot,
  train,
)

MESH = jax.make_mesh((8,), ("data",))
DATA = batches(3)
FRACTIONS = (0.25, 0.5, 0.75)


def test_the_rule_takes_the_largest_leaves_until_f_of_the_bytes():
  rng = random.Random(0)
  for _ in range(500):
    sizes = [rng.choice([0, 4, 64, 256, 1024, 4096]) for _ in range(rng.randint(1, 9))]
    fraction = rng.choice([0.1, 0.25, 0.5, 0.75, 0.9, 1.0])
    host = offloaded_leaves(sizes, fraction)
    on_host = sum(n for n, h in zip(sizes, host) if h)
    on_device = sum(sizes) - on_host
    assert on_host >= fraction * sum(sizes)
    taken = [n for n, h in zip(sizes, host) if h]
    assert not taken or on_device >= sum(sizes) * (1 - fraction) - max(taken)
    # Largest first: nothing left on device is larger than a leaf taken to host.
    assert not any(host) or max((n for n, h in zip(sizes, host) if not h), default=0) <= min(
        n for n, h in zip(sizes, host) if h)
  assert offloaded_leaves([4, 400, 400, 100], 1.0) == (True,) * 4


def build(offload, seed=0, mesh=MESH):
  with jax.set_mesh(mesh):
    model = MLP(nnx.Rngs(seed))
  return model, Zero1Optimizer(model, optax.adamw(1e-3), mesh, offload_state_to_host=offload)


@pytest.fixture(scope="module")
def trained():
  """Optimizers trained side by side under jit: state on device, each fraction, all of it offloaded."""
  runs = {}
  for offload in (False, *FRACTIONS, True):
    model, opt = build(offload)
    losses = train(model, opt, MESH, DATA)
    runs[offload] = (model, opt, losses)
  return runs


def test_each_fraction_keeps_the_rest_on_device_and_trains_bit_identically(trained):
  model, on_device, losses = trained[False]
  total = bytes_by_kind(on_device)["device"]
  for fraction in FRACTIONS:
    model_f, opt_f, losses_f = trained[fraction]
    assert_fraction_kept_on_device(opt_f, fraction, total)
    np.testing.assert_array_equal(losses_f, losses)
    assert_trees_equal(model_f, model)
    assert_trees_equal(opt_f, on_device)
    assert opt_f.step.get_value().sharding.memory_kind == "device"
  assert bytes_by_kind(trained[True][1]) == {"pinned_host": total}


def test_the_report_says_which_leaves_live_where(trained):
  for fraction in FRACTIONS:
    opt = trained[fraction][1]
    rows = report(opt).rows
    arrays = jax.tree.leaves(nnx.as_pure(opt.opt_state))
    assert [r.memory_kind for r in rows] == [x.sharding.memory_kind for x in arrays]
    assert report(opt).host_bytes == bytes_by_kind(opt)["pinned_host"]
    assert {"device", "pinned_host"} <= {r.memory_kind for r in rows}


def test_the_checkpoint_tree_is_unchanged_and_crosses(trained, tmp_path):
  source = trained[0.5][1]
  assert jax.tree.structure(nnx.state(source)) == jax.tree.structure(nnx.state(trained[False][1]))
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "half", nnx.state(source))
  checkpointer.wait_until_finished()
  for target_offload in (False, 0.25):
    _, target = build(target_offload, seed=5)
    restore_into(target, checkpointer.restore(tmp_path / "half", abstract_state(target)))
    assert_trees_equal(target, source)
    if target_offload:
      total = bytes_by_kind(trained[False][1])["device"]
      assert_fraction_kept_on_device(target, target_offload, total)


class _HalfOffloadTrainer(ShardedOptimizerMixin, PlainTrainer):
  zero1_offload_state_to_host = 0.5


def test_every_entry_point_offloads_the_same_leaves(trained):
  expected = bytes_by_kind(trained[0.5][1])
  with jax.set_mesh(MESH):
    model = MLP(nnx.Rngs(0))
  with zero1_optimizers(MESH, offload_state_to_host=0.5) as built:
    nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
  with jax.set_mesh(MESH):
    trainer = _HalfOffloadTrainer(model, optax.adamw(1e-3))
  both = Zero1ModelAndOptimizer(model, optax.adamw(1e-3), MESH, offload_state_to_host=0.5)
  for opt in (built[0], trainer.optimizer, both):
    assert bytes_by_kind(opt) == expected


def test_the_engine_attribute_takes_a_fraction():
  from tests.support.helpers import Decoder, lm_loss
  from tests.support.reference_engine import Zero1Engine

  class HalfOffloadEngine(Zero1Engine):
    OFFLOAD_STATE_TO_HOST = 0.5

  mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  rng = np.random.default_rng(0)
  data = [{"tokens": rng.integers(0, 64, (8, 17)).astype(np.int32)} for _ in range(2)]
  engines = []
  for cls in (Zero1Engine, HalfOffloadEngine):
    engine = cls(Decoder(nnx.Rngs(0), vocab=64), optax.adamw(1e-2), mesh, loss_fn=lm_loss)
    for b in data:
      engine.fwd_bwd(b)
    engine.update()
    engines.append(engine)
  total = bytes_by_kind(engines[0].optimizer)["device"]
  assert_fraction_kept_on_device(engines[1].optimizer, 0.5, total)
  assert_trees_equal(engines[1].model, engines[0].model)
  assert_trees_equal(engines[1].optimizer, engines[0].optimizer)


@pytest.mark.parametrize("offload", [0, 0.0, 1.5, -0.25, "half", None])
def test_a_value_that_is_neither_a_bool_nor_a_fraction_is_refused_and_changes_nothing(offload):
  with jax.set_mesh(MESH):
    model = MLP(nnx.Rngs(0))
  before = snapshot(model)
  with pytest.raises(Zero1Error, match="neither a bool nor a fraction in"):
    Zero1Optimizer(model, optax.adam(1e-3), MESH, offload_state_to_host=offload)
  assert_unchanged(before, model)


def test_a_fraction_with_no_mesh_is_refused():
  model = MLP(nnx.Rngs(0))
  with pytest.raises(Zero1Error, match="offload_state_to_host=0.5 needs a mesh"):
    Zero1Optimizer(model, optax.adam(1e-3), offload_state_to_host=0.5)
