"""Property tests of the layout rule (hypothesis): random shapes of rank 0-4, random
existing specs, random meshes and data axes always give a valid ``NamedSharding`` that
keeps the existing axes, uses each data axis at most once (adding only those of a tuple
data axis the spec does not use yet), divides every dimension, is idempotent, splits
over the largest part of a tuple data axis some dimension takes where none takes all of
it (and says so), and leaves unsplittable leaves exactly as they were."""

import functools
import itertools
import math

import jax
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_zero1 import zero1_sharding
from nnx_zero1._src.layout import Reason, zero1_layout
from nnx_zero1._src.specs import data_axes

NAMES = ("data", "tp", "fsdp", "replica")
SIZES = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24)
CONCRETE = ((8,), (2, 4), (4, 2), (2, 2, 2), (1, 8), (4, 1, 2), (4,), (2, 2), (1,))
PROPERTY = settings(max_examples=900, deadline=None, database=None)


@functools.cache
def concrete_mesh(shape, names):
  return jax.make_mesh(shape, names, devices=jax.devices()[: math.prod(shape)])


def entries(spec, rank):
  """Each dimension's tuple of mesh axes (a spec may leave trailing dimensions out)."""
  parts = [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in spec]
  return parts + [()] * (rank - len(parts))


@st.composite
def cases(draw, concrete: bool):
  if concrete:
    sizes = draw(st.sampled_from(CONCRETE))
    names = tuple(draw(st.permutations(NAMES))[: len(sizes)])
    mesh = concrete_mesh(sizes, names)
  else:
    names = tuple(draw(st.permutations(NAMES))[: draw(st.integers(1, 3))])
    sizes = tuple(draw(st.lists(st.integers(1, 4), min_size=len(names), max_size=len(names))))
    mesh = AbstractMesh(sizes, names)
  data = tuple(draw(st.permutations(names))[: draw(st.integers(1, min(2, len(names))))])
  data_axis = data[0] if len(data) == 1 and draw(st.booleans()) else data
  shape = tuple(draw(st.lists(st.sampled_from(SIZES), min_size=0, max_size=4)))
  # An existing spec that is itself valid: each axis on at most one dimension it divides.
  parts = [() for _ in shape]
  for name in draw(st.permutations(names)):
    dim = draw(st.integers(-1, len(shape) - 1))
    if dim >= 0 and shape[dim] % (math.prod(mesh.shape[a] for a in parts[dim]) * mesh.shape[name]) == 0:
      parts[dim] += (name,)
  spec = [None if not p else p[0] if len(p) == 1 and draw(st.booleans()) else p for p in parts]
  while spec and spec[-1] is None and draw(st.booleans()):
    spec.pop()
  return mesh, shape, P(*spec), data_axis


def check_rule(mesh, shape, spec, data_axis):
  before = NamedSharding(mesh, spec)
  after = zero1_sharding(shape, before, data_axis)
  rank = len(shape)
  width = lambda part: math.prod(mesh.shape[a] for a in part)
  old, new = entries(spec, rank), entries(after.spec, rank)

  assert isinstance(after, NamedSharding) and after.mesh == mesh
  assert len(tuple(after.spec)) <= rank
  used = [a for part in new for a in part]
  assert len(used) == len(set(used)) and set(used) <= set(mesh.axis_names)  # each axis at most once
  for size, part in zip(shape, new):
    assert size % width(part) == 0
  assert len(after.shard_shape(shape)) == rank
  assert all(n[: len(o)] == o for o, n in zip(old, new))  # existing axes kept, in place
  assert zero1_sharding(shape, after, data_axis) == after  # idempotent

  axes = data_axes(data_axis)
  missing = tuple(a for a in axes if not any(a in part for part in old))  # only these are added
  n = math.prod(mesh.shape[a] for a in missing)
  fits = [i for i, (size, part) in enumerate(zip(shape, old)) if size % (width(part) * n) == 0]
  reason = zero1_layout(shape, before, data_axis)[1]
  if not missing or not shape:  # scalars, leaves on every data axis
    assert after == before
  elif fits:  # the first dimension that can take the missing data axes and keeps more than one row
    # per device gets them (else the first that can take them); nothing else changes
    rows = [i for i in fits if shape[i] // (width(old[i]) * n) > 1]
    chosen = (rows or fits)[0]
    assert new == [o + missing if i == chosen else o for i, o in enumerate(old)]
    assert reason is None
  else:  # no dimension takes them all: the largest part some dimension takes, then what is left
    check_partial_split(mesh, shape, old, new, missing, reason)
  if len(axes) > 1 and missing:  # composes: adding one data axis, then the others, is adding them all
    for first in axes:
      once = zero1_sharding(shape, zero1_sharding(shape, before, first), data_axis)
      assert entries(once.spec, rank) == entries(zero1_sharding(shape, once, data_axis).spec, rank)
      assert all(sum(a in part for part in entries(once.spec, rank)) <= 1 for a in axes)


def parts_of(axes):
  """Every non-empty part of ``axes``, in their order."""
  return [p for k in range(1, len(axes) + 1) for p in itertools.combinations(axes, k)]


def check_partial_split(mesh, shape, old, new, missing, reason):
  width = lambda part: math.prod(mesh.shape[a] for a in part)
  takes = lambda entries, part: any(size % (width(e) * width(part)) == 0 for size, e in zip(shape, entries))
  added = [n[len(o):] for o, n in zip(old, new)]
  assert all(set(p) <= set(missing) for p in added)
  left = tuple(a for a in missing if not any(a in p for p in added))
  # A fixed point: no part of what is left (that splits something) fits any dimension now.
  for part in parts_of(left):
    if width(part) > 1 or part == left:
      assert not takes(new, part), (part, new)
  splitting = [p for p in parts_of(missing) if width(p) > 1 and takes(old, p)]
  if not splitting:  # nothing divides: the leaf stays as it is
    assert new == old
    assert reason in (Reason.NOT_DIVISIBLE, Reason.ALREADY_SHARDED)
  else:  # the first part added is the largest one any dimension takes, the rest on other dimensions
    assert max(width(p) for p in added) == max(width(p) for p in splitting)
    assert reason == (Reason.PARTLY_SPLIT if left else None)


@PROPERTY
@given(cases(concrete=False))
def test_layout_rule_on_abstract_meshes(case):
  check_rule(*case)


@settings(PROPERTY, max_examples=300)
@given(cases(concrete=True))
def test_layout_rule_on_meshes_of_the_8_devices(case):
  check_rule(*case)
