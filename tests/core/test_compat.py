"""Every private API nnx-zero1 relies on still exists and does what it is used for.

Each test names the installed version in its failure message, so a dependency
upgrade that removes one says which shim in ``nnx_zero1/_src/compat.py`` (jax, flax)
or ``adapters/_compat.py`` (MaxText, Tunix) to fix. The MaxText ones run where maxtext
imports (Python >= 3.12, the CI's second lane).
"""

import importlib.util

import flax
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType

from nnx_zero1._src import compat as _compat
from tests.support.helpers import maxtext_process_settings_put_back

JAX = f"jax {jax.__version__}"
FLAX = f"flax {flax.__version__}"


def test_legacy_context_mesh_sees_with_mesh():
  mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Explicit,))
  assert _compat.legacy_context_mesh().empty, JAX
  with mesh:  # the legacy context Tunix 0.1.7 enters
    assert _compat.legacy_context_mesh() == mesh, f"thread_resources no longer records `with mesh:` on {JAX}"
  assert _compat.legacy_context_mesh().empty, JAX


def test_to_opt_state_is_what_nnx_optimizer_builds():
  model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
  tx = optax.adam(1e-3)
  ours = _compat.to_opt_state(tx.init(nnx.state(model, nnx.Param)))
  theirs = nnx.Optimizer(model, tx, wrt=nnx.Param).opt_state
  assert jax.tree.structure(ours) == jax.tree.structure(theirs), f"to_opt_state changed on {FLAX}"
  assert type(ours[0].mu["kernel"]) is nnx.OptVariable, FLAX
  assert type(ours[0].count) is nnx.OptArray, FLAX


def test_optimizer_sharding_is_the_metadata_nnx_optimizer_places_its_state_by():
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  # Eager sharding as flax defaults it: MaxText's engine, run earlier in the same process, turns it off.
  with jax.set_mesh(mesh), nnx.use_eager_sharding(True):
    model = nnx.Linear(16, 8, kernel_metadata={"optimizer_sharding": (None, "data")}, rngs=nnx.Rngs(0))
    mu = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param).opt_state[0].mu["kernel"]
  declared = _compat.optimizer_sharding_of(model.kernel)
  assert declared == (None, "data"), f"the metadata's name changed on {FLAX}"
  assert _compat.optimizer_sharding_of(model.bias) is None, FLAX
  assert mu.get_metadata("out_sharding") == (None, "data"), f"to_opt_state no longer reads it on {FLAX}"
  assert mu[...].sharding.spec == jax.sharding.PartitionSpec(None, "data"), FLAX


def test_filter_type_accepts_what_wrt_accepts():
  for wrt in (nnx.Param, "params", nnx.Any(nnx.Param, nnx.LoRAParam), ...):
    assert nnx.filterlib.to_predicate(wrt) is not None, FLAX
  assert _compat.Filter is nnx.filterlib.Filter, f"flax.nnx.filterlib.Filter moved on {FLAX}"


def test_jit_cache_size_counts_compilations():
  f = jax.jit(lambda x: x * 2)
  f(jnp.ones(2))
  f(jnp.ones(2))
  assert _compat.jit_cache_size(f) == 1, JAX
  f(jnp.ones(3))
  assert _compat.jit_cache_size(f) == 2, f"_cache_size() no longer counts compilations on {JAX}"


def test_context_mesh_is_readable_while_tracing():
  mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Explicit,))
  seen = []
  with jax.set_mesh(mesh):
    assert _compat.context_mesh() == mesh, JAX
    jax.jit(lambda: seen.append(_compat.context_mesh()))()
  assert seen == [mesh], f"jax._src.mesh.get_concrete_mesh no longer gives set_mesh's mesh on {JAX}"
  assert _compat.context_mesh().empty, JAX


def test_set_metaclass_swaps_flax_optimizers_metaclass_in_place():
  # A copy of nnx.Optimizer, so the real class keeps its metaclass for the other tests.
  cls = type(nnx.Optimizer)("OptimizerCopy", (nnx.Optimizer,), {})
  meta = type("Derived", (type(cls),), {})
  _compat.set_metaclass(cls, meta)
  assert type(cls) is meta, f"flax's Pytree metaclass no longer accepts a derived metaclass on {FLAX}"
  model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
  assert isinstance(cls(model, optax.sgd(0.1), wrt=nnx.Param), nnx.Optimizer), FLAX


