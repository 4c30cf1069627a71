"""``Zero1MaxTextTrainingEngine`` against MaxText's own ``MaxTextTrainingEngine`` (maxtext, Python >= 3.12).

The real engine, a 2-layer 32-wide decoder from MaxText's ``base.yml``, 4 of the
8 virtual CPU devices. Skipped (with the reason) where maxtext cannot be imported,
except the test that the import fails cleanly there.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging

import jax
import numpy as np
import pytest
from flax import nnx

from nnx_zero1 import Zero1Error, bytes_per_device
from nnx_zero1.testing import collectives
from tests.support.helpers import (
  assert_reordered_adam_close,
  assert_trees_equal,
  maxtext_process_settings_put_back,
)

N = 4


SKIP = None if importlib.util.find_spec("maxtext") else (
    "maxtext is not installed here (pip install --no-deps maxtext==0.2.5 on Python >= 3.12, with "
    ".ci/requirements-newest.txt; the CI's Python 3.12 lane has it)"
)
needs_maxtext = pytest.mark.skipif(SKIP is not None, reason=str(SKIP))


process_settings_put_back = pytest.fixture(scope="module", autouse=True)(maxtext_process_settings_put_back)


@pytest.mark.skipif(importlib.util.find_spec("maxtext") is not None, reason="maxtext is installed")
def test_without_maxtext_the_import_fails_clearly_and_the_mixin_still_works():
  from nnx_zero1.adapters import maxtext as adapter

  with pytest.raises(ImportError, match="Zero1MaxTextTrainingEngine needs MaxText's engine"):
    from nnx_zero1.adapters.maxtext import Zero1MaxTextTrainingEngine  # noqa: F401
  assert adapter.Zero1EngineMixin
  # The reference engine (tests.support.reference_engine) is test scaffolding, not the adapter's.
  assert not hasattr(adapter, "Engine") and not hasattr(adapter, "Zero1Engine")
  with pytest.raises(AttributeError):
    adapter.NoSuchThing  # noqa: B018


def _classes():
  from nnx_zero1.adapters.maxtext import Zero1MaxTextTrainingEngine  # first: supplies the Tunix types

  stock = importlib.import_module("maxtext.training_engine.maxtext_engine").MaxTextTrainingEngine
  return stock, Zero1MaxTextTrainingEngine


def build(cls, **overrides):
  from tests.support.maxtext_toys import tiny_config, tiny_mesh

  config = tiny_config(**overrides)
  return cls(config, mesh=tiny_mesh(config)), config


def step(engine, batches):
  for b in batches:
    engine.fwd_bwd(b)
  return engine.update()


def params(engine):
  return jax.tree.map(np.asarray, nnx.state(engine.model, nnx.Param))


def moments(engine):
  """The parameter-shaped optimizer leaves (not scalars, not skip_step_on_spikes' loss buffers)."""
  shapes = {x.shape for x in jax.tree.leaves(nnx.state(engine.model, nnx.Param))}
  state = jax.tree.leaves(nnx.state(engine.optimizer)["opt_state"])
  return [x for x in state if x.ndim and x.shape in shapes]


@pytest.fixture(scope="module", params=["adamw", "sgd"])
def pair(request):
  """MaxText's engine and ours side by side: one step at GA 1, then one at GA 4."""
  if SKIP:
    pytest.skip(SKIP)
  from tests.support.maxtext_toys import tiny_batches

  engines = [build(cls, opt_type=request.param)[0] for cls in _classes()]
  config = engines[0]._config
  batches = tiny_batches(config, 5)
  engines[0].compile(batches[0])
  engines[1].compile(batches[0])
  phases = {}
  for ga, chunk in ((1, batches[:1]), (4, batches[1:])):
    phases[ga] = [(step(e, chunk), params(e)) for e in engines]
  return request.param, engines, phases, batches


@needs_maxtext
def test_same_constructor():
  stock, ours = _classes()
  assert inspect.signature(ours) == inspect.signature(stock)
  assert issubclass(ours, stock)


@needs_maxtext
def test_the_engine_reads_every_memory_lever_of_the_record_by_its_name():
  # Drift fails here: a lever added to Zero1Options that the engine has no attribute for.
  import dataclasses

  from nnx_zero1 import Zero1Options
  from nnx_zero1._src.options import levers_of

  _, ours = _classes()
  levers = {f.name: f.default for f in dataclasses.fields(Zero1Options) if f.metadata.get("lever")}
  assert levers_of(ours, str.upper) == levers


@needs_maxtext
@pytest.mark.parametrize("ga", [1, 4])
def test_parameters_bit_identical_to_maxtext_engine(pair, ga):
  _, _, phases, _ = pair
  (stock_step, stock), (ours_step, ours) = phases[ga]
  assert stock_step == ours_step
  assert_trees_equal(ours, stock)


@needs_maxtext
def test_optimizer_bytes_per_device_are_one_nth(pair):
  name, (stock, ours), _, _ = pair
  if name == "sgd":
    assert moments(stock) == [] and moments(ours) == []
    return
  assert bytes_per_device(moments(ours)) * N == bytes_per_device(moments(stock))
  for e in (stock, ours):
    for leaf in jax.tree.leaves(nnx.state(e.model, nnx.Param)):
      assert leaf.sharding.is_fully_replicated


@needs_maxtext
def test_update_reduce_scatters_deferred_gradients(pair):
  """Deferred (pure data parallelism, explicit): MaxText's update all-reduces the gradients;
  ours reduce-scatters each onto its Zero-1 slice and all-gathers the new parameters."""
  _, (stock, ours), _, batches = pair
  sizes = [x.nbytes for x in jax.tree.leaves(nnx.state(ours.model, nnx.Param))]
  kernels = {e: e._lower_kernels(batches[0]) for e in (stock, ours)}
  for e in (stock, ours):  # no gradient all-reduce per micro-batch
    assert collectives(kernels[e]["fwd_bwd_accum"].compile().as_text())["all-reduce"]["bytes"] < min(sizes)
  theirs = collectives(kernels[stock]["update"].compile().as_text())
  assert theirs["all-reduce"]["bytes"] >= sum(sizes) and theirs["reduce-scatter"]["count"] == 0
  mine = collectives(kernels[ours]["update"].compile().as_text())
  assert mine["reduce-scatter"] == {"count": len(sizes), "bytes": sum(sizes) // N}
  assert mine["all-gather"]["bytes"] == sum(sizes)
  assert mine["all-reduce"]["bytes"] < min(sizes)  # the gradient norm's partial sums only


def _checkpointed(cls, directory):
  # MaxText derives checkpoint_dir from base_output_directory and run_name.
  return build(cls, enable_checkpointing=True, base_output_directory=str(directory))[0]


def _mid_step_handoffs(writer_cls, reader_classes, directory, seed, hand_over=False):
  """Per reader class: the writer runs two micro-batches and saves mid-step, a fresh engine of
  that class restores it; yields (reader class, writer, reader, the step's other micro-batches).
  With ``hand_over`` the reader is the next round's writer."""
  from tests.support.maxtext_toys import tiny_batches

  writer = _checkpointed(writer_cls, directory)
  batches = tiny_batches(writer._config, 9, seed=seed)
  writer.compile(batches[0])
  step(writer, batches[:1])
  for reader_cls, chunk in zip(reader_classes, (batches[1:5], batches[5:9]), strict=True):
    for b in chunk[:2]:
      writer.fwd_bwd(b)
    writer.save_checkpoint(metadata=None, force=True)
    reader = _checkpointed(reader_cls, directory)
    reader.compile(batches[0])
    reader.restore_checkpoint()
    assert reader.micro_step_count == 2
    yield reader_cls, writer, reader, chunk[2:]
    if hand_over:
      writer = reader


@needs_maxtext
def test_checkpoints_cross_both_ways_mid_accumulation(tmp_path):
  """MaxText's engine saves between two micro-batches, ours restores and finishes the step;
  then ours saves mid-step and a fresh MaxText engine restores. Each time the reader
  finishes the step bit-identically to the writer."""
  stock_cls, ours_cls = _classes()
  for reader_cls, writer, reader, rest in _mid_step_handoffs(stock_cls, (ours_cls, stock_cls), tmp_path, 3):
    if reader_cls is ours_cls:  # restored straight onto the Zero-1 layout
      assert bytes_per_device(moments(reader)) * N == bytes_per_device(moments(writer))
    assert step(reader, rest) == step(writer, rest)
    assert_trees_equal(params(reader), params(writer))
    writer = reader


@needs_maxtext
@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param(dict(ici_data_parallelism=2, ici_fsdp_parallelism=2), id="fsdp"),
        pytest.param(dict(shard_mode="auto"), id="shard_mode=auto"),
        pytest.param(dict(opt_type="adam_pax"), id="adam_pax"),
        pytest.param(dict(skip_step_on_spikes=True), id="skip_step_on_spikes"),
    ],
)
def test_where_maxtext_flag_cannot_zero1_still_matches(overrides):
  from tests.support.maxtext_toys import tiny_batches

  engines = [build(cls, **overrides)[0] for cls in _classes()]
  batches = tiny_batches(engines[0]._config, 2)
  for e in engines:
    e.compile(batches[0])
    step(e, batches)
  stock, ours = engines
  assert_trees_equal(params(ours), params(stock))
  data = stock._mesh.shape["data"]
  assert bytes_per_device(moments(ours)) * data == bytes_per_device(moments(stock))


