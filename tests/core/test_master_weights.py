"""``master_dtype``: float32 master copies of a bfloat16 model's parameters, split over the data axis.

The reference is written here without Zero-1: a float32 copy of the model trained by a plain
``nnx.Optimizer`` on the bfloat16 model's gradients cast to float32, the bfloat16 model set to its
cast after every step. Zero-1 with ``master_dtype`` must match it bit for bit (adamw is
elementwise), on 8 virtual CPU devices; bytes from ``addressable_shards``; checkpoints via orbax.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

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
from tests.support.helpers import (
  MLP,
  Decoder,
  assert_trees_equal,
  assert_unchanged,
  batches,
  loss_fn,
  pure,
  snapshot,
  train,
)

DATA = batches(4)
LR = 3e-3
F32 = jnp.float32


def bf16_mlp(mesh, seed=0):
  """The test MLP with bfloat16 parameters."""
  with jax.set_mesh(mesh):
    model = MLP(nnx.Rngs(seed))
  nnx.update(model, jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(model, nnx.Param)))
  return model


def f32_copy(model):
  """A float32 model equal to the bfloat16 one (its masters' starting point)."""
  copy = nnx.clone(model)
  nnx.update(copy, jax.tree.map(lambda x: x.astype(F32), nnx.state(model, nnx.Param)))
  return copy


@nnx.jit
def reference_step(model, master, optimizer, x, y):
  loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
  optimizer.update(master, jax.tree.map(lambda g: g.astype(F32), grads))
  nnx.update(model, jax.tree.map(lambda p: p.astype(jnp.bfloat16), nnx.state(master, nnx.Param)))
  return loss


def mesh_of(axis_type=AxisType.Explicit):
  return jax.make_mesh((8,), ("data",), axis_types=(axis_type,))


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_trains_bit_identically_to_a_float32_master_run(axis_type):
  mesh = mesh_of(axis_type)
  model = bf16_mlp(mesh)
  opt = Zero1Optimizer(model, optax.adamw(LR), mesh, master_dtype=F32)
  ref_model = bf16_mlp(mesh)
  master = f32_copy(ref_model)
  ref = nnx.Optimizer(master, optax.adamw(LR), wrt=nnx.Param)
  losses = train(model, opt, mesh, DATA)
  sharding = NamedSharding(mesh, P("data"))
  ref_losses = [
      reference_step(ref_model, master, ref, jax.device_put(x, sharding), jax.device_put(y, sharding))
      for x, y in DATA
  ]
  np.testing.assert_array_equal(losses, np.array(ref_losses))
  assert_trees_equal(model, ref_model)
  assert_trees_equal(opt.master_params, nnx.state(master, nnx.Param))
  assert_trees_equal(opt.opt_state, ref.opt_state)


def test_bytes_per_device_master_state_and_model():
  mesh = mesh_of()
  model = bf16_mlp(mesh)
  opt = Zero1Optimizer(model, optax.adamw(LR), mesh, master_dtype=F32)
  params = nnx.as_pure(nnx.state(model, nnx.Param))
  masters = nnx.as_pure(opt.master_params)
  for p, m in zip(jax.tree.leaves(params), jax.tree.leaves(masters), strict=True):
    assert (p.dtype, m.dtype) == (jnp.bfloat16, F32)
    # float32 is twice bfloat16; split over 8 wherever the layout rule splits the parameter
    assert bytes_per_device(m) * (8 if p.shape[0] % 8 == 0 else 1) == 2 * bytes_per_device(p)
  moments = [x for x in jax.tree.leaves(nnx.as_pure(opt.opt_state)) if x.ndim]
  assert {x.dtype for x in moments} == {np.dtype(F32)}
  r = report(opt)
  assert r.master_bytes == bytes_per_device(masters)
  assert [row.path for row in r.rows if row.master][0].startswith("master_params")
  assert "master copy, sharded" in str(r)


def test_checkpoints_cross_with_a_float32_parameter_run(tmp_path):
  """Masters <-> a float32 model's parameters; the optimizer state as it is (the same tree)."""
  mesh = mesh_of()
  model = bf16_mlp(mesh)
  opt = Zero1Optimizer(model, optax.adamw(LR), mesh, master_dtype=F32)
  train(model, opt, mesh, DATA[:2])
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "master", nnx.state(opt))
  checkpointer.wait_until_finished()

  # Into a float32-parameter nnx.Optimizer run: the masters are its parameters.
  with jax.set_mesh(mesh):
    f32_model = MLP(nnx.Rngs(9))
  f32_opt = nnx.Optimizer(f32_model, optax.adamw(LR), wrt=nnx.Param)
  target = abstract_state(opt)
  restored = checkpointer.restore(tmp_path / "master", target)
  restore_into(f32_model, restored["master_params"])
  restore_into(f32_opt, {"step": restored["step"], "opt_state": restored["opt_state"]})
  assert_trees_equal(nnx.state(f32_model, nnx.Param), opt.master_params)
  assert_trees_equal(f32_opt.opt_state, opt.opt_state)

  # And back: a float32 run's parameters become the masters (and, cast, the bfloat16 model).
  checkpointer.save(tmp_path / "f32", {"model": nnx.state(f32_model, nnx.Param), "opt": nnx.state(f32_opt)})
  checkpointer.wait_until_finished()
  again_model = bf16_mlp(mesh, seed=5)
  again = Zero1Optimizer(again_model, optax.adamw(LR), mesh, master_dtype=F32)
  target = {"model": abstract_state(again)["master_params"], "opt": abstract_state(f32_opt)}
  restored = checkpointer.restore(tmp_path / "f32", target)
  restore_into(again, {**restored["opt"], "master_params": restored["model"]})
  restore_into(again_model, jax.tree.map(lambda m: m.astype(jnp.bfloat16), restored["model"]))
  assert_trees_equal(again.master_params, opt.master_params)
  assert_trees_equal(again.opt_state, opt.opt_state)
  assert_trees_equal(again_model, model)
  # Training on from there matches the run that never stopped.
  train(model, opt, mesh, DATA[2:])
  train(again_model, again, mesh, DATA[2:])
  assert_trees_equal(again_model, model)