def test_engine_model_and_mesh_reads_what_the_hook_needs():
  from nnx_zero1.adapters._compat import engine_model_and_mesh

  class Engine:
    def __init__(self):
      self._model, self._mesh = "model", "mesh"

  assert engine_model_and_mesh(Engine()) == ("model", "mesh")
  try:
    engine_model_and_mesh(object())
  except AttributeError as e:
    assert "maxtext" in str(e) and "_build_optimizer" in str(e)
  else:
    raise AssertionError("an engine without _model must be named, with the maxtext version")


MAXTEXT_SKIP = None if importlib.util.find_spec("maxtext") else (
    "maxtext is not installed here (pip install --no-deps maxtext==0.2.5 on Python >= 3.12; CI lane 2)"
)
needs_maxtext = pytest.mark.skipif(MAXTEXT_SKIP is not None, reason=str(MAXTEXT_SKIP))
process_settings_put_back = pytest.fixture(scope="module", autouse=True)(maxtext_process_settings_put_back)


def _maxtext():
  from importlib.metadata import version

  from nnx_zero1.adapters import _compat as maxtext_compat

  maxtext_compat.ensure_tunix_types()
  return maxtext_compat, f"maxtext {version('maxtext')}"


@needs_maxtext
def test_without_maxtext_zero1_turns_off_only_that_flag():
  from tests.support.maxtext_toys import tiny_config

  maxtext_compat, version = _maxtext()
  config = tiny_config(shard_optimizer_over_data=True)
  copy = maxtext_compat.without_maxtext_zero1(config)
  assert maxtext_compat.maxtext_zero1_requested(config) and not maxtext_compat.maxtext_zero1_requested(copy)
  assert config.shard_optimizer_over_data is True, version
  theirs, ours = config.get_keys(), copy.get_keys()
  changed = {k for k in theirs if str(theirs[k]) != str(ours[k])}
  assert changed == {"shard_optimizer_over_data"}, f"HyperParameters._pydantic_config changed on {version}"


@needs_maxtext
def test_engine_gradient_shardings_are_where_the_adapter_reads_them():
  from tests.support.maxtext_toys import tiny_batches, tiny_config, tiny_mesh

  maxtext_compat, version = _maxtext()
  stock = importlib.import_module("maxtext.training_engine.maxtext_engine").MaxTextTrainingEngine
  config = tiny_config()
  engine = stock(config, mesh=tiny_mesh(config))
  assert maxtext_compat.unreduced_grad_shardings(engine) is None, version  # not compiled yet
  engine.compile(tiny_batches(config, 1)[0])
  unreduced = jax.tree.leaves(maxtext_compat.unreduced_grad_shardings(engine))
  plain = jax.tree.leaves(maxtext_compat.plain_grad_shardings(engine))
  assert unreduced and len(unreduced) == len(plain), f"_unreduced/_plain_grad_shardings moved on {version}"
  assert all("data" in s.spec.unreduced for s in unreduced), version
  maxtext_compat.set_plain_grad_shardings(engine, "target")
  assert maxtext_compat.plain_grad_shardings(engine) == "target", version


@needs_maxtext
def test_maxtext_defers_reduction_is_maxtexts_own_answer():
  from tests.support.maxtext_toys import tiny_config, tiny_mesh

  maxtext_compat, version = _maxtext()
  explicit, auto = tiny_config(), tiny_config(shard_mode="auto")
  assert maxtext_compat.maxtext_defers_reduction(explicit, tiny_mesh(explicit)), version
  assert not maxtext_compat.maxtext_defers_reduction(auto, tiny_mesh(auto)), version
  assert not maxtext_compat.maxtext_defers_reduction(explicit, None), version


@needs_maxtext
def test_route_accumulator_shardings_keeps_maxtexts_value():
  from tests.support.maxtext_toys import tiny_config, tiny_mesh

  maxtext_compat, version = _maxtext()
  stock = importlib.import_module("maxtext.training_engine.maxtext_engine").MaxTextTrainingEngine

  class Routed(stock):
    pass

  maxtext_compat.route_accumulator_shardings(Routed, lambda engine, deferred: ("routed", deferred))
  config = tiny_config()
  engine = Routed(config, mesh=tiny_mesh(config))
  assert maxtext_compat.unreduced_grad_shardings(engine) is None, version  # written by MaxText's __init__
  assert engine._unreduced_grad_shardings == ("routed", None), version
