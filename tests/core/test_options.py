"""``Zero1Options``: the one record of a Zero-1 optimizer's options, checked once, forwarded by every
entry point."""

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from nnx_zero1 import (
  ShardedOptimizerMixin,
  Zero1Error,
  Zero1ModelAndOptimizer,
  Zero1Optimizer,
  Zero1Options,
  bytes_per_device,
  zero1_optimizers,
)
from nnx_zero1._src.options import levers_of
from nnx_zero1.adapters.maxtext import Zero1EngineMixin
from tests.support.helpers import PlainTrainer, placed

MESH = jax.make_mesh((8,), ("data",))


@pytest.mark.parametrize("options, words", [
    ({"data_axis": ()}, "data_axis must be a mesh axis name"),
    ({"data_axis": ("data", "data")}, "names an axis twice"),
    ({"strict": "yes"}, "strict='yes' is not a bool"),
    ({"pin_gradients": None}, "pin_gradients=None is not a bool"),
    ({"offload_state_to_host": 1.5}, "offload_state_to_host=1.5 is neither a bool nor a fraction"),
    ({"state_rounding": "up"}, "state_rounding='up' is not one of"),
    ({"state_dtype": jnp.int8}, "state_dtype=int8 is not a floating dtype"),
    ({"state_dtype": "no-such-dtype"}, "state_dtype='no-such-dtype' is not a dtype"),
    ({"state_dtype": jnp.float16}, "narrows float32 to bfloat16 only"),
    ({"master_dtype": jnp.int32}, "master_dtype=int32 is not a floating dtype"),
    ({"params_across_dtype": jnp.int16}, "params_across_dtype=int16 is neither a floating dtype nor int8"),
    ({"params_across_dtype": jnp.int8}, "params_across_dtype=int8 rounds .* set master_dtype"),
    ({"params_across_dtype": jnp.int8, "master_dtype": jnp.float32},
     r"params_across_dtype=int8 narrows .* split over \('data',\) only"),
])
def test_a_bad_option_is_refused_by_name_when_the_record_is_built(options, words):
  with pytest.raises(Zero1Error, match=words):
    Zero1Options(**options)


@pytest.mark.parametrize("options, words", [
    ({"strict": "yes"}, "strict='yes' is not a bool"),
    ({"state_rounding": "up"}, "state_rounding='up' is not one of"),
    ({"master_dtype": jnp.int32}, "master_dtype=int32 is not a floating dtype"),
])
def test_every_entry_point_refuses_through_the_record_before_any_state(options, words):
  model = nnx.Linear(8, 8, rngs=nnx.Rngs(0))
  before = jax.tree.map(np.asarray, nnx.state(model))
  with pytest.raises(Zero1Error, match=words):
    Zero1Optimizer(model, optax.adam(1e-3), MESH, **options)
  with pytest.raises(Zero1Error, match=words):
    Zero1ModelAndOptimizer(model, optax.adam(1e-3), MESH, **options)
  with pytest.raises(Zero1Error, match=words), zero1_optimizers(MESH, **options):
    pass
  jax.tree.map(np.testing.assert_array_equal, nnx.state(model), before)


def test_the_record_is_normalised_frozen_and_round_trips_through_its_keywords():
  options = Zero1Options(data_axis="data", state_dtype="bfloat16", master_dtype="float32",
                         strict=np.bool_(True))
  assert options.data_axis == ("data",)
  assert options.state_dtype == np.dtype(jnp.bfloat16) and options.master_dtype == np.dtype("float32")
  assert options.strict is True
  assert Zero1Options(**options.keywords()) == options
  assert hash(options) == hash(Zero1Options(**options.keywords()))
  with pytest.raises(dataclasses.FrozenInstanceError):
    options.strict = False  # type: ignore[misc]
  assert Zero1Options() == Zero1Options(data_axis=("data",))


