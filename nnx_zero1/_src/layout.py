"""The Zero-1 layout rules: where an optimizer leaf lives, and why it is not split.

Pure functions of (shape, sharding, data axis). :func:`zero1_layout` is the rule
for a parameter-shaped leaf: it keeps the leaf's existing partitioning and adds
the data axis to the first dimension that can take it and keeps more than one
row per device (else to the first that can take it). :func:`statistic_layout`
is the rule for a per-parameter statistic that keeps only some of its
parameter's dimensions (adafactor's factored moments). Every leaf left whole
carries a :class:`Reason`, which ``report`` shows.
"""

from __future__ import annotations

import enum
import itertools
import math
from collections.abc import Sequence

from jax.sharding import NamedSharding, PartitionSpec

from nnx_zero1._src.errors import Zero1Error
from nnx_zero1._src.specs import (
    DataAxis,
    canonical_spec,
    check_data_axes_on_mesh,
    data_axes,
    data_axis_size,
    entry_axes,
    padded_entries,
    spec_axes,
    spec_entries,
)

__all__ = [
    "Reason",
    "memory_layout",
    "statistic_layout",
    "zero1_layout",
    "zero1_sharding",
]


class Reason(enum.StrEnum):
  """Why an optimizer leaf keeps its layout instead of being split over the data axis.

  A ``str`` enum (``enum.StrEnum``): it compares equal to, and prints as, its text.

  Example::

    >>> Reason.SCALAR == "scalar", f"{Reason.SCALAR}"
    (True, 'scalar')
  """

  SCALAR = "scalar"
  ALREADY_SHARDED = "already sharded over the data axis"
  NOT_DIVISIBLE = "no dimension divisible by the data-axis size"
  NOT_PARAM_SHAPED = "not parameter-shaped"
  NOT_ALIGNED = "statistic over the dimension its parameter is split on"
  PARAM_NOT_SPLIT = "statistic of a parameter that is not split"
  ONE_DEVICE = "data-parallel size 1 (one device, no mesh)"
  AMBIGUOUS = "per-parameter statistic whose dimensions match its parameter's in more than one way"


