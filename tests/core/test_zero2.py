"""ZeRO-2 (``shard_accumulator=True``): each micro-batch's gradients reduce-scattered into an
accumulator on the Zero-1 layout, against the deferred path (one reduction per step).

The fixtures of ``test_accumulate``: 4 virtual CPU devices, the small decoder, 16 rows a step.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType

from nnx_zero1 import Zero1Error, Zero1Optimizer, bytes_per_device, value_and_grad_accumulated
from nnx_zero1._src.optimizer import _is_marked
from nnx_zero1.testing import collectives, loop_collectives
from tests.support.accumulate import (
  MESH,
  MICRO,
  batch_on_mesh,
  build,
  explicit_mesh,
  params,
  tensor_parallel,
  token_batches,
  train,
)
from tests.support.accumulate import (
  zero2_accumulated as accumulated,
)
from tests.support.accumulate import (
  zero2_step as step,
)
from tests.support.helpers import (
  MLP,
  Decoder,
  assert_reordered_adam_close,
  assert_trees_close,
  assert_unchanged,
  lm_loss,
  snapshot,
)
from tests.support.helpers import loss_fn as mlp_loss
from tests.support.reference_engine import Engine, Zero1Engine


@pytest.fixture(scope="module", params=[AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def runs(request):
  """Deferred and ZeRO-2 steps side by side, three steps of four micro-batches."""
  mesh = MESH if request.param == AxisType.Explicit else explicit_mesh(kind=AxisType.Auto)
  out = {}
  for shard in (False, True):
    # adamw at 1e-3: Adam's 1/sqrt(nu) scales a last-bit difference of a near-zero gradient
    # by lr, so the tolerance tracks the learning rate, not the reduction.
    model, opt = build(Zero1Optimizer, optax.adamw(1e-3), mesh)
    losses = train(step, model, opt, token_batches(3, seed=1), mesh, shard=shard)
    out[shard] = (model, opt, losses)
  return mesh, out


def test_parameters_match_the_deferred_path_but_for_the_order_of_sums(runs):
  _, out = runs
  assert_reordered_adam_close(params(out[True][0]), params(out[False][0]), lr=1e-3, steps=3)
  assert_reordered_adam_close(out[True][1], out[False][1], lr=1e-3, steps=3)
  assert out[True][2] == pytest.approx(out[False][2], abs=1e-5)


def test_gradients_arrive_on_the_zero1_layout_marked(runs):
  mesh, out = runs
  model, opt, _ = out[True]
  with jax.set_mesh(mesh):
    _, grads = accumulated(model, opt, batch_on_mesh(token_batches(1)[0], mesh))
  assert _is_marked(grads)
  plan = opt.zero1_plan
  leaves = jax.tree.leaves(nnx.as_pure(grads))
  targets = plan.zero1_param_shardings
  assert all(g.sharding.is_equivalent_to(s, g.ndim) for g, s in zip(leaves, targets, strict=True))
  sizes = sum(x.nbytes for x in jax.tree.leaves(params(model)))
  assert bytes_per_device(nnx.as_pure(grads)) * 4 == sizes


def test_hlo_reduce_scatters_inside_the_loop_and_gathers_parameters_once_outside(runs):
  mesh, out = runs
  model, opt, _ = out[True]
  with jax.set_mesh(mesh):
    hlo = step.lower(model, opt, batch_on_mesh(token_batches(1)[0], mesh)).compile().as_text()
  sizes = [x.nbytes for x in jax.tree.leaves(params(model))]
  inside, total = loop_collectives(hlo), collectives(hlo)
  # One reduce-scatter per leaf and micro-batch, each a quarter of its gradient.
  assert inside["reduce-scatter"] == {"count": len(sizes), "bytes": sum(sizes) // 4}
  assert total["reduce-scatter"] == {"count": MICRO * len(sizes), "bytes": MICRO * sum(sizes) // 4}
  # Outside the loop nothing gradient-sized is reduced: only the scalar loss's all-reduce,
  # and the all-gather of the new parameters.
  assert inside["all-reduce"]["count"] == 0
  assert total["all-reduce"]["bytes"] <= 4 * total["all-reduce"]["count"]
  assert inside["all-gather"]["count"] == 0
  assert total["all-gather"]["bytes"] == sum(sizes)


def test_a_leaf_no_dimension_of_which_divides_is_all_reduced_next_to_the_scattered_ones():
  # The MLP's last bias (3) divides by no data size: its gradient is all-reduced each micro-batch,
  # whole on every replica, while the others are reduce-scattered in the same barrier's loop.
  with jax.set_mesh(MESH):
    model = MLP(nnx.Rngs(0))
    opt = Zero1Optimizer(model, optax.adamw(1e-3))
  rng = np.random.default_rng(0)
  batch = {"x": rng.standard_normal((16, 16), np.float32), "y": rng.standard_normal((16, 3), np.float32)}
  batch = batch_on_mesh(batch)
  mse = lambda m, b: mlp_loss(m, b["x"], b["y"])
  results = {}
  for shard in (False, True):
    with jax.set_mesh(MESH):
      run = nnx.jit(lambda m, o, b, shard=shard: value_and_grad_accumulated(
          mse, m, b, micro_batches=MICRO, optimizer=o, shard_accumulator=shard))
      results[shard] = run(model, opt, batch)
  np.testing.assert_allclose(float(results[True][0]), float(results[False][0]), rtol=1e-6)
  assert_trees_close(results[True][1], results[False][1])
  bias = results[True][1]["l3"]["bias"][...]
  assert bias.shape == (3,) and bytes_per_device(bias) == bias.nbytes


@pytest.mark.parametrize("kwargs, message", [
    ({"defer": False}, "defer_reduction=False asks for the global program"),
])
def test_conflicting_request_is_refused_and_changes_nothing(kwargs, message):
  model, opt = build(Zero1Optimizer, optax.adamw(1e-3))
  before = snapshot(model, opt)
  with pytest.raises(Zero1Error, match=message), jax.set_mesh(MESH):
    accumulated(model, opt, batch_on_mesh(token_batches(1)[0]), **kwargs)
  assert_unchanged(before, model, opt)


def test_plain_optimizer_is_refused_with_the_reason():
  model, opt = build(nnx.Optimizer, optax.adamw(1e-3))
  before = snapshot(model, opt)
  with pytest.raises(Zero1Error, match=r"Zero-1 layout, which a plain nnx.Optimizer does not have"):
    with jax.set_mesh(MESH):
      accumulated(model, opt, batch_on_mesh(token_batches(1)[0]))
  assert_unchanged(before, model, opt)


def test_sharded_parameters_are_refused_not_reduced_whole():
  mesh = explicit_mesh((2, 2), ("data", "model"), AxisType.Auto)
  model, opt = tensor_parallel(Zero1Optimizer, mesh)
  before = snapshot(model, opt)
  words = r"shard_accumulator=True needs each replica's whole gradients.*sharded"
  with pytest.raises(Zero1Error, match=words):
    train(step, model, opt, token_batches(1), mesh)
  assert_unchanged(before, model, opt)


# -- the reference engine: the same scatter_into in its micro-batch kernel ------------------------

ENGINE_MESH = explicit_mesh(kind=AxisType.Auto)


def engine_batches(n, seed=0):
  rng = np.random.default_rng(seed)
  return [{"tokens": rng.integers(0, 64, (8, 17)).astype(np.int32)} for _ in range(n)]


def make_engine(cls, shard, ckpt=None):
  return cls(Decoder(nnx.Rngs(0), vocab=64), optax.adamw(1e-3), ENGINE_MESH, loss_fn=lm_loss,
             shard_accumulator=shard, checkpoint_dir=ckpt)


@pytest.fixture(scope="module")
def engines():
  """Deferred and ZeRO-2 Zero1Engines, two steps of four micro-batches each."""
  out = {}
  data = engine_batches(8, seed=5)
  for shard in (False, True):
    engine = make_engine(Zero1Engine, shard)
    for i in range(0, 8, 4):
      for b in data[i:i + 4]:
        engine.fwd_bwd(b)
      engine.update()
    out[shard] = engine
  return out


def test_engine_matches_deferred_but_for_the_order_of_sums_with_one_nth_of_the_accumulator(engines):
  assert_reordered_adam_close(engines[True].model, engines[False].model, lr=1e-3, steps=2)
  assert_reordered_adam_close(engines[True].optimizer, engines[False].optimizer, lr=1e-3, steps=2)
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(params(engines[True].model)))
  assert bytes_per_device(engines[False]._grad_acc) == param_bytes  # one whole row per replica
  assert bytes_per_device(engines[True]._grad_acc) * 4 == param_bytes


def test_engine_hlo_reduce_scatters_per_micro_batch_and_not_in_update(engines):
  engine = engines[True]
  sizes = [x.nbytes for x in jax.tree.leaves(params(engine.model))]
  micro = collectives(engine.lowered_fwd_bwd(engine_batches(1)[0]).compile().as_text())
  update = collectives(engine.lowered_update().compile().as_text())
  assert micro["reduce-scatter"] == {"count": len(sizes), "bytes": sum(sizes) // 4}
  assert update["reduce-scatter"]["count"] == 0
  assert update["all-gather"]["bytes"] == sum(sizes)  # the new parameters, once per step
  assert update["all-reduce"]["bytes"] < 1024  # scalars only


def test_plain_engine_is_refused_and_changes_nothing():
  model = Decoder(nnx.Rngs(0), vocab=64)
  before = snapshot(model)
  with pytest.raises(Zero1Error, match=r"Engine's plain nnx.Optimizer does not have"):
    Engine(model, optax.adamw(1e-3), ENGINE_MESH, loss_fn=lm_loss, shard_accumulator=True)
  assert_unchanged(before, model)
  with pytest.raises(Zero1Error, match=r"defer_reduction=False asks for the global program"):
    Zero1Engine(model, optax.adamw(1e-3), ENGINE_MESH, loss_fn=lm_loss, shard_accumulator=True,
                defer_reduction=False)
  assert_unchanged(before, model)


@pytest.mark.parametrize(
    "source, target", [(True, False), (False, True)], ids=["zero2-to-rows", "rows-to-zero2"]
)
def test_mid_accumulation_checkpoints_cross_between_zero2_and_deferred(source, target, tmp_path):
  data = engine_batches(4, seed=9)
  first = make_engine(Zero1Engine, source, tmp_path)
  for b in data[:2]:
    first.fwd_bwd(b)
  first.save_checkpoint(0)
  for b in data[2:]:
    first.fwd_bwd(b)
  first.update()
  first.close()

  resumed = make_engine(Zero1Engine, target, tmp_path)
  assert resumed.restore_checkpoint() == 0 and int(resumed._micro_steps) == 2
  for b in data[2:]:
    resumed.fwd_bwd(b)
  resumed.update()
  assert_reordered_adam_close(resumed.model, first.model, lr=1e-3, steps=1)
  assert_reordered_adam_close(resumed.optimizer, first.optimizer, lr=1e-3, steps=1)
  resumed.close()
