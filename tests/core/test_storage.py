"""``_src/storage.py``: the plan's storage, checked, and ``update``'s two moves, ``load`` and ``store``."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from nnx_zero1 import Zero1Error
from nnx_zero1._src.layout_plan import make_plan, one_device_mesh, single_device_plan
from nnx_zero1._src.options import Zero1Options
from nnx_zero1._src.storage import compute_shardings, load, master_shardings, storage_plan, store

MESH = jax.make_mesh((8,), ("data",))
PARAMS = {"w": jnp.ones((16, 4), jnp.bfloat16)}


def _plan(options, tx=None, params=PARAMS):
  tx = optax.adam(1e-3) if tx is None else tx
  with jax.set_mesh(MESH):
    init = jax.eval_shape(tx.init, jax.tree.map(lambda x: x.astype(jnp.float32), params))
  return storage_plan(make_plan(tx, params, MESH, ("data",), abstract_state=init), options, params)


def _state(plan):
  """Adam's state for PARAMS in float32, on the plan's compute layout, with distinct values."""
  mu = jnp.arange(64, dtype=jnp.float32).reshape(16, 4) / 7
  state = (optax.ScaleByAdamState(count=jnp.zeros((), jnp.int32), mu={"w": mu}, nu={"w": mu * mu}),
           optax.EmptyState())
  return jax.tree.unflatten(jax.tree.structure(state), [
      jax.device_put(x, s) for x, s in zip(jax.tree.leaves(state), compute_shardings(plan), strict=True)])


def test_with_no_storage_option_load_and_store_return_what_they_are_given():
  plan = _plan(Zero1Options())
  state = _state(plan)
  loaded, masters = load(plan, state)
  assert masters is None and all(a is b for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(state)))
  stored, masters = store(plan, state, {"w": jnp.ones((16, 4))}, step=jnp.uint32(3))  # no masters kept
  assert masters is None and all(a is b for a, b in zip(jax.tree.leaves(stored), jax.tree.leaves(state)))


def test_offloaded_state_is_stored_in_host_memory_and_loaded_back_bit_identical():
  plan = _plan(Zero1Options(offload_state_to_host=True, master_dtype=jnp.float32))
  state = _state(plan)
  masters = {"w": jax.device_put(jnp.ones((16, 4)), master_shardings(plan, "device")[0])}
  stored, stored_masters = store(plan, state, masters)
  kinds = [x.sharding.memory_kind for x in jax.tree.leaves(stored)]
  assert kinds == ["pinned_host"] * 3
  assert stored_masters["w"].sharding.memory_kind == "pinned_host"
  assert [len(x.addressable_shards) for x in jax.tree.leaves(stored)] == [8, 8, 8]
  loaded, loaded_masters = load(plan, stored, stored_masters)
  assert [x.sharding.memory_kind for x in jax.tree.leaves(loaded)] == ["device"] * 3
  assert loaded_masters["w"].sharding.memory_kind == "device"
  jax.tree.map(np.testing.assert_array_equal, loaded, state)
  np.testing.assert_array_equal(loaded_masters["w"], masters["w"])


def test_narrowed_state_is_stored_in_its_dtype_and_computed_in_tx_s():
  plan = _plan(Zero1Options(state_dtype=jnp.bfloat16, state_rounding="nearest"))
  assert [(leaf.dtype, leaf.compute_dtype) for leaf in plan.state_leaves] == [
      ("int32", None), ("bfloat16", "float32"), ("bfloat16", "float32")]
  state = _state(plan)
  stored, _ = store(plan, state, step=jnp.uint32(5))
  assert [x.dtype for x in jax.tree.leaves(stored)] == [jnp.int32, jnp.bfloat16, jnp.bfloat16]
  np.testing.assert_array_equal(stored[0].mu["w"], state[0].mu["w"].astype(jnp.bfloat16))
  loaded, _ = load(plan, stored)
  assert [x.dtype for x in jax.tree.leaves(loaded)] == [jnp.int32, jnp.float32, jnp.float32]
  np.testing.assert_array_equal(loaded[0].nu["w"], stored[0].nu["w"].astype(jnp.float32))


def test_stochastic_narrowing_is_seeded_by_the_step_and_lands_on_a_neighbour():
  plan = _plan(Zero1Options(state_dtype=jnp.bfloat16))
  state = _state(plan)
  at_3, at_3_again, at_4 = (store(plan, state, step=jnp.uint32(s))[0][0].mu["w"] for s in (3, 3, 4))
  np.testing.assert_array_equal(at_3, at_3_again)
  assert not np.array_equal(at_3, at_4)
  exact = np.asarray(state[0].mu["w"])
  # One of the two nearest bfloat16 values: within one spacing, at most 2**-7 of the value.
  assert np.all(np.abs(np.asarray(at_3, np.float32) - exact) <= np.abs(exact) * 2.0**-7)


@pytest.mark.parametrize("options, words", [
    (Zero1Options(state_dtype=jnp.bfloat16), "state_dtype=bfloat16 needs a mesh"),
    (Zero1Options(master_dtype=jnp.float32), "master_dtype=float32 needs a mesh"),
    (Zero1Options(offload_state_to_host=True), "offload_state_to_host=True needs a mesh"),
])
def test_on_one_device_with_no_mesh_every_storage_option_is_refused(options, words):
  device = jax.devices()[0]
  params = {"w": jnp.ones(4, jnp.bfloat16)}
  plan = single_device_plan(make_plan(optax.adam(1e-3), params, one_device_mesh(device, ("data",)),
                                      ("data",)), device)
  with pytest.raises(Zero1Error, match=words):
    storage_plan(plan, options, params)


@pytest.mark.parametrize("tx, params, options, words", [
    (optax.sgd(0.1), PARAMS, Zero1Options(state_dtype=jnp.bfloat16), "changes nothing"),
    (optax.adam(1e-3), {"w": jnp.ones(8)}, Zero1Options(master_dtype=jnp.float32),
     "every parameter is float32 already"),
    (optax.adam(1e-3), {"w": jnp.ones(8)}, Zero1Options(master_dtype=jnp.bfloat16),
     "narrower than parameter"),
    (optax.adam(1e-3), {"w": jnp.ones(8, jnp.int32)}, Zero1Options(master_dtype=jnp.float32), "not floating"),
])
def test_a_storage_option_that_cannot_apply_to_these_parameters_is_refused(tx, params, options, words):
  with pytest.raises(Zero1Error, match=words):
    _plan(options, tx, params)
