"""The layout rule on its own: a pure function of (shape, sharding, data axis)."""

import jax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_zero1 import Zero1Error, zero1_sharding
from nnx_zero1._src.layout import Reason, zero1_layout

MESH = jax.make_mesh((2, 2, 2), ("replica", "data", "tp"))


def spec(shape, existing=None, axis="data"):
  return zero1_sharding(shape, NamedSharding(MESH, existing or P()), axis).spec


def test_first_divisible_dimension_takes_the_data_axis():
  assert spec((8, 6)) == P("data")
  assert spec((3, 6)) == P(None, "data")
  assert spec((3, 5, 4)) == P(None, None, "data")


def test_a_dimension_that_keeps_more_than_one_row_per_device_is_preferred():
  # 2 rows over data (2) would leave one per device (issue 25: a LoRA factor of rank 2 or 4).
  assert spec((2, 8)) == P(None, "data")
  assert spec((2, 8), P(None, "tp")) == P(None, ("tp", "data"))
  assert spec((2, 2, 6)) == P(None, None, "data")
  # With no such dimension, the first one that divides takes it, one row per device.
  assert spec((2, 3)) == P("data")
  assert spec((2, 2)) == P("data")


def test_indivisible_and_scalar_leaves_stay_as_they_are():
  s = NamedSharding(MESH, P())
  assert zero1_layout((3, 5), s) == (s, Reason.NOT_DIVISIBLE)
  assert zero1_layout((), s) == (s, Reason.SCALAR)


def test_composes_with_an_existing_axis_on_the_same_dimension():
  # 8 splits over tp (2) x data (2); the existing axis stays first.
  assert spec((8, 3), P("tp", None)) == P(("tp", "data"))
  # 2 only takes tp, so data goes to the next dimension that can hold it.
  assert spec((2, 4), P("tp", None)) == P("tp", "data")
  assert spec((6, 4), P(None, "tp")) == P("data", "tp")


def test_a_leaf_already_sharded_over_the_data_axis_is_left_alone():
  # PartitionSpec is a pytree leaf; the rule must look inside its entries and tuples.
  for existing in (P("data"), P(None, ("tp", "data")), P(("data",), None)):
    s = NamedSharding(MESH, existing)
    assert zero1_layout((8, 8), s) == (s, Reason.ALREADY_SHARDED)


def test_idempotent():
  for shape, existing in [((8, 6), P()), ((2, 4), P("tp")), ((8, 8), P(None, "tp")), ((3,), P())]:
    once = zero1_sharding(shape, NamedSharding(MESH, existing))
    assert zero1_sharding(shape, once) == once


def test_tuple_data_axis():
  assert spec((8, 3), axis=("replica", "data")) == P(("replica", "data"))
  assert spec((2, 4), axis=("replica", "data")) == P(None, ("replica", "data"))
  assert spec((8, 3), P("tp"), axis=("replica", "data")) == P(("tp", "replica", "data"))
  once = zero1_sharding((8, 3), NamedSharding(MESH, P()), ("replica", "data"))
  assert zero1_sharding((8, 3), once, ("replica", "data")) == once


def test_shards_divide_evenly_and_keep_the_mesh():
  s = zero1_sharding((8, 6), NamedSharding(MESH, P(None, "tp")))
  assert s.mesh == MESH
  assert s.shard_shape((8, 6)) == (4, 3)


def test_unknown_data_axis_is_a_zero1_error_naming_the_mesh_axes():
  with pytest.raises(Zero1Error, match=r"'batch'.*\('replica', 'data', 'tp'\)"):
    spec((8,), axis="batch")
  with pytest.raises(Zero1Error, match="twice"):
    spec((8,), axis=("data", "data"))
