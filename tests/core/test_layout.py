"""The layout rule on its own: a pure function of (shape, sharding, data axis), and a declared layout
checked against it."""

import jax
import pytest
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_zero1 import Zero1Error, zero1_sharding
from nnx_zero1._src.layout import Reason, declared_layout, is_split, zero1_layout

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


# -- a tuple data axis no dimension divides by: the largest part of it that one does ----------------

SLICES = AbstractMesh((3, 4, 2), ("replica", "data", "tp"))  # 3 slices x 4 chips, as issue 52's pod
BOTH = ("replica", "data")
LLAMA_7B = [(4096, 14336), (14336, 4096), (32000, 4096), (4096, 1024), (4096,)]  # no dimension divides by 12


def layout(shape, existing=None, axis=BOTH, mesh=SLICES):
  return zero1_layout(shape, NamedSharding(mesh, existing or P()), axis)


@pytest.mark.parametrize("shape", LLAMA_7B)
def test_no_dimension_divides_by_all_the_data_axes_split_over_data_alone(shape):
  sharding, reason = layout(shape)
  assert (sharding.spec, reason) == (P("data"), Reason.PARTLY_SPLIT)
  assert sharding.shard_shape(shape)[0] == shape[0] // 4
  assert zero1_sharding(shape, sharding, BOTH) == sharding  # idempotent


def test_a_dimension_divisible_by_all_the_data_axes_takes_them_all():
  assert layout((12288, 4096)) == (NamedSharding(SLICES, P(BOTH)), None)
  assert layout((4096, 12288)) == (NamedSharding(SLICES, P(None, BOTH)), None)  # the one that divides by 12


def test_no_dimension_divisible_by_any_data_axis_stays_whole():
  s = NamedSharding(SLICES, P())
  assert layout((5, 7)) == (s, Reason.NOT_DIVISIBLE)
  assert layout((2, 2)) == (s, Reason.NOT_DIVISIBLE)  # 2 divides by neither 3 nor 4


def test_the_rest_of_the_data_axes_go_to_another_dimension_that_takes_them():
  # 4096 takes data (4), 15 then takes replica (3): split over all 12, on two dimensions.
  assert layout((4096, 15)) == (NamedSharding(SLICES, P("data", "replica")), None)
  once = zero1_sharding((4096, 15), NamedSharding(SLICES, P()), BOTH)
  assert zero1_sharding((4096, 15), once, BOTH) == once


def test_equal_products_keep_the_axis_listed_last():
  square = AbstractMesh((4, 4), ("replica", "data"))
  assert layout((8,), mesh=square) == (NamedSharding(square, P("data")), Reason.PARTLY_SPLIT)
  assert layout((8,), axis=("data", "replica"), mesh=square) == (NamedSharding(square, P("replica")),
                                                                  Reason.PARTLY_SPLIT)
  # product first: replica (3) alone is smaller than data (4) even when listed last
  assert layout((24,), axis=("data", "replica")) == (NamedSharding(SLICES, P(("data", "replica"))), None)
  assert layout((4096,), axis=("data", "replica"))[0].spec == P("data")


def test_a_partial_split_prefers_a_dimension_that_keeps_more_than_one_row_per_device():
  assert layout((4, 64))[0].spec == P(None, "data")
  assert layout((4, 2))[0].spec == P("data")


def test_a_partial_split_composes_with_tensor_and_fsdp_axes():
  assert layout((4096, 14336), P(None, "tp")) == (NamedSharding(SLICES, P("data", "tp")), Reason.PARTLY_SPLIT)
  assert layout((8, 6), P("tp")) == (NamedSharding(SLICES, P(("tp", "data"), "replica")), None)
  # FSDP over data already: replica divides nothing left, so the parameter's own layout stands
  assert layout((4096,), P("data")) == (NamedSharding(SLICES, P("data")), Reason.ALREADY_SHARDED)


def test_only_a_partly_split_leaf_says_so():
  assert is_split(Reason.PARTLY_SPLIT) and is_split(Reason.DECLARED) and is_split(None)
  assert not any(is_split(r) for r in (Reason.NOT_DIVISIBLE, Reason.SCALAR, Reason.NOT_PARAM_SHAPED))


# -- a layout the Variable declares (optimizer_sharding): honoured, or refused saying why ------------


def declared(shape, spec, existing=None, axis=BOTH, mesh=SLICES):
  return declared_layout(shape, NamedSharding(mesh, existing or P()), spec, axis)


def test_a_declared_layout_over_the_data_axes_is_honoured():
  assert declared((12, 24), P(None, BOTH)) == (NamedSharding(SLICES, P(None, BOTH)), Reason.DECLARED)
  assert declared((8, 24), P(None, ("tp", "data")), P(None, "tp"), "data") == (
      NamedSharding(SLICES, P(None, ("tp", "data"))), Reason.DECLARED)
  # the part the rule would pick where nothing divides by all of them, on another dimension
  assert declared((4096, 1024), P(None, "data")) == (NamedSharding(SLICES, P(None, "data")), Reason.DECLARED)
  # a leaf the rule leaves whole, declared as it is: the rule's answer
  s = NamedSharding(SLICES, P())
  assert declared((5, 7), P()) == (s, Reason.NOT_DIVISIBLE)


@pytest.mark.parametrize(
    "shape, spec, existing, message",
    [
        ((12, 24), P(None, "tp"), P(), "not data axes"),
        ((12, 24), P(), P(),
         r"names no data axis, so every replica would hold the whole state.*\('replica', 'data'\)"),
        ((12, 24), P(None, "data"), P(),
         r"splits the state over \('data',\) \(4 replicas\), where the layout rule splits it over "
         r"\('replica', 'data'\) \(12"),
        ((4096, 15), P(None, "replica"), P(), r"\('replica',\) \(3 replicas\).*\('data', 'replica'\) \(12"),
        ((12, 10), P(None, BOTH), P(),
         r"dimension 1 of shape \(12, 10\) does not divide by \('replica', 'data'\)"),
        ((12, 24), P(None, "batch"), P(), "'batch', which is not a mesh axis"),
        ((12, 24), P("data", "data"), P(), "twice"),
        ((12,), P(None, "data"), P(), "more entries than"),
        ((12, 24), P(BOTH), P(None, "tp"), r"does not keep the parameter's own layout"),
        ((8, 24), P(None, ("data", "tp")), P(None, "tp"), r"does not keep the parameter's own layout"),
    ],
)
def test_a_declared_layout_zero1_cannot_honour_is_refused_saying_why(shape, spec, existing, message):
  with pytest.raises(Zero1Error, match=message):
    declared(shape, spec, existing)