@needs_maxtext
def test_muon_trains_like_maxtext_engine_with_its_moments_split():
  """MaxText's muon (optax.contrib.muon with per-parameter dimension numbers) defeats
  optax.tree_utils.tree_map_params; the plan then ties its state to the parameters by path
  and shape. Newton-Schulz is not elementwise, so parameters agree to float precision."""
  from tests.support.maxtext_toys import tiny_batches

  engines = [build(cls, opt_type="muon")[0] for cls in _classes()]
  batches = tiny_batches(engines[0]._config, 2)
  for e in engines:
    e.compile(batches[0])
    step(e, batches)
  stock, ours = (params(e) for e in engines)
  for a, b in zip(jax.tree.leaves(stock), jax.tree.leaves(ours), strict=True):
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
  assert bytes_per_device(moments(engines[1])) < bytes_per_device(moments(engines[0]))


@needs_maxtext
@pytest.mark.parametrize("shard_mode", ["explicit", "auto"])
def test_maxtext_flag_means_zero1_from_this_engine(shard_mode, caplog):
  """shard_optimizer_over_data=True asks for what the class does: our Zero-1 serves it (also
  on Auto meshes, where MaxText's declines), MaxText's own is bypassed, one info line says so."""
  from tests.support.maxtext_toys import tiny_batches

  stock_cls, ours_cls = _classes()
  stock, _ = build(stock_cls, shard_mode=shard_mode)
  with caplog.at_level(logging.INFO):
    ours, config = build(ours_cls, shard_mode=shard_mode, shard_optimizer_over_data=True)
  batches = tiny_batches(config, 4)
  for e in (stock, ours):
    e.compile(batches[0])
    step(e, batches[:1])
    step(e, batches[1:])
  assert config.shard_optimizer_over_data is True  # the caller's config is left as it was
  assert_trees_equal(params(ours), params(stock))
  assert bytes_per_device(moments(ours)) * N == bytes_per_device(moments(stock))
  for leaf in jax.tree.leaves(nnx.state(ours.model, nnx.Param)):
    assert leaf.sharding.is_fully_replicated
  ours_lines = [r for r in caplog.records if "MaxText's own Zero-1 is bypassed" in r.getMessage()]
  assert len(ours_lines) == 1 and ours_lines[0].levelno == logging.INFO
  assert not [r for r in caplog.records if "cannot honour it" in r.getMessage()]  # MaxText's own warning


