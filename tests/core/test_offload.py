"""Host offload (``offload_state_to_host=True``): the state's Zero-1 shards in ``pinned_host``
memory between steps, bit-identical to the state kept on device, on 8 virtual CPU devices
(jax's CPU devices address ``device``, ``pinned_host`` and ``unpinned_host``)."""

import jax
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
from nnx_zero1._src.storage import check_host_memory
from tests.support.helpers import (
  MLP,
  assert_fraction_kept_on_device,
  assert_trees_equal,
  assert_unchanged,
  batches,
  bytes_by_kind,
  pure,
  snapshot,
  train,
)

DATA = batches(3)


def kinds(opt):
  """The memory kind of every shard of every optimizer-state array, from ``addressable_shards``."""
  leaves = jax.tree.leaves(nnx.as_pure(opt.opt_state))
  return {shard.data.sharding.memory_kind for leaf in leaves for shard in leaf.addressable_shards}


def build(mesh, offload, tx=None, seed=0):
  with jax.set_mesh(mesh):
    model = MLP(nnx.Rngs(seed))
  return model, Zero1Optimizer(model, tx or optax.adamw(1e-3), mesh, offload_state_to_host=offload)


@pytest.fixture(scope="module", params=[AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def trained(request):
  """On-device and offloaded optimizers trained side by side (jit), per mesh axis type."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(request.param,))
  runs = {}
  for offload in (False, True):
    model, opt = build(mesh, offload)
    assert kinds(opt) == {"pinned_host" if offload else "device"}
    losses = train(model, opt, mesh, DATA)
    runs[offload] = (model, opt, losses)
  return mesh, runs


def test_offloaded_training_is_bit_identical_under_jit(trained):
  _, runs = trained
  for a, b in zip(runs[False], runs[True], strict=True):
    if isinstance(a, np.ndarray):
      np.testing.assert_array_equal(a, b)
    else:
      assert_trees_equal(a, b)


def test_state_stays_in_host_memory_with_the_same_layout(trained):
  _, runs = trained
  on_device, offloaded = runs[False][1], runs[True][1]
  assert kinds(offloaded) == {"pinned_host"}
  assert kinds(on_device) == {"device"}
  for a, b in zip(*(jax.tree.leaves(nnx.as_pure(o.opt_state)) for o in (on_device, offloaded)), strict=True):
    assert b.sharding.spec == a.sharding.spec and b.shape == a.shape and b.dtype == a.dtype
  held = [bytes_per_device(nnx.as_pure(o.opt_state)) for o in (offloaded, on_device)]
  assert held[0] == held[1] > 0
  assert offloaded.step.get_value().sharding.memory_kind == "device"  # the step count stays on device


def test_report_says_where_each_leaf_lives(trained):
  _, runs = trained
  host, dev = report(runs[True][1]), report(runs[False][1])
  assert {r.memory_kind for r in host.rows} == {"pinned_host"}
  assert {r.memory_kind for r in dev.rows} == {"device"}
  assert host.device_resident_bytes == 0 and host.host_bytes == host.per_device_bytes > 0
  assert dev.host_bytes == 0 and dev.device_resident_bytes == dev.per_device_bytes == host.per_device_bytes
  assert "pinned_host" in str(host)


def test_eager_update_is_bit_identical_and_stays_on_host(trained):
  mesh, _ = trained
  x, y = DATA[0]
  runs = []
  for offload in (False, True):
    model, opt = build(mesh, offload, tx=optax.sgd(0.1, momentum=0.9), seed=1)
    with jax.set_mesh(mesh):
      grads = nnx.grad(lambda m: ((m(x) - y) ** 2).mean())(model)
      opt.update(model, grads)
    runs.append((model, opt))
  assert kinds(runs[1][1]) == {"pinned_host"}
  assert_trees_equal(runs[0][0], runs[1][0])
  assert_trees_equal(runs[0][1], runs[1][1])


def test_checkpoints_cross_between_offloaded_and_on_device(trained, tmp_path):
  mesh, runs = trained
  checkpointer = ocp.StandardCheckpointer()
  for i, (source_offload, target_offload) in enumerate([(True, False), (False, True)]):
    source = runs[source_offload][1]
    path = tmp_path / str(i)
    checkpointer.save(path, nnx.state(source))
    checkpointer.wait_until_finished()
    _, target = build(mesh, target_offload, seed=5)
    assert jax.tree.structure(nnx.state(target)) == jax.tree.structure(nnx.state(source))
    restore_into(target, checkpointer.restore(path, abstract_state(target)))
    assert_trees_equal(target, source)
    assert kinds(target) == {"pinned_host" if target_offload else "device"}


def test_restored_offloaded_optimizer_trains_on(trained, tmp_path):
  """A device-resident checkpoint restored into an offloaded optimizer continues bit-identically."""
  mesh, _ = trained
  results = []
  for offload in (False, True):
    model, opt = build(mesh, False, seed=3)
    train(model, opt, mesh, DATA[:1])
    checkpointer = ocp.StandardCheckpointer()
    path = tmp_path / f"leg{offload}"
    checkpointer.save(path, {"model": nnx.state(model), "opt": nnx.state(opt)})
    checkpointer.wait_until_finished()
    model2, opt2 = build(mesh, offload, seed=4)
    target = {"model": abstract_state(model2), "opt": abstract_state(opt2)}
    restored = checkpointer.restore(path, target)
    restore_into(model2, restored["model"])
    restore_into(opt2, restored["opt"])
    train(model2, opt2, mesh, DATA[1:])
    results.append((model2, opt2))
  assert_trees_equal(results[0][0], results[1][0])
  assert_trees_equal(results[0][1], results[1][1])


def test_scope_and_mixin_build_offloaded_optimizers():
  mesh = jax.make_mesh((8,), ("data",))
  with jax.set_mesh(mesh):
    model = MLP(nnx.Rngs(0))
  with zero1_optimizers(mesh, offload_state_to_host=True) as built:
    nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  assert kinds(built[0]) == {"pinned_host"}

  class Trainer:
    def __init__(self, model, tx):
      self.optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  class OffloadTrainer(ShardedOptimizerMixin, Trainer):
    zero1_offload_state_to_host = True

  with jax.set_mesh(mesh):
    trainer = OffloadTrainer(model, optax.adam(1e-3))
  assert kinds(trainer.optimizer) == {"pinned_host"}

  both = Zero1ModelAndOptimizer(model, optax.adam(1e-3), mesh, offload_state_to_host=True)
  assert kinds(both) == {"pinned_host"}
  assert bytes_per_device(nnx.state(both.opt_state)) == bytes_per_device(nnx.state(built[0].opt_state))


def test_offload_without_a_mesh_is_refused_and_changes_nothing():
  model = MLP(nnx.Rngs(0))  # one device, no mesh
  before = snapshot(model)
  with pytest.raises(Zero1Error, match=r"offload_state_to_host=True needs a mesh"):
    Zero1Optimizer(model, optax.adam(1e-3), offload_state_to_host=True)
  assert_unchanged(before, model)


def test_backend_without_host_memory_is_refused():
  check_host_memory({"TPU_0": ("device", "pinned_host"), "CPU_1": ("device", "pinned_host", "unpinned_host")})
  words = r"needs host memory \('pinned_host'\).*GPU_3 can address only \['device'\]"
  with pytest.raises(Zero1Error, match=words):
    check_host_memory({"GPU_2": ("device", "pinned_host"), "GPU_3": ("device",)}, "mesh axes ('data',)")
  with pytest.raises(Zero1Error, match=r"offload_state_to_host=0.25 needs host memory"):  # the fraction asked
    check_host_memory({"GPU_3": ("device",)}, asked=0.25)


def test_values_unchanged_by_offload_after_each_step():
  """Step by step (not only at the end): the offloaded state equals the on-device state."""
  mesh = jax.make_mesh((8,), ("data",))
  pairs = [build(mesh, offload, tx=optax.adafactor(1e-2), seed=2) for offload in (False, True)]
  for batch in DATA:
    for model, opt in pairs:
      train(model, opt, mesh, [batch])
    assert pure(pairs[0][1]) and all(
        np.array_equal(a, b) for a, b in zip(pure(pairs[0][1]), pure(pairs[1][1]), strict=True)
    )
  assert kinds(pairs[1][1]) == {"pinned_host"}


def test_engine_offloads_and_checkpoints_cross_mid_accumulation(tmp_path):
  """The reference Zero1Engine with OFFLOAD_STATE_TO_HOST: bit-identical steps, and a checkpoint
  written mid-accumulation by the offloaded engine resumes in the on-device one (and back)."""
  from tests.support.helpers import Decoder, lm_loss
  from tests.support.reference_engine import Zero1Engine

  class OffloadEngine(Zero1Engine):
    OFFLOAD_STATE_TO_HOST = True

  mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  rng = np.random.default_rng(0)
  data = [{"tokens": rng.integers(0, 64, (8, 17)).astype(np.int32)} for _ in range(4)]

  def make(cls, ckpt):
    return cls(Decoder(nnx.Rngs(0), vocab=64), optax.adamw(1e-2), mesh, loss_fn=lm_loss, checkpoint_dir=ckpt)

  finished = {}
  for cls in (Zero1Engine, OffloadEngine):
    engine = make(cls, tmp_path / cls.__name__)
    for b in data[:2]:
      engine.fwd_bwd(b)
    engine.save_checkpoint(0)
    for b in data[2:]:
      engine.fwd_bwd(b)
    engine.update()
    engine.close()
    finished[cls] = engine
  assert kinds(finished[OffloadEngine].optimizer) == {"pinned_host"}
  assert_trees_equal(finished[OffloadEngine].model, finished[Zero1Engine].model)
  assert_trees_equal(finished[OffloadEngine].optimizer, finished[Zero1Engine].optimizer)

  for source, target in ((OffloadEngine, Zero1Engine), (Zero1Engine, OffloadEngine)):
    resumed = make(target, tmp_path / source.__name__)
    assert resumed.restore_checkpoint() == 0
    for b in data[2:]:
      resumed.fwd_bwd(b)
    resumed.update()
    assert kinds(resumed.optimizer) == {"pinned_host" if target is OffloadEngine else "device"}
    assert_trees_equal(resumed.model, finished[source].model)
    assert_trees_equal(resumed.optimizer, finished[source].optimizer)
    resumed.close()


def test_tunix_trainer_offloads_through_its_config(tmp_path):
  """All of the state, and half of it (``zero1_offload_state_to_host=0.5``), through Tunix's config."""
  from tunix.sft import peft_trainer

  from nnx_zero1.adapters.tunix import Zero1PeftTrainer, Zero1TrainingConfig
  from tests.support.tunix_toys import model_input, sft_batches, toy

  mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tp"), axis_types=(AxisType.Auto,) * 3)
  trained = []
  for offload in (False, True, 0.5):
    cfg = Zero1TrainingConfig(
        eval_every_n_steps=1000, max_steps=2, data_sharding_axis=(("data", "fsdp"),),
        zero1_offload_state_to_host=offload,
    )
    with mesh:
      trainer = Zero1PeftTrainer(toy(mesh, lora=False), optax.adamw(1e-2), cfg)
      trainer = trainer.with_gen_model_input_fn(model_input)
      trainer.train(sft_batches(2))
    assert isinstance(trainer, peft_trainer.PeftTrainer)
    trained.append(trainer)
  assert kinds(trained[1].optimizer) == {"pinned_host"}
  assert_fraction_kept_on_device(trained[2].optimizer, 0.5, bytes_by_kind(trained[0].optimizer)["device"])
  for other in trained[1:]:
    assert_trees_equal(trained[0].model, other.model)
    assert_trees_equal(trained[0].optimizer, other.optimizer)
