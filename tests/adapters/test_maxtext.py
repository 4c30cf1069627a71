"""The MaxText-style Engine and its Zero-1 adapter on 4 virtual CPU devices and a small decoder.

Kernels are shared between engines of one model shape (module-level jitted
functions of a hashable spec), so most tests here reuse compiled code.
"""

from __future__ import annotations

import logging
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_zero1 import Zero1Error, bytes_per_device
from nnx_zero1.testing import collectives
from tests.support.helpers import (
  Decoder,
  assert_trees_close,
  assert_trees_equal,
  assert_unchanged,
  lm_loss,
  snapshot,
)
from tests.support.reference_engine import Engine, Zero1Engine

N = 4
VOCAB, SEQ = 64, 16
GA_PHASES = (1, 4, 8)


def micro_batches(n, rows=8, seed=0):
  rng = np.random.default_rng(seed)
  return [{"tokens": rng.integers(0, VOCAB, (rows, SEQ + 1)).astype(np.int32)} for _ in range(n)]


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((N,), ("data",), devices=jax.devices()[:N])


def make(cls, tx, mesh, **kwargs):
  return cls(Decoder(nnx.Rngs(0), vocab=VOCAB), tx, mesh, loss_fn=lm_loss, **kwargs)


def run(engine, batches, ga):
  """Optimizer steps of ``ga`` micro-batches each; returns the losses and grad norms."""
  losses, norms = [], []
  for i in range(0, len(batches), ga):
    losses += [float(engine.fwd_bwd(b)) for b in batches[i:i + ga]]
    engine.update()
    norms.append(float(engine.grad_norm))
  return losses, norms


def params(engine):
  return nnx.state(engine.model, nnx.Param)


def moments(engine):
  """adamw's mu and nu (the count scalar stays replicated)."""
  state = nnx.state(engine.optimizer)["opt_state"][0]
  return {"mu": state["mu"], "nu": state["nu"]}


@pytest.fixture(scope="module")
def adamw_runs(mesh):
  """Engine and Zero1Engine trained side by side: one step at GA 1, then 4, then 8."""
  engines = {cls: make(cls, optax.adamw(1e-2), mesh) for cls in (Engine, Zero1Engine)}
  phases = {}
  data = iter(micro_batches(sum(GA_PHASES)))
  for ga in GA_PHASES:
    batches = [next(data) for _ in range(ga)]
    phases[ga] = {
        cls: (run(e, batches, ga), jax.tree.map(np.asarray, params(e))) for cls, e in engines.items()
    }
  return engines, phases