@needs_maxtext
def test_ahead_of_time_engine_is_refused_by_name():
  from tests.support.maxtext_toys import tiny_config, tiny_mesh

  _, ours = _classes()
  compile_module = importlib.import_module("maxtext.training_engine.maxtext_engine_compile")
  AbstractMaxTextEngine = compile_module.AbstractMaxTextEngine  # noqa: N806

  class Zero1Abstract(ours, AbstractMaxTextEngine):
    pass

  config = tiny_config()
  with pytest.raises(Zero1Error, match="maxtext_engine_compile.AbstractMaxTextEngine"):
    Zero1Abstract(config, tiny_mesh(config))


# -- ZeRO-2: SHARD_ACCUMULATOR ---------------------------------------------------------------------


def _zero2_class():
  _, ours = _classes()

  class Zero2MaxTextTrainingEngine(ours):
    SHARD_ACCUMULATOR = True

  return Zero2MaxTextTrainingEngine


def accumulator(engine):
  """The accumulator as MaxText saves it: summed over replicas (``unreduced`` partial sums reduced)."""
  return jax.tree.map(np.asarray, engine._reduced_accumulated_grads())


def max_difference(a, b):
  pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  return max(float(np.max(np.abs(x - y))) for x, y in pairs)


@pytest.fixture(scope="module")
def zero2_pair():
  """Zero-1 with MaxText's deferred accumulation and with ZeRO-2: one step at GA 1, then one at GA 4,
  the accumulators' per-device bytes read after the second step's first micro-batch."""
  if SKIP:
    pytest.skip(SKIP)
  from tests.support.maxtext_toys import tiny_batches

  engines = [build(cls)[0] for cls in (_classes()[1], _zero2_class())]
  batches = tiny_batches(engines[0]._config, 5, seed=7)
  for e in engines:
    e.compile(batches[0])
    step(e, batches[:1])
    e.fwd_bwd(batches[1])
  acc_bytes = [bytes_per_device(e._accumulated_grads) for e in engines]
  for e in engines:
    step(e, batches[2:])
  return engines, acc_bytes, batches


