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

from helpers import assert_trees_equal, maxtext_process_settings_put_back
from nnx_zero1 import Zero1Error, bytes_per_device
from nnx_zero1.testing import collectives

N = 4


SKIP = None if importlib.util.find_spec("maxtext") else (
    "maxtext is not installed here (pip install --no-deps maxtext==0.2.5 on Python >= 3.12, with "
    ".ci/requirements-newest.txt; the CI's Python 3.12 lane has it)"
)
needs_maxtext = pytest.mark.skipif(SKIP is not None, reason=str(SKIP))


process_settings_put_back = pytest.fixture(scope="module", autouse=True)(maxtext_process_settings_put_back)


@pytest.mark.skipif(importlib.util.find_spec("maxtext") is not None, reason="maxtext is installed")
def test_without_maxtext_the_import_fails_clearly_and_engine_still_works():
  from nnx_zero1.adapters import maxtext as adapter

  with pytest.raises(ImportError, match="Zero1MaxTextTrainingEngine needs MaxText's engine"):
    from nnx_zero1.adapters.maxtext import Zero1MaxTextTrainingEngine  # noqa: F401
  assert adapter.Engine and adapter.Zero1Engine
  with pytest.raises(AttributeError):
    adapter.NoSuchThing  # noqa: B018


def _classes():
  from nnx_zero1.adapters.maxtext import Zero1MaxTextTrainingEngine  # first: supplies the Tunix types

  stock = importlib.import_module("maxtext.training_engine.maxtext_engine").MaxTextTrainingEngine
  return stock, Zero1MaxTextTrainingEngine


def build(cls, **overrides):
  from nnx_zero1._src.bench.maxtext_arms import tiny_config, tiny_mesh

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
  from nnx_zero1._src.bench.maxtext_arms import tiny_batches

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


@needs_maxtext
def test_checkpoints_cross_both_ways_mid_accumulation(tmp_path):
  """MaxText's engine saves between two micro-batches, ours restores and finishes the step;
  then ours saves mid-step and a fresh MaxText engine restores. Each time the reader
  finishes the step bit-identically to the writer."""
  from nnx_zero1._src.bench.maxtext_arms import tiny_batches

  stock_cls, ours_cls = _classes()
  writer = _checkpointed(stock_cls, tmp_path)
  batches = tiny_batches(writer._config, 9, seed=3)
  writer.compile(batches[0])
  step(writer, batches[:1])
  for reader_cls, chunk in ((ours_cls, batches[1:5]), (stock_cls, batches[5:9])):
    for b in chunk[:2]:
      writer.fwd_bwd(b)
    writer.save_checkpoint(metadata=None, force=True)
    reader = _checkpointed(reader_cls, tmp_path)
    reader.compile(batches[0])
    reader.restore_checkpoint()
    assert reader.micro_step_count == 2
    if reader_cls is ours_cls:  # restored straight onto the Zero-1 layout
      assert bytes_per_device(moments(reader)) * N == bytes_per_device(moments(writer))
    assert step(reader, chunk[2:]) == step(writer, chunk[2:])
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
  from nnx_zero1._src.bench.maxtext_arms import tiny_batches

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
  from nnx_zero1._src.bench.maxtext_arms import tiny_batches

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
  from nnx_zero1._src.bench.maxtext_arms import tiny_batches

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
  from nnx_zero1._src.bench.maxtext_arms import tiny_config, tiny_mesh

  _, ours = _classes()
  compile_module = importlib.import_module("maxtext.training_engine.maxtext_engine_compile")
  AbstractMaxTextEngine = compile_module.AbstractMaxTextEngine  # noqa: N806

  class Zero1Abstract(ours, AbstractMaxTextEngine):
    pass

  config = tiny_config()
  with pytest.raises(Zero1Error, match="maxtext_engine_compile.AbstractMaxTextEngine"):
    Zero1Abstract(config, tiny_mesh(config))