def zero1_layout(
    shape: Sequence[int], sharding: NamedSharding, data_axis: DataAxis = "data"
) -> tuple[NamedSharding, Reason | None]:
  """Like :func:`zero1_sharding`, and also says why a leaf was left as it was.

  Returns ``(sharding, reason)``; ``reason`` is ``None`` when the data axis was
  added and otherwise :attr:`Reason.SCALAR`, :attr:`Reason.ALREADY_SHARDED` or
  :attr:`Reason.NOT_DIVISIBLE`.

  Example::

    >>> import jax
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> str(zero1_layout((), NamedSharding(mesh, P()))[1])
    'scalar'
  """
  mesh = sharding.mesh
  axes = data_axes(data_axis)
  check_data_axes_on_mesh(mesh, axes)
  if len(spec_entries(sharding.spec)) > len(shape):
    raise Zero1Error(f"sharding spec {sharding.spec} has more entries than shape {tuple(shape)}")
  # With a tuple data axis, a spec may use some of them (FSDP over one): add only the others.
  missing = tuple(a for a in axes if a not in spec_axes(sharding.spec))
  if not missing:
    return sharding, Reason.ALREADY_SHARDED
  if not shape:
    return sharding, Reason.SCALAR
  n = data_axis_size(mesh, missing)
  entries = padded_entries(sharding.spec, len(shape))
  # Per device, dimension `dim` keeps size // parts[dim] (parts: the axes on it x the data axes).
  parts = [math.prod(mesh.shape[a] for a in entry_axes(entry)) * n for entry in entries]
  divisible = [dim for dim, size in enumerate(shape) if size % parts[dim] == 0]
  if not divisible:
    return sharding, Reason.ALREADY_SHARDED if len(missing) < len(axes) else Reason.NOT_DIVISIBLE
  # Prefer a dimension that keeps more than one row per device: a slice with a new size-1
  # dimension changes XLA's fusions (a transposed gradient's transpose becomes a bitcast) and
  # with them which multiply-add the CPU backend contracts into an FMA, so it rounds
  # differently from the whole leaf (docs/how_it_works.md, "The layout rule").
  dim = next((d for d in divisible if shape[d] // parts[d] > 1), divisible[0])
  entries[dim] = entry_axes(entries[dim]) + missing
  # Optimizer state holds whole values: never partial sums (unreduced) or reduced copies.
  return NamedSharding(mesh, canonical_spec(entries), memory_kind=sharding.memory_kind), None


def zero1_sharding(
    shape: Sequence[int], sharding: NamedSharding, data_axis: DataAxis = "data"
) -> NamedSharding:
  """The Zero-1 layout of an optimizer leaf whose parameter has ``sharding``.

  Keeps every axis already in the spec and adds the data axis (or axes) to the
  first dimension whose size divides by (the product of the axes already on it)
  x (the data-axis size) and leaves more than one row per device; if every such
  dimension would leave one row, to the first of them. With a tuple data axis only the data axes the spec
  does not use yet are added (never one twice). A spec that uses every data
  axis, a scalar, or a leaf with no such dimension is returned unchanged. The
  rule is idempotent.

  Args:
    shape: the leaf's shape (its parameter's).
    sharding: the parameter's ``NamedSharding``.
    data_axis: the data-parallel mesh axis, or a tuple of axes.

  Returns:
    The leaf's ``NamedSharding`` on the same mesh.

  Raises:
    Zero1Error: a data axis is not on the mesh, or the spec has more entries than ``shape``.

  Example::

    >>> import jax
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((1, 1), ("data", "tp"))
    >>> zero1_sharding((8, 6), NamedSharding(mesh, P(None, "tp"))).spec
    P('data', 'tp')
    >>> mesh = jax.make_mesh((4, 2), ("data", "tp"))  # 4 rows over 4 replicas would leave 1 each
    >>> zero1_sharding((4, 128), NamedSharding(mesh, P(None, "tp"))).spec
    P(None, ('tp', 'data'))
    >>> zero1_sharding((4, 6), NamedSharding(mesh, P())).spec  # no other dimension divides
    P('data',)
    >>> mesh = jax.make_mesh((1, 1), ("replica", "data"))
    >>> zero1_sharding((8, 6), NamedSharding(mesh, P(None, "data")), ("replica", "data")).spec
    P('replica', 'data')
  """
  return zero1_layout(shape, sharding, data_axis)[0]


def statistic_layout(
    shape: tuple[int, ...], param_shape: tuple[int, ...], param_zero1: NamedSharding, data_axis
) -> tuple[NamedSharding, Reason | None]:
  """Layout of a per-parameter statistic that keeps some of its parameter's dimensions.

  Adafactor's factored second moments drop one dimension of their parameter.
  Each dimension the statistic keeps keeps its entry of the parameter's Zero-1
  spec, so the statistic lines up with the sliced gradient (on an Explicit mesh
  anything else is an illegal sharding). It is split over the data axis only
  if it keeps the dimension that carries it; ``reason`` says why not otherwise.
  If its dimensions match the parameter's in more than one way with different
  layouts (a square matrix), it stays replicated.

  Example::

    >>> import jax
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> zero1 = NamedSharding(mesh, P("data"))
    >>> statistic_layout((16,), (16, 32), zero1, ("data",))[0].spec
    P('data',)
    >>> str(statistic_layout((32,), (16, 32), zero1, ("data",))[1])
    'statistic over the dimension its parameter is split on'
  """
  mesh = param_zero1.mesh
  replicated = NamedSharding(mesh, PartitionSpec())
  if not shape:  # a per-parameter scalar (NovoGrad's second moment)
    return replicated, Reason.SCALAR
  entries = padded_entries(param_zero1.spec, len(param_shape))
  specs = {
      tuple(entries[k] for k in kept)
      for kept in itertools.combinations(range(len(param_shape)), len(shape))
      if tuple(param_shape[k] for k in kept) == tuple(shape)
  }
  if not specs:
    return replicated, Reason.NOT_PARAM_SHAPED
  if len(specs) > 1:
    return replicated, Reason.AMBIGUOUS
  spec = canonical_spec(specs.pop())
  sharding = NamedSharding(mesh, spec, memory_kind=param_zero1.memory_kind)
  axes = set(data_axis)
  if axes & set(spec_axes(spec)):
    return sharding, None
  return sharding, Reason.NOT_ALIGNED if axes & set(spec_axes(param_zero1.spec)) else Reason.PARAM_NOT_SPLIT


def memory_layout(param_zero1: NamedSharding) -> NamedSharding:
  """Layout of a stack of parameter-shaped values (lbfgs's memories, shape ``(k, *param)``):
  the leading axis whole on every replica, then the parameter's Zero-1 layout.

  Example::

    >>> import jax
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> memory_layout(NamedSharding(mesh, P("data"))).spec
    P(None, 'data')
  """
  entries = spec_entries(param_zero1.spec)
  spec = canonical_spec((None, *entries))
  return NamedSharding(param_zero1.mesh, spec, memory_kind=param_zero1.memory_kind)
