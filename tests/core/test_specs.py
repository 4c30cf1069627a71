"""The PartitionSpec helpers: one spelling per layout, on both mesh kinds."""

import jax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_zero1 import Zero1Error
from nnx_zero1._src.specs import (
    axes_entry,
    canonical_spec,
    data_axes,
    data_axis_size,
    entry_axes,
    full_rank_sharding,
    is_explicit,
    padded_entries,
    spec_axes,
    spec_entries,
)

EXPLICIT = jax.make_mesh((2, 4), ("tp", "data"))
AUTO = jax.make_mesh((2, 4), ("tp", "data"), axis_types=(AxisType.Auto, AxisType.Auto))
MIXED = jax.make_mesh((2, 4), ("tp", "data"), axis_types=(AxisType.Explicit, AxisType.Auto))


def test_entries_and_axes():
  spec = P(("tp", "data"), None, "x", unreduced={"y"})
  assert spec_entries(spec) == (("tp", "data"), None, "x")  # tuple(spec) would raise here
  assert spec_axes(spec) == ("tp", "data", "x")
  assert [entry_axes(e) for e in (None, "a", ("a",), ("a", "b"), ())] == [(), ("a",), ("a",), ("a", "b"), ()]
  assert [axes_entry(a) for a in ((), ("a",), ("a", "b"))] == [None, "a", ("a", "b")]
  assert padded_entries(P("a"), 3) == ["a", None, None]
  assert padded_entries(P("a", None), 1) == ["a", None]  # never truncates


@pytest.mark.parametrize(
    "entries, expected",
    [
        ([], ()),
        ([None, None], ()),
        ([("data",), None], ("data",)),
        ([(), "tp"], (None, "tp")),
        ([None, ("tp", "data"), ()], (None, ("tp", "data"))),
    ],
)
def test_canonical_spec(entries, expected):
  spec = canonical_spec(entries)
  assert spec_entries(spec) == expected  # the exact spelling, not just PartitionSpec equality
  assert canonical_spec(spec_entries(spec)) == spec  # idempotent


def test_full_rank_sharding_pads_on_explicit_only():
  explicit = NamedSharding(EXPLICIT, P("data"))
  assert spec_entries(full_rank_sharding(explicit, 3).spec) == ("data", None, None)
  auto = NamedSharding(AUTO, P("data"))
  assert full_rank_sharding(auto, 3) is auto
  # What a jitted step hands back on an Explicit mesh is exactly the full-rank form.
  x = jax.device_put(jax.numpy.ones((8, 2)), explicit)
  assert jax.jit(lambda a: a * 2)(x).sharding == full_rank_sharding(explicit, 2)


def test_is_explicit():
  assert is_explicit(EXPLICIT) and is_explicit(NamedSharding(EXPLICIT, P()))
  assert not is_explicit(AUTO) and not is_explicit(NamedSharding(AUTO, P()))
  assert is_explicit(MIXED) and is_explicit(MIXED, ("tp",)) and not is_explicit(MIXED, ("data",))


def test_data_axes_and_size():
  assert data_axes("data") == ("data",) and data_axes(["tp", "data"]) == ("tp", "data")
  assert data_axis_size(EXPLICIT, "data") == 4 and data_axis_size(EXPLICIT, ("tp", "data")) == 8
  for bad in ((), ("data", "data"), ("data", 3)):
    with pytest.raises(Zero1Error):
      data_axes(bad)
  with pytest.raises(Zero1Error, match=r"'replica'.*\('tp', 'data'\)"):
    data_axis_size(EXPLICIT, ("replica", "data"))


def test_layout_reexports_keep_working():
  from nnx_zero1._src import layout

  assert layout.data_axes is data_axes and layout.data_axis_size is data_axis_size
  assert layout.spec_entries is spec_entries