def test_composes_with_offload_and_bfloat16_state():
  mesh = mesh_of()
  runs = []
  for options in ({}, {"offload_state_to_host": True}):
    model = bf16_mlp(mesh)
    opt = Zero1Optimizer(model, optax.adamw(LR), mesh, master_dtype=F32, state_dtype=jnp.bfloat16, **options)
    train(model, opt, mesh, DATA[:2])
    runs.append((model, opt))
  kinds = {x.sharding.memory_kind for x in jax.tree.leaves(nnx.as_pure(runs[1][1].master_params))}
  assert kinds == {"pinned_host"}
  assert {x.dtype for x in jax.tree.leaves(nnx.as_pure(runs[0][1].opt_state)) if x.ndim} == {
      np.dtype(jnp.bfloat16)}
  assert_trees_equal(runs[0][0], runs[1][0])
  assert_trees_equal(runs[0][1], runs[1][1])


def test_every_entry_point_keeps_master_copies():
  mesh = mesh_of()
  model = bf16_mlp(mesh)
  with zero1_optimizers(mesh, master_dtype=F32) as built:
    nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  assert report(built[0]).master_bytes > 0

  class Trainer:
    def __init__(self, model, tx):
      self.optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  class MasterTrainer(ShardedOptimizerMixin, Trainer):
    zero1_master_dtype = F32

  with jax.set_mesh(mesh):
    assert report(MasterTrainer(model, optax.adam(1e-3)).optimizer).master_bytes > 0
  assert report(Zero1ModelAndOptimizer(model, optax.adam(1e-3), mesh, master_dtype=F32)).master_bytes > 0

  from tests.support.helpers import Decoder, lm_loss
  from tests.support.reference_engine import Zero1Engine

  class MasterEngine(Zero1Engine):
    MASTER_DTYPE = F32
    STATE_DTYPE = jnp.bfloat16

  decoder = Decoder(nnx.Rngs(0), vocab=64)
  nnx.update(decoder, jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(decoder, nnx.Param)))
  engine = MasterEngine(decoder, optax.adamw(1e-2), jax.make_mesh((4,), ("data",), devices=jax.devices()[:4]),
                        loss_fn=lm_loss)
  engine.fwd_bwd({"tokens": np.random.default_rng(0).integers(0, 64, (8, 17)).astype(np.int32)})
  engine.update()
  assert report(engine.optimizer).master_bytes > 0
  assert {x.dtype for x in jax.tree.leaves(nnx.as_pure(engine.optimizer.opt_state)) if x.ndim} == {
      np.dtype(jnp.bfloat16)}
  assert {x.dtype for x in jax.tree.leaves(nnx.state(engine.model, nnx.Param))} == {np.dtype(jnp.bfloat16)}