@needs_maxtext
def test_zero2_parameters_match_deferred_accumulation(zero2_pair):
  """Another summation order (a reduce-scatter per micro-batch, not one all-reduce of the sums):
  the parameters agree to float precision (measured here: 0.0, i.e. bit-identical on CPU)."""
  (deferred, zero2), _, _ = zero2_pair
  assert deferred.train_step == zero2.train_step == 2
  diff = max_difference(params(zero2), params(deferred))
  print(f"max |parameter difference| ZeRO-2 vs deferred after 2 steps (GA 1, GA 4): {diff:.3g}")
  # MaxText's schedule never exceeds the config's peak learning rate.
  assert_reordered_adam_close(params(zero2), params(deferred), lr=deferred._config.learning_rate, steps=2)


@needs_maxtext
def test_zero2_accumulator_bytes_are_one_nth(zero2_pair):
  (deferred, zero2), (deferred_bytes, zero2_bytes), _ = zero2_pair
  print(f"accumulator bytes per device: deferred {deferred_bytes}, ZeRO-2 {zero2_bytes}")
  assert zero2_bytes * N == deferred_bytes
  assert deferred_bytes == sum(x.nbytes for x in jax.tree.leaves(nnx.state(deferred.model, nnx.Param)))
  for e in (deferred, zero2):  # parameters stay whole on every replica
    for leaf in jax.tree.leaves(nnx.state(e.model, nnx.Param)):
      assert leaf.sharding.is_fully_replicated


