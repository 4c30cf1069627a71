"""``state_dtype``: the optimizer state stored in bfloat16 between steps, computed in float32.

Compared value by value against a plain ``nnx.Optimizer`` whose transformation narrows its
state the same way (a wrapper written here), on 8 virtual CPU devices; placement and dtypes
from ``addressable_shards``; collectives from the compiled HLO; checkpoints through orbax on disk.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import AxisType

from nnx_zero1 import (
  ShardedOptimizerMixin,
  Zero1Error,
  Zero1ModelAndOptimizer,
  Zero1Optimizer,
  abstract_state,
  bytes_per_device,
  report,
  restore_into,
  zero1_optimizers,
)
from nnx_zero1._src.storage import stochastic_round
from nnx_zero1.testing import collectives
from tests.support.helpers import (
  MLP,
  assert_trees_equal,
  assert_unchanged,
  batches,
  loss_fn,
  pure,
  snapshot,
  train,
  train_step,
)

DATA = batches(3)
LR = 3e-3


def narrowed(tx: optax.GradientTransformation, rounding: str) -> optax.GradientTransformation:
  """``tx`` whose floating, non-scalar state is stored in bfloat16 between steps: the reference.

  Its own step count rides behind the inner state, so the inner leaves keep their indices
  (which, with the count, seed the stochastic rounding).
  """
  def down(state, count):
    leaves, treedef = jax.tree.flatten(state)
    nearest = count is None or rounding == "nearest"
    out = []
    for i, x in enumerate(leaves):
      if x.ndim and jnp.issubdtype(x.dtype, jnp.floating):
        key = None if nearest else jax.random.fold_in(jax.random.fold_in(jax.random.key(0), count), i)
        x = x.astype(jnp.bfloat16) if nearest else stochastic_round(x, key)
      out.append(x)
    return jax.tree.unflatten(treedef, out)

  def init(params):
    return down(tx.init(params), None), jnp.zeros((), jnp.uint32)

  def update(grads, state, params=None):
    inner, count = state
    wide = jax.tree.map(lambda x: x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x, inner)
    updates, new = tx.update(grads, wide, params)
    return updates, (down(new, count), count + 1)

  return optax.GradientTransformation(init, update)


def eager_step(model, opt, x, y):
  loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
  opt.update(model, grads)
  return loss


def build(mesh, **options):
  with jax.set_mesh(mesh):
    model = MLP(nnx.Rngs(0))
  return model, Zero1Optimizer(model, optax.adamw(LR), mesh, **options)


def mesh_of(axis_type=AxisType.Explicit):
  return jax.make_mesh((8,), ("data",), axis_types=(axis_type,))


@pytest.mark.parametrize(
    "axis_type, rounding", [(AxisType.Auto, "stochastic"), (AxisType.Explicit, "nearest")],
    ids=["auto-stochastic", "explicit-nearest"],
)
def test_trains_bit_identically_to_a_plain_optimizer_that_narrows_the_same_way(axis_type, rounding):
  mesh = mesh_of(axis_type)
  model, opt = build(mesh, state_dtype=jnp.bfloat16, state_rounding=rounding)
  with jax.set_mesh(mesh):
    ref_model = MLP(nnx.Rngs(0))
  ref = nnx.Optimizer(ref_model, narrowed(optax.adamw(LR), rounding), wrt=nnx.Param)
  losses = train(model, opt, mesh, DATA)
  ref_losses = train(ref_model, ref, mesh, DATA)
  np.testing.assert_array_equal(losses, ref_losses)
  assert_trees_equal(model, ref_model)
  assert_trees_equal(opt.opt_state, ref.opt_state[0])  # the reference's own count rides behind


def test_eager_update_matches_the_jitted_one():
  mesh = mesh_of()
  jitted_model, jitted = build(mesh, state_dtype=jnp.bfloat16)
  eager_model, eager = build(mesh, state_dtype=jnp.bfloat16)
  train(jitted_model, jitted, mesh, DATA[:1])
  with jax.set_mesh(mesh):
    train(eager_model, eager, mesh, DATA[:1], step=eager_step)
  assert stored_dtypes(eager) == BF16
  # The same stochastic rounding eager and jitted: the state agrees to the bit wherever the
  # moments do (plain nnx.Optimizer differs eager vs jit in the last bits of some gradients).
  for e, j in zip(pure(eager.opt_state), pure(jitted.opt_state), strict=True):
    np.testing.assert_allclose(e.astype(np.float32), j.astype(np.float32), rtol=2**-7, atol=1e-6)


def test_state_is_half_the_bytes_on_the_same_layout():
  mesh = mesh_of()
  _, wide = build(mesh)
  _, narrow = build(mesh, state_dtype=jnp.bfloat16)
  wide_leaves = jax.tree.leaves(nnx.as_pure(wide.opt_state))
  narrow_leaves = jax.tree.leaves(nnx.as_pure(narrow.opt_state))
  for w, n in zip(wide_leaves, narrow_leaves, strict=True):
    assert n.sharding == w.sharding and n.shape == w.shape
    if w.ndim:
      assert (w.dtype, n.dtype) == (jnp.float32, jnp.bfloat16)
      assert bytes_per_device(n) * 2 == bytes_per_device(w)
    else:
      assert n.dtype == w.dtype  # the count is untouched
  rows = report(narrow).rows
  assert [r.dtype for r in rows if r.shape] == ["bfloat16"] * (len(rows) - 1)
  assert {r.compute_dtype for r in rows if r.shape} == {"float32"}
  assert report(narrow).unsharded_bytes == report(wide).unsharded_bytes  # nnx.Optimizer keeps float32
  assert "bfloat16 (float32 in update)" in str(report(narrow))


def test_adds_no_collective():
  mesh = mesh_of()
  x, y = DATA[0]
  counts = []
  for options in ({}, {"state_dtype": jnp.bfloat16}):
    model, opt = build(mesh, **options)
    with jax.set_mesh(mesh):
      text = train_step.lower(model, opt, x, y).compile().as_text()
    counts.append({k: v["count"] for k, v in collectives(text).items()})
  assert counts[0] == counts[1]


def test_nearest_rounding_cannot_decay_adams_second_moment_and_stochastic_can():
  nu = jnp.full((4096,), 1.0, jnp.bfloat16)
  decayed = 0.999 * nu.astype(jnp.float32)  # b2 with a zero gradient
  assert np.all(np.asarray(decayed.astype(jnp.bfloat16)) == 1.0)  # nearest: stuck
  kept = stochastic_round(decayed, jax.random.key(1)).astype(jnp.float32)
  assert set(np.unique(np.asarray(kept))) == {np.float32(jnp.bfloat16(0.99609375)), 1.0}
  assert abs(float(kept.mean()) - 0.999) < 5e-4  # unbiased


def test_checkpoint_restores_into_float32_state_and_back(tmp_path):
  mesh = mesh_of()
  model, opt = build(mesh, state_dtype=jnp.bfloat16)
  train(model, opt, mesh, DATA[:2])
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "bf16", nnx.state(opt))
  checkpointer.wait_until_finished()
  # Into float32 state: orbax casts to the target's dtype (exact, bfloat16 widens).
  _, wide = build(mesh)
  restore_into(wide, checkpointer.restore(tmp_path / "bf16", abstract_state(wide)))
  for n, w in zip(pure(opt.opt_state), pure(wide.opt_state), strict=True):
    assert w.dtype == (np.float32 if n.ndim else n.dtype)
    np.testing.assert_array_equal(n.astype(w.dtype), w)
  # And back: a float32 checkpoint into bfloat16 state (rounded to nearest by orbax's cast).
  checkpointer.save(tmp_path / "f32", nnx.state(wide))
  checkpointer.wait_until_finished()
  _, again = build(mesh, state_dtype=jnp.bfloat16)
  restore_into(again, checkpointer.restore(tmp_path / "f32", abstract_state(again)))
  assert_trees_equal(again.opt_state, opt.opt_state)
  assert bytes_per_device(nnx.as_pure(again.opt_state)) == bytes_per_device(nnx.as_pure(opt.opt_state))


@pytest.mark.parametrize(
    "options, words",
    [
        ({"state_dtype": jnp.int8}, "not a floating dtype"),
        ({"state_dtype": "not-a-dtype"}, "not a dtype"),
        ({"state_dtype": jnp.bfloat16, "state_rounding": "up"}, "state_rounding='up'"),
        ({"state_dtype": jnp.float16}, "bfloat16 only"),
    ],
)
def test_bad_state_dtype_is_refused_before_anything_changes(options, words):
  mesh = mesh_of()
  with jax.set_mesh(mesh):
    model = MLP(nnx.Rngs(0))
  before = snapshot(model)
  with pytest.raises(Zero1Error, match=words):
    Zero1Optimizer(model, optax.adamw(LR), mesh, **options)
  assert_unchanged(before, model)


@pytest.mark.parametrize(
    "model_dtype, tx", [(jnp.bfloat16, optax.adamw(LR)), (jnp.float32, optax.sgd(LR))],
    ids=["bf16-adamw", "sgd"],
)
def test_a_state_dtype_that_changes_nothing_is_refused(model_dtype, tx):
  """A bfloat16 model's adam moments are bfloat16 already; plain sgd has no state: both say so."""
  mesh = mesh_of()
  with jax.set_mesh(mesh):
    model = MLP(nnx.Rngs(0))
  nnx.update(model, jax.tree.map(lambda x: x.astype(model_dtype), nnx.state(model, nnx.Param)))
  before = snapshot(model)
  with pytest.raises(Zero1Error, match="state_dtype=bfloat16 changes nothing"):
    Zero1Optimizer(model, tx, mesh, state_dtype=jnp.bfloat16)
  assert_unchanged(before, model)