def test_the_levers_are_the_records_memory_options_read_off_any_naming():
  class Engine:
    OFFLOAD_STATE_TO_HOST, STATE_DTYPE, STATE_ROUNDING, MASTER_DTYPE = True, jnp.bfloat16, "nearest", None
    PARAMS_ACROSS_DTYPE = jnp.int8

  class Trainer:
    zero1_offload_state_to_host, zero1_state_dtype, zero1_state_rounding, zero1_master_dtype = (
        False, None, "stochastic", jnp.float32)
    zero1_params_across_dtype = None

  assert levers_of(Engine(), str.upper) == {
      "offload_state_to_host": True, "state_dtype": jnp.bfloat16, "state_rounding": "nearest",
      "master_dtype": None, "params_across_dtype": jnp.int8,
  }
  assert set(levers_of(Trainer(), lambda name: f"zero1_{name}")) == {
      f.name for f in dataclasses.fields(Zero1Options)} - {"data_axis", "strict", "pin_gradients"}


def _bf16_model():
  return placed(nnx.Linear(16, 16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), MESH)


class _Zero1Trainer(ShardedOptimizerMixin, PlainTrainer):
  zero1_strict = True
  zero1_pin_gradients = False
  zero1_offload_state_to_host = True
  zero1_state_dtype = jnp.bfloat16
  zero1_state_rounding = "nearest"
  zero1_master_dtype = jnp.float32


LEVERS = {"offload_state_to_host": True, "state_dtype": jnp.bfloat16, "state_rounding": "nearest",
          "master_dtype": jnp.float32}


def _built(entry):
  model = _bf16_model()
  if entry == "optimizer":
    return Zero1Optimizer(model, optax.adam(1e-3), MESH, strict=True, pin_gradients=False, **LEVERS)
  if entry == "model_and_optimizer":
    return Zero1ModelAndOptimizer(model, optax.adam(1e-3), MESH, strict=True, pin_gradients=False, **LEVERS)
  if entry == "scope":
    with zero1_optimizers(MESH, "data", True, pin_gradients=False, **LEVERS):
      return nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  with jax.set_mesh(MESH):
    return _Zero1Trainer(model, optax.adam(1e-3)).optimizer


@pytest.mark.parametrize("entry", ["optimizer", "model_and_optimizer", "scope", "mixin"])
def test_every_entry_point_forwards_every_option_to_the_same_effect(entry):
  opt = _built(entry)
  assert isinstance(opt, Zero1Optimizer)
  # Effects, read off the arrays: the moments are bfloat16 and in host memory, 1/8 per device; the
  # float32 master copies are in host memory, 1/8 per device; the count stays on device.
  mu = opt.opt_state[0].mu["kernel"][...]
  assert mu.dtype == jnp.bfloat16 and mu.sharding.memory_kind == "pinned_host"
  assert bytes_per_device(mu) == 16 * 16 * 2 // 8
  master = opt.master_params["kernel"][...]
  assert master.dtype == jnp.float32 and master.sharding.memory_kind == "pinned_host"
  assert bytes_per_device(master) == 16 * 16 * 4 // 8
  assert opt.step[...].sharding.memory_kind == "device"
  assert opt.strict is True and opt.data_axis == ("data",) and opt.pin_gradients is False


RECORD = {field.name: field.default for field in dataclasses.fields(Zero1Options)}
ENGINE_OWN = {"data_axis", "strict", "pin_gradients"}  # an engine's own attributes, or the engine's choice


def _options_in_signature(entry):
  parameters = inspect.signature(entry).parameters
  return {name: p.default for name, p in parameters.items() if name in RECORD}, set(parameters)


ENTRY_POINTS = [Zero1Optimizer.__init__, Zero1ModelAndOptimizer.__init__, zero1_optimizers]
NOT_OPTIONS = {"self", "model", "tx", "mesh", "wrt", "graph", "options"}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_every_constructor_takes_every_option_of_the_record_with_its_default(entry):
  # Drift fails here: an option added to the record but not to an entry point, or a default that differs.
  options, names = _options_in_signature(entry)
  assert options == RECORD
  assert names - set(RECORD) <= NOT_OPTIONS


# One value per option that only the record refuses: an entry point that does not pass an option on
# into its record builds without an error.
REFUSED = {"data_axis": ((), "data_axis must be a mesh axis name"),
           "strict": ("yes", "strict='yes' is not a bool"),
           "pin_gradients": (None, "pin_gradients=None is not a bool"),
           "offload_state_to_host": (1.5, "offload_state_to_host=1.5 is neither"),
           "state_dtype": (jnp.int8, "state_dtype=int8 is not a floating dtype"),
           "state_rounding": ("up", "state_rounding='up' is not one of"),
           "master_dtype": (jnp.int32, "master_dtype=int32 is not a floating dtype"),
           "params_across_dtype": (jnp.int32, "params_across_dtype=int32 is neither")}