def test_tunix_trainer_takes_both_bfloat16_levers_from_its_config():
  from nnx_zero1.adapters.tunix import Zero1PeftTrainer, Zero1TrainingConfig
  from tests.support.tunix_toys import model_input, sft_batches, toy

  mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tp"), axis_types=(AxisType.Auto,) * 3)
  cfg = Zero1TrainingConfig(
      eval_every_n_steps=1000, max_steps=2, data_sharding_axis=(("data", "fsdp"),), zero1_master_dtype=F32,
      zero1_state_dtype=jnp.bfloat16,
  )
  with mesh:
    model = toy(mesh, lora=False)
    nnx.update(model, jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(model, nnx.Param)))
    trainer = Zero1PeftTrainer(model, optax.adamw(1e-2), cfg).with_gen_model_input_fn(model_input)
    before = pure(trainer.optimizer.master_params)
    trainer.train(sft_batches(2))
  assert int(trainer.optimizer.step[...]) == 2
  moments = [x for x in jax.tree.leaves(nnx.as_pure(trainer.optimizer.opt_state)) if x.ndim]
  assert {x.dtype for x in moments} == {np.dtype(jnp.bfloat16)}
  after = pure(trainer.optimizer.master_params)
  assert any(not np.array_equal(a, b) for a, b in zip(before, after, strict=True))
  for m, p in zip(after, pure(nnx.state(trainer.model, nnx.Param)), strict=True):
    np.testing.assert_array_equal(m.astype(jnp.bfloat16), p)  # the model is its masters' cast


@pytest.mark.parametrize(
    "dtype, model_dtype, words",
    [
        (jnp.int32, jnp.bfloat16, "not a floating dtype"),
        (F32, F32, "every parameter is float32 already"),
        (jnp.bfloat16, F32, "narrower than parameter"),
    ],
)
def test_bad_master_dtype_is_refused_before_anything_changes(dtype, model_dtype, words):
  mesh = mesh_of()
  model = bf16_mlp(mesh)
  nnx.update(model, jax.tree.map(lambda x: x.astype(model_dtype), nnx.state(model, nnx.Param)))
  before = snapshot(model)
  with pytest.raises(Zero1Error, match=words):
    Zero1Optimizer(model, optax.adamw(LR), mesh, master_dtype=dtype)
  assert_unchanged(before, model)


def test_an_integer_parameter_is_refused():
  mesh = mesh_of()
  model = bf16_mlp(mesh)
  model.l3.bias = nnx.Param(jax.device_put(jnp.zeros((3,), jnp.int32), NamedSharding(mesh, P())))
  with pytest.raises(Zero1Error, match=r"\['l3'\]\['bias'\] is int32, not floating"):
    Zero1Optimizer(model, optax.sgd(LR), mesh, master_dtype=F32)


def test_master_dtype_needs_a_mesh():
  model = MLP(nnx.Rngs(0))
  with pytest.raises(Zero1Error, match="master_dtype=.* needs a mesh"):
    Zero1Optimizer(model, optax.adamw(LR), master_dtype=F32)


def test_without_master_dtype_the_state_tree_is_nnx_optimizers():
  mesh = mesh_of()
  model = bf16_mlp(mesh)
  plain = nnx.Optimizer(model, optax.adamw(LR), wrt=nnx.Param)
  ours = Zero1Optimizer(model, optax.adamw(LR), mesh)
  assert jax.tree.structure(nnx.as_pure(nnx.state(ours))) == jax.tree.structure(nnx.as_pure(nnx.state(plain)))
  assert not hasattr(ours, "master_params")


def test_composes_with_zero2():
  """ZeRO-2's reduce-scattered gradients (bfloat16 here) feed the float32 masters as the deferred
  path's do: the two runs differ only in the order of their sums."""
  from tests.support.accumulate import batch_on_mesh, token_batches
  from tests.support.accumulate import zero2_step as step
  from tests.support.helpers import assert_reordered_adam_close

  mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  runs = []
  for shard in (False, True):
    with jax.set_mesh(mesh):
      model = Decoder(nnx.Rngs(0), vocab=64)
    nnx.update(model, jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(model, nnx.Param)))
    opt = Zero1Optimizer(model, optax.adamw(1e-3), mesh, master_dtype=F32)
    with jax.set_mesh(mesh):
      for batch in token_batches(2, seed=1):
        step(model, opt, batch_on_mesh(batch, mesh), shard=shard)
    runs.append(opt)
  # bfloat16 gradient sums round at 2**-9, so another summation order moves more elements past
  # 1e-5 than float32 sums do (2.3% here); a wrong reduction would move nearly all of them.
  assert_reordered_adam_close(runs[1].master_params, runs[0].master_params, lr=1e-3, steps=2, share=0.05)