def test_state_dtype_needs_a_mesh():
  model = MLP(nnx.Rngs(0))
  with pytest.raises(Zero1Error, match="needs a mesh"):
    Zero1Optimizer(model, optax.adamw(LR), state_dtype=jnp.bfloat16)


def test_float16_rounded_to_nearest_is_allowed():
  mesh = mesh_of()
  model, opt = build(mesh, state_dtype=jnp.float16, state_rounding="nearest")
  train(model, opt, mesh, DATA[:1])
  assert {x.dtype for x in jax.tree.leaves(nnx.as_pure(opt.opt_state)) if x.ndim} == {np.dtype(jnp.float16)}


def stored_dtypes(opt):
  """The dtypes of the non-scalar optimizer-state arrays, as they are held between steps."""
  return {x.dtype for x in jax.tree.leaves(nnx.as_pure(opt.opt_state)) if x.ndim}


BF16 = {np.dtype(jnp.bfloat16)}


def test_scope_mixin_and_model_and_optimizer_store_bfloat16_state():
  mesh = mesh_of()
  with jax.set_mesh(mesh):
    model = MLP(nnx.Rngs(0))
  with zero1_optimizers(mesh, state_dtype=jnp.bfloat16) as built:
    nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  assert stored_dtypes(built[0]) == BF16

  class Trainer:
    def __init__(self, model, tx):
      self.optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  class Bf16Trainer(ShardedOptimizerMixin, Trainer):
    zero1_state_dtype = jnp.bfloat16

  with jax.set_mesh(mesh):
    assert stored_dtypes(Bf16Trainer(model, optax.adam(1e-3)).optimizer) == BF16
  both = Zero1ModelAndOptimizer(model, optax.adam(1e-3), mesh, state_dtype=jnp.bfloat16)
  assert stored_dtypes(both) == BF16
  with pytest.raises(Zero1Error, match="not a floating dtype"):
    with zero1_optimizers(mesh, state_dtype=jnp.int32):
      pass