@pytest.mark.parametrize("ga", GA_PHASES)
def test_zero1_engine_trains_like_engine(adamw_runs, ga):
  _, phases = adamw_runs
  (losses, norms), p = phases[ga][Engine]
  (z_losses, z_norms), z_p = phases[ga][Zero1Engine]
  np.testing.assert_allclose(z_losses, losses, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(z_norms, norms, rtol=1e-6, atol=1e-6)
  assert_trees_close(z_p, p)
  # Measured on CPU, jax 0.10.2: the reduce-scatter and the all-reduce sum the
  # replicas in the same order, so adamw comes out bit-identical too.
  assert_trees_equal(z_p, p)


def test_zero1_engine_is_bit_identical_with_sgd(mesh):
  batches = micro_batches(8, seed=1)
  engines = [make(cls, optax.sgd(0.1), mesh) for cls in (Engine, Zero1Engine)]
  (losses, norms), (z_losses, z_norms) = (run(e, batches, 4) for e in engines)
  assert_trees_equal(params(engines[1]), params(engines[0]))
  np.testing.assert_array_equal(z_losses, losses)
  np.testing.assert_allclose(z_norms, norms, rtol=1e-6)


def test_moments_take_one_nth_per_device_and_params_stay_replicated(adamw_runs):
  engines, _ = adamw_runs
  engine, zero1 = engines[Engine], engines[Zero1Engine]
  assert bytes_per_device(moments(zero1)) * N == bytes_per_device(moments(engine))
  for e in engines.values():
    for leaf in jax.tree.leaves(params(e)):
      assert leaf.sharding.is_fully_replicated
    full = sum(x.nbytes for x in jax.tree.leaves(params(e)))
    assert bytes_per_device(params(e)) == full
    # the accumulator: one row (a parameter-sized partial sum) per device
    assert bytes_per_device(e._grad_acc) == full


def _param_bytes(engine):
  return [x.nbytes for x in jax.tree.leaves(params(engine))]


def assert_no_gradient_all_reduce(engine, batch):
  """The micro-batch probe: no all-reduce as large as the smallest parameter."""
  hlo = engine.lowered_fwd_bwd(batch).compile().as_text()
  reduced = collectives(hlo)["all-reduce"]["bytes"]
  assert reduced < min(_param_bytes(engine)), "gradients reduced per micro-batch"


def test_hlo_one_reduce_scatter_per_step(adamw_runs):
  engines, _ = adamw_runs
  batch = micro_batches(1)[0]
  sizes = _param_bytes(engines[Zero1Engine])
  for engine in engines.values():
    assert_no_gradient_all_reduce(engine, batch)

  zero1 = collectives(engines[Zero1Engine].lowered_update().compile().as_text())
  # each gradient leaf reduce-scattered once, onto 1/N per device; params all-gathered once
  assert zero1["reduce-scatter"] == {"count": len(sizes), "bytes": sum(sizes) // N}
  assert zero1["all-gather"]["bytes"] == sum(sizes)
  assert zero1["all-reduce"]["bytes"] < min(sizes)  # only the grad-norm scalars

  plain = collectives(engines[Engine].lowered_update().compile().as_text())
  assert plain["reduce-scatter"]["count"] == 0 and plain["all-gather"]["count"] == 0
  assert plain["all-reduce"]["bytes"] >= sum(sizes)


def test_auto_mesh_update_gathers_parameters_once():
  # The reduce-scattered gradients arrive on the Zero-1 layout; nothing may gather them.
  auto = jax.make_mesh((N,), ("data",), devices=jax.devices()[:N], axis_types=(AxisType.Auto,))
  engine = make(Zero1Engine, optax.adamw(1e-2), auto)
  engine.fwd_bwd(micro_batches(1)[0])
  sizes = _param_bytes(engine)
  update = collectives(engine.lowered_update().compile().as_text())
  assert update["reduce-scatter"] == {"count": len(sizes), "bytes": sum(sizes) // N}
  assert update["all-gather"]["bytes"] == sum(sizes)


def test_hlo_probe_fails_without_deferral(mesh, caplog):
  engine = make(Zero1Engine, optax.sgd(0.1), mesh, defer_reduction=False)
  batch = micro_batches(1)[0]
  with caplog.at_level(logging.INFO, logger="tests.support.reference_engine"):
    with pytest.raises(AssertionError, match="gradients reduced per micro-batch"):
      assert_no_gradient_all_reduce(engine, batch)
  assert "defer_reduction=False" in caplog.text


def test_deferred_reduction_matches_xla_reduction_up_to_last_bits(mesh):
  """Deferral off: XLA differentiates the global program and all-reduces every micro-batch.
  Summing per-replica partial sums once sums in another order, so only the last bits move."""
  batches = micro_batches(8, seed=1)
  deferred, each = (make(Zero1Engine, optax.sgd(0.1), mesh, defer_reduction=d) for d in (True, False))
  run(deferred, batches, 4)
  run(each, batches, 4)
  assert_trees_close(params(each), params(deferred))


def run_saving_mid_accumulation(tx, mesh, ckpt_dir, batches):
  """One Zero1Engine step over ``batches``, checkpointed (as step 0) halfway through them."""
  engine = make(Zero1Engine, tx, mesh, checkpoint_dir=ckpt_dir)
  half = len(batches) // 2
  for b in batches[:half]:
    engine.fwd_bwd(b)
  engine.save_checkpoint(0)
  for b in batches[half:]:
    engine.fwd_bwd(b)
  engine.update()
  engine.close()
  return engine


def test_mid_accumulation_checkpoint_resumes_exactly(adamw_runs, mesh, tmp_path):
  batches = micro_batches(4, seed=2)
  first = run_saving_mid_accumulation(optax.adamw(1e-2), mesh, tmp_path, batches)

  for cls in (Zero1Engine, Engine):  # the Zero1Engine checkpoint restores into both
    resumed = make(cls, optax.adamw(1e-2), mesh, checkpoint_dir=tmp_path)
    assert resumed.restore_checkpoint() == 0
    assert int(resumed._micro_steps) == 2
    for b in batches[2:]:
      resumed.fwd_bwd(b)
    assert resumed.update() == 1
    assert_trees_equal(params(resumed), params(first))
    assert_trees_equal(nnx.state(resumed.optimizer), nnx.state(first.optimizer))
    resumed.close()


def test_engine_checkpoint_restores_into_zero1_engine(adamw_runs, mesh, tmp_path):
  engines, _ = adamw_runs
  source = make(Engine, optax.adamw(1e-2), mesh, checkpoint_dir=tmp_path)
  run(source, micro_batches(2, seed=3), 2)
  source.fwd_bwd(micro_batches(1, seed=4)[0])  # leave one micro-batch accumulated
  source.save_checkpoint(1)
  source.close()

  target = make(Zero1Engine, optax.adamw(1e-2), mesh, checkpoint_dir=tmp_path)
  assert target.restore_checkpoint(1) == 1
  assert_trees_equal(nnx.state(target.optimizer), nnx.state(source.optimizer))
  assert_trees_equal(target._grad_acc, source._grad_acc)
  assert bytes_per_device(moments(target)) * N == bytes_per_device(moments(source))
  assert jax.tree.map(lambda x: x.sharding, moments(target)) == jax.tree.map(
      lambda x: x.sharding, moments(engines[Zero1Engine])
  )
  target.close()


def test_mid_accumulation_checkpoint_restores_at_another_data_parallel_size(mesh, tmp_path, caplog):
  batches = micro_batches(4, seed=7)
  first = run_saving_mid_accumulation(optax.sgd(0.1), mesh, tmp_path, batches)

  half = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
  resumed = make(Zero1Engine, optax.sgd(0.1), half, checkpoint_dir=tmp_path)
  with caplog.at_level(logging.INFO, logger="tests.support.reference_engine"):
    resumed.restore_checkpoint()
  assert "saved with 4 rows, restored with 2" in caplog.text
  for b in batches[2:]:
    resumed.fwd_bwd(b)
  resumed.update()
  # the same gradient summed in another order: equal up to the last bits
  assert_trees_close(params(resumed), params(first))
  resumed.close()


def _data_count(spec):
  return sum(a == "data" for entry in spec for a in ((entry,) if isinstance(entry, str) else entry or ()))


def test_recompile_for_new_batch_shape_keeps_data_axis_once(adamw_runs, mesh):
  engine = adamw_runs[0][Zero1Engine]
  small = micro_batches(1)[0]
  big = micro_batches(1, rows=16)[0]
  placed = {"tokens": jax.device_put(big["tokens"], NamedSharding(mesh, P(("data",))))}
  for batch in (small, big, placed):
    compiled = engine.lowered_fwd_bwd(batch).compile()
    in_specs = jax.tree.leaves(compiled.input_shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
    out_specs = jax.tree.leaves(compiled.output_shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
    for s in in_specs + out_specs:
      assert _data_count(s.spec) <= 1, s.spec
    batch_spec = compiled.input_shardings[0][-1]["tokens"].spec
    assert _data_count(batch_spec) == 1
    acc = jax.tree.leaves(compiled.input_shardings[0][2])  # (params, rest, acc, micro_steps, batch)
    assert all(_data_count(s.spec) == 1 for s in acc)
  # numpy and already-placed batches of one shape share a kernel
  assert len(engine._fwd_bwd_kernels) == 2


def test_eval_step_matches_fwd_bwd_loss(adamw_runs):
  engines, _ = adamw_runs
  batch = micro_batches(1, seed=5)[0]
  for engine in engines.values():
    before = jax.tree.map(np.asarray, params(engine))
    loss = engine.eval_step(batch)
    assert_trees_equal(params(engine), before)
    assert np.isfinite(float(loss))
  losses = [engines[cls].eval_step(batch) for cls in (Engine, Zero1Engine)]
  np.testing.assert_allclose(losses[1], losses[0], rtol=1e-6)


def test_batch_sharded_over_second_axis_reduces_each_micro_batch(caplog):
  mesh = jax.make_mesh((2, 2), ("data", "model"), devices=jax.devices()[:4], axis_types=(AxisType.Auto,) * 2)
  batches = [{"tokens": jax.device_put(b["tokens"], NamedSharding(mesh, P(("data", "model"))))}
             for b in micro_batches(2, seed=6)]
  with caplog.at_level(logging.INFO, logger="tests.support.reference_engine"):
    engines = [make(cls, optax.adamw(1e-2), mesh) for cls in (Engine, Zero1Engine)]
    results = [run(e, batches, 2) for e in engines]
  assert "cannot defer the gradient reduction" in caplog.text and "'model'" in caplog.text
  np.testing.assert_allclose(results[1][1], results[0][1], rtol=1e-6)
  assert_trees_close(params(engines[1]), params(engines[0]))
  assert bytes_per_device(moments(engines[1])) * 2 == bytes_per_device(moments(engines[0]))


def _engines_on_placed_decoder(mesh, up_spec, down_spec, caplog, seed, **kwargs):
  """Engine and Zero1Engine on a decoder whose kernels are already sharded: two steps of two
  micro-batches, which must fall back to reducing every micro-batch and say so."""
  def build(cls):
    model = Decoder(nnx.Rngs(0), vocab=VOCAB)
    for layer, spec in ((model.up, up_spec), (model.down, down_spec)):
      layer.kernel.value = jax.device_put(layer.kernel[...], NamedSharding(mesh, spec))
    return cls(model, optax.adamw(1e-2), mesh, loss_fn=lm_loss, **kwargs)

  with caplog.at_level(logging.INFO, logger="tests.support.reference_engine"):
    engines = [build(cls) for cls in (Engine, Zero1Engine)]
    for e in engines:
      run(e, micro_batches(2, seed=seed), 2)
  assert "a parameter is sharded" in caplog.text
  return engines


def test_tensor_parallel_params_fall_back_and_compose_with_zero1(caplog):
  mesh = jax.make_mesh((2, 2), ("data", "model"), devices=jax.devices()[:4], axis_types=(AxisType.Auto,) * 2)
  engines = _engines_on_placed_decoder(mesh, P(None, "model"), P("model", None), caplog, seed=9)
  assert_trees_equal(params(engines[1]), params(engines[0]))
  zero1 = engines[1]
  assert zero1.model.up.kernel[...].sharding.spec == P(None, "model")
  assert zero1.optimizer.opt_state[0].mu["up"]["kernel"][...].sharding.spec == P("data", "model")


@pytest.mark.parametrize("axes", [("data",), ("replica", "data")], ids=["data", "replica+data"])
def test_fsdp_params_over_the_data_axis_reduce_each_micro_batch(axes, caplog):
  """Parameters already split over ``data``: deferral is impossible, the accumulator's replica
  dimension takes only the data axes they do not use (no DuplicateSpecError)."""
  shape = (4,) if axes == ("data",) else (2, 2)
  mesh = jax.make_mesh(shape, axes, devices=jax.devices()[:4], axis_types=(AxisType.Auto,) * len(axes))

  engines = _engines_on_placed_decoder(mesh, P("data", None), P(None, "data"), caplog, seed=7, data_axis=axes)
  assert_trees_equal(params(engines[1]), params(engines[0]))
  zero1 = engines[1]
  assert zero1.model.up.kernel[...].sharding.spec == P("data", None)
  mu = zero1.optimizer.opt_state[0].mu["up"]["kernel"][...]
  assert bytes_per_device(mu) * 4 == mu.nbytes


def test_data_axis_tuple_reduce_scatters_over_both_axes():
  mesh = jax.make_mesh((2, 2), ("replica", "data"), devices=jax.devices()[:4])
  axes = ("replica", "data")
  engines = [make(cls, optax.adamw(1e-2), mesh, data_axis=axes) for cls in (Engine, Zero1Engine)]
  for e in engines:
    run(e, micro_batches(2, seed=8), 2)
  assert_trees_equal(params(engines[1]), params(engines[0]))
  assert bytes_per_device(moments(engines[1])) * 4 == bytes_per_device(moments(engines[0]))
  sizes = _param_bytes(engines[1])
  update = collectives(engines[1].lowered_update().compile().as_text())
  # Over data (a half per device), then over replica (a quarter); the plain engine reduces in that order
  # too, so the two are equal to the bit.
  assert update["reduce-scatter"] == {"count": 2 * len(sizes), "bytes": sum(sizes) // 2 + sum(sizes) // 4}


@pytest.mark.parametrize(
    "kwargs, message",
    [({"data_axis": "batch"}, "data axis 'batch'"), ({"wrt": nnx.LoRAParam}, "selects no parameters")],
)
def test_refused_zero1_engine_changes_nothing(mesh, kwargs, message):
  model = Decoder(nnx.Rngs(0), vocab=VOCAB)
  before = snapshot(model)
  with pytest.raises(Zero1Error, match=message):
    Zero1Engine(model, optax.adamw(1e-2), mesh, loss_fn=lm_loss, **kwargs)
  assert_unchanged(before, model)


def test_update_without_micro_batches_is_refused(adamw_runs):
  engine = adamw_runs[0][Zero1Engine]
  step = int(engine.optimizer.step[...])
  with pytest.raises(Zero1Error, match="at least one fwd_bwd"):
    engine.update()
  assert int(engine.optimizer.step[...]) == step


def test_example_runs():
  """A user's own engine given Zero-1 by the public mixin (the example uses no reference engine)."""
  script = pathlib.Path(__file__).parents[2] / "examples" / "maxtext_style_engine.py"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  out = subprocess.run(
      [sys.executable, str(script), "--steps", "1", "--accumulate", "2"],
      env=env, capture_output=True, text=True, timeout=600, check=True,
  ).stdout
  assert "parameters bit-identical: True" in out
  plain, zero1 = (line for line in out.splitlines() if line.startswith(("MyEngine ", "MyZero1Engine ")))
  assert "update: none" in plain and "update: all-gather x" in zero1  # the parameters gathered back
  assert "reference_engine" not in script.read_text() and "_src" not in script.read_text()


class _Counting(nnx.Module):
  """A decoder that counts its calls in a non-parameter variable: state the engine cannot carry."""

  def __init__(self):
    self.decoder = Decoder(nnx.Rngs(0), vocab=VOCAB)
    self.calls = nnx.BatchStat(jnp.zeros((), jnp.int32))

  def __call__(self, tokens):
    self.calls[...] += 1
    return self.decoder(tokens)


@pytest.mark.parametrize("defer_reduction", [True, False])
def test_loss_that_updates_other_model_state_is_refused(mesh, defer_reduction):
  engine = Zero1Engine(_Counting(), optax.sgd(0.1), mesh, loss_fn=lm_loss, defer_reduction=defer_reduction)
  before = snapshot(engine.model)
  with pytest.raises(Zero1Error, match="updates model state other than the trained parameters"):
    engine.fwd_bwd(micro_batches(1)[0])
  assert_unchanged(before, engine.model)


def test_strict_engine_refuses_a_reduction_it_cannot_defer():
  mesh = jax.make_mesh((2, 2), ("data", "model"), devices=jax.devices()[:4])
  model = Decoder(nnx.Rngs(0), vocab=VOCAB)
  model.up.kernel.value = jax.device_put(model.up.kernel[...], NamedSharding(mesh, P(None, "model")))
  engine = Zero1Engine(model, optax.sgd(0.1), mesh, loss_fn=lm_loss, strict=True)
  with pytest.raises(Zero1Error, match="strict: cannot defer the gradient reduction: a parameter is sharded"):
    engine.fwd_bwd(micro_batches(1)[0])
  assert engine._pending == 0