def _enter(entry, **option):
  model = placed(nnx.Linear(8, 8, rngs=nnx.Rngs(0)), MESH)
  if entry is zero1_optimizers:
    with zero1_optimizers(MESH, **option):
      pass
  else:
    entry(model, optax.sgd(0.1), MESH, **option)


@pytest.mark.parametrize("name", sorted(RECORD))
@pytest.mark.parametrize("entry", [Zero1Optimizer, Zero1ModelAndOptimizer, zero1_optimizers])
def test_every_constructor_passes_each_of_its_options_on_into_the_record(entry, name):
  # Drift fails here: an option an entry point takes but leaves out of the record it builds.
  assert set(REFUSED) == set(RECORD)
  value, words = REFUSED[name]
  with pytest.raises(Zero1Error, match=words):
    _enter(entry, **{name: value})


@pytest.mark.parametrize("entry", [Zero1Optimizer, Zero1ModelAndOptimizer])
def test_one_record_passes_whole_and_never_beside_a_keyword_option(entry):
  options = Zero1Options(strict=True, pin_gradients=False, state_dtype=jnp.bfloat16, state_rounding="nearest")
  linear = lambda: placed(nnx.Linear(16, 16, rngs=nnx.Rngs(0)), MESH)
  opt = entry(linear(), optax.adam(1e-3), MESH, options=options)
  assert (opt.strict, opt.pin_gradients, opt.zero1_plan.state_rounding) == (True, False, "nearest")
  assert opt.opt_state[0].mu["kernel"][...].dtype == jnp.bfloat16
  with pytest.raises(TypeError, match="pin_gradients, strict given beside options="):
    entry(linear(), optax.adam(1e-3), MESH, options=options, strict=True,
          pin_gradients=False)


def test_the_mixins_and_the_engines_read_every_option_by_the_records_names():
  assert {name: getattr(ShardedOptimizerMixin, f"zero1_{name}") for name in RECORD} == RECORD
  levers = {name: default for name, default in RECORD.items() if name not in ENGINE_OWN}
  assert {name: getattr(Zero1EngineMixin, name.upper()) for name in levers} == levers
  assert set(levers_of(Zero1EngineMixin, str.upper)) == set(levers)


def test_one_record_passes_to_every_entry_point_as_keywords():
  options = Zero1Options(strict=True, pin_gradients=False, state_dtype=jnp.bfloat16, state_rounding="nearest")
  model = placed(nnx.Linear(16, 16, rngs=nnx.Rngs(0)), MESH)
  built = [Zero1Optimizer(model, optax.adam(1e-3), MESH, **options.keywords()),
           Zero1ModelAndOptimizer(model, optax.adam(1e-3), MESH, **options.keywords())]
  with zero1_optimizers(MESH, **options.keywords()):
    built.append(nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param))
  for opt in built:
    assert isinstance(opt, Zero1Optimizer)
    assert (opt.strict, opt.pin_gradients, opt.zero1_plan.state_rounding) == (True, False, "nearest")
    assert opt.opt_state[0].mu["kernel"][...].dtype == jnp.bfloat16


def test_pin_gradients_reaches_the_step_through_the_scope():
  # The effect, in the traced step: on an Auto mesh each gradient is held on its parameter's layout by one
  # sharding constraint (kernel and bias: two), which pin_gradients=False leaves out.
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))

  def constraints(pin):
    with jax.set_mesh(mesh):
      model = nnx.Linear(16, 16, rngs=nnx.Rngs(0))
      with zero1_optimizers(mesh, pin_gradients=pin):
        opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

      @nnx.jit
      def step(model, opt, x):
        opt.update(model, nnx.grad(lambda m: (m(x) ** 2).mean())(model))

      x = jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P("data")))
      return step.lower(model, opt, x).as_text().count("sharding_constraint")

  assert constraints(True) - constraints(False) == 2