@needs_maxtext
def test_zero2_reduce_scatters_every_micro_batch(zero2_pair):
  """Both micro-batch kernels reduce-scatter every gradient onto its Zero-1 slice; the update
  kernel then has no gradient collective left but the all-gather of the new parameters."""
  (_, zero2), _, batches = zero2_pair
  sizes = [x.nbytes for x in jax.tree.leaves(nnx.state(zero2.model, nnx.Param))]
  kernels = zero2._lower_kernels(batches[0])
  for name in ("fwd_bwd", "fwd_bwd_accum"):
    found = collectives(kernels[name].compile().as_text())
    assert found["reduce-scatter"] == {"count": len(sizes), "bytes": sum(sizes) // N}, name
    assert found["all-reduce"]["bytes"] < min(sizes), name  # the loss's sums only
  update = collectives(kernels["update"].compile().as_text())
  assert update["reduce-scatter"]["count"] == 0
  assert update["all-reduce"]["bytes"] < min(sizes)  # the gradient norm's partial sums only
  assert update["all-gather"]["bytes"] == sum(sizes)


@needs_maxtext
@pytest.mark.parametrize(
    "overrides, reason",
    [
        pytest.param(dict(shard_mode="auto"), "shard_mode=auto", id="shard_mode=auto"),
        pytest.param(dict(ici_data_parallelism=2, ici_fsdp_parallelism=2), "'fsdp': 2", id="fsdp"),
        pytest.param(dict(ici_data_parallelism=1), "'data': 1", id="data=1"),
    ],
)
def test_zero2_refused_where_maxtext_does_not_defer(overrides, reason, monkeypatch):
  """Refused before MaxText builds anything: no model, no optimizer, the config as it was."""
  from tests.support.maxtext_toys import tiny_config, tiny_mesh

  stock, _ = _classes()
  monkeypatch.setattr(stock, "_build_model", lambda *a, **k: pytest.fail("MaxText built a model"))
  config = tiny_config(**overrides)
  before = {k: str(v) for k, v in config.get_keys().items()}
  with pytest.raises(Zero1Error, match=f"MaxText reduces the gradients in every micro-batch.*{reason}"):
    _zero2_class()(config, mesh=tiny_mesh(config))
  assert {k: str(v) for k, v in config.get_keys().items()} == before


@needs_maxtext
def test_zero2_refused_without_compile():
  """MaxText's uncompiled fwd_bwd keeps no unreduced gradients: refused, the step untouched."""
  from tests.support.maxtext_toys import tiny_batches

  engine, config = build(_zero2_class())
  with pytest.raises(Zero1Error, match=r"call engine.compile\(batch\) first"):
    engine.fwd_bwd(tiny_batches(config, 1)[0])
  assert engine.micro_step_count == 0 and not engine.has_accumulated_grads


@needs_maxtext
def test_zero2_checkpoints_cross_with_deferred_accumulation_mid_step(tmp_path):
  """A ZeRO-2 engine saves between two micro-batches and an engine with MaxText's deferred
  accumulation restores; then that one saves mid-step and a ZeRO-2 engine restores. Both save
  the summed gradients (orbax global arrays), so each reader holds the writer's accumulator
  exactly and finishes the step to float precision of the writer."""
  deferred_cls, zero2_cls = _classes()[1], _zero2_class()
  handoffs = _mid_step_handoffs(zero2_cls, (deferred_cls, zero2_cls), tmp_path, 5, hand_over=True)
  for reader_cls, writer, reader, rest in handoffs:
    assert_trees_equal(accumulator(reader), accumulator(writer))
    zero2, deferred = (reader, writer) if reader_cls is zero2_cls else (writer, reader)
    assert bytes_per_device(zero2._accumulated_grads) * N == bytes_per_device(deferred._accumulated_grads)
    assert step(reader, rest) == step(writer, rest)
    assert_reordered_adam_close(params(reader), params(writer), lr=writer._config.learning_rate, steps=1)


@needs_maxtext
def test_zero2_finds_a_parameter_sharded_over_data():
  """What the ZeRO-2 refusal in ``_build_optimizer`` looks for, through the core's ``deferral_blocker``:
  MaxText leaves the gradient of a parameter split over ``data`` reduced in every micro-batch, so no
  replica holds it whole to reduce-scatter. Another axis does not block (MaxText defers only where
  it has size 1, which ``_accumulator_refusal`` checks first)."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from nnx_zero1.adapters._maxtext_engine import _zero2_blocker

  mesh = jax.make_mesh((N // 2, 2), ("data", "tensor"), devices=jax.devices()[:N])
  model = nnx.Linear(8, 4, rngs=nnx.Rngs(0))
  nnx.update(model, jax.device_put(nnx.state(model), NamedSharding(mesh, P())))
  assert _zero2_blocker(model, mesh) is None
  kernel = model.kernel
  kernel.set_value(jax.device_put(kernel.get_value(), NamedSharding(mesh, P(None, "tensor"))))
  assert _zero2_blocker(model, mesh) is None
  kernel.set_value(jax.device_put(kernel.get_value(), NamedSharding(mesh, P("data", "tensor"))))
  blocker = _zero2_blocker(model, mesh)
  assert blocker is not None and str(P("data")) in blocker and "no replica holds whole gradients" in blocker


# -- host offload: OFFLOAD_STATE_TO_HOST -------------------------------------------------------------


def _memory_kinds(engine):
  """The memory kinds of the parameter-shaped optimizer leaves, between steps."""
  return {x.sharding.memory_kind for x in moments(engine)}


@needs_maxtext
def test_offload_keeps_the_state_on_host_and_trains_bit_identically():
  """A subclass's ``OFFLOAD_STATE_TO_HOST = True`` reaches the optimizer MaxText's engine builds:
  the moments' Zero-1 shards sit in ``pinned_host`` memory between steps, and one step at GA 2
  gives the stock engine's parameters bit for bit."""
  from tests.support.maxtext_toys import tiny_batches

  stock_cls, ours = _classes()

  class Offloaded(ours):
    OFFLOAD_STATE_TO_HOST = True

  engines = [build(cls)[0] for cls in (stock_cls, Offloaded)]
  assert _memory_kinds(engines[1]) == {"pinned_host"}
  assert bytes_per_device(moments(engines[1])) * N == bytes_per_device(moments(engines[0]))
  batches = tiny_batches(engines[0]._config, 2, seed=11)
  for e in engines:
    e.compile(batches[0])
  assert step(engines[0], batches) == step(engines[1], batches)
  assert_trees_equal(params(engines[1]), params(engines[0]))
  assert _memory_kinds(engines[1]) == {"pinned_host"}


# -- bfloat16 state: STATE_DTYPE ----------------------------------------------------------------------


@needs_maxtext
def test_state_dtype_stores_the_moments_in_bfloat16_and_trains():
  """A subclass's ``STATE_DTYPE = jnp.bfloat16`` reaches the optimizer MaxText's engine builds: the
  moments are bfloat16 on the Zero-1 layout (2 bytes per element, over N devices) before and after
  two steps at GA 2, which move the parameters to finite values."""
  import math

  import jax.numpy as jnp

  from tests.support.maxtext_toys import tiny_batches

  _, ours = _classes()

  class Bf16State(ours):
    STATE_DTYPE = jnp.bfloat16

  engine = build(Bf16State)[0]
  held = moments(engine)
  assert {x.dtype for x in held} == {jnp.dtype(jnp.bfloat16)}
  assert bytes_per_device(held) * N == sum(2 * math.prod(x.shape) for x in held)
  before = params(engine)
  batches = tiny_batches(engine._config, 2, seed=11)
  engine.compile(batches[0])
  for _ in range(2):  # MaxText's schedule warms up from a learning rate of 0 at step 0
    step(engine, batches)
  assert {x.dtype for x in moments(engine)} == {jnp.dtype(jnp.bfloat16)}
  after = jax.tree.leaves(params(engine))
  assert all(np.isfinite(a).all() for a in after)
  assert any(not np.array_equal(a, b) for a, b in zip(after, jax.tree.leaves(before), strict=True))


@needs_maxtext
def test_maxtext_without_deferral_reduces_in_every_micro_batch_and_only_inside():
  """The planner's ``--maxtext-deferral off``: MaxText's own decision answers "not deferred" inside the
  block (the engine as it was before it deferred the all-reduce), and its own answer again after."""
  from nnx_zero1.adapters._compat import maxtext_defers_reduction, maxtext_reduction_not_deferred
  from tests.support.maxtext_toys import tiny_config, tiny_mesh

  config = tiny_config()
  mesh = tiny_mesh(config)
  assert maxtext_defers_reduction(config, mesh)  # the toys' pure data mesh, explicit: MaxText defers
  with maxtext_reduction_not_deferred():
    assert not maxtext_defers_reduction(config, mesh)
  assert maxtext_defers_reduction(config, mesh)
