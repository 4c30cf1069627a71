"""The Zero-1 layout rules: where an optimizer leaf lives, and why it is not split.

Pure functions of (shape, sharding, data axis). :func:`zero1_layout` is the rule
for a parameter-shaped leaf: it keeps the leaf's existing partitioning and adds
the data axis to the first dimension that can take it and keeps more than one
row per device (else to the first that can take it); where no dimension takes
all the data axes of a tuple, it adds the largest part of them that one does.
:func:`declared_layout` checks a layout the parameter's Variable declares
(``optimizer_sharding``) against that rule. :func:`statistic_layout` is the rule
for a per-parameter statistic that keeps only some of its parameter's
dimensions (adafactor's factored moments). Every leaf left whole, or split over
only some of the data axes, carries a :class:`Reason`, which ``report`` shows.
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
    data_axis_size,  # noqa: F401 -- re-exported: code that imported it from here keeps working
    entry_axes,
    padded_entries,
    spec_axes,
    spec_entries,
)

__all__ = [
    "NOTES",
    "Reason",
    "declared_layout",
    "is_split",
    "memory_layout",
    "statistic_layout",
    "zero1_layout",
    "zero1_sharding",
]


class Reason(enum.StrEnum):
  """Why an optimizer leaf keeps its layout instead of being split over the data axis, or, for a
  leaf that is split (:func:`is_split`), how: over only some of the data axes, or as declared.

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
  # Two notes on leaves that *are* split (``is_split``): how, not why not.
  PARTLY_SPLIT = "split over only some of the data axes: no dimension divides by all of them"
  DECLARED = "laid out as the variable's optimizer_sharding declares"


NOTES = frozenset({Reason.PARTLY_SPLIT, Reason.DECLARED})
"""The reasons that say how a split leaf is split, not why a leaf is whole."""
_SPLIT = NOTES | {Reason.ALREADY_SHARDED}


def is_split(reason: Reason | None) -> bool:
  """Whether a leaf with this layout ``reason`` is split over (some of) the data axes.

  ``None`` (the rule added every data axis), :attr:`Reason.PARTLY_SPLIT`,
  :attr:`Reason.DECLARED` and :attr:`Reason.ALREADY_SHARDED` (its parameter's
  own layout splits it) are split; every other reason leaves the leaf whole on
  each replica.

  Example::

    >>> is_split(None), is_split(Reason.PARTLY_SPLIT), is_split(Reason.NOT_DIVISIBLE)
    (True, True, False)
  """
  return reason is None or reason in _SPLIT


def _width(mesh, axes: Sequence[str]) -> int:
  return math.prod(mesh.shape[a] for a in axes)


def _by_preference(missing: tuple[str, ...], mesh) -> list[tuple[str, ...]]:
  """The parts of ``missing`` the rule may add, best first: all of them, then the largest
  product; among equal products the one keeping the axes listed last (by convention the
  outer, slow axis such as ``replica`` comes first, so it is the first dropped). A part
  of product 1 splits nothing, so only all of them may have it (a data axis of size 1)."""
  rank = {a: i for i, a in enumerate(missing)}
  parts = [
      part for k in range(len(missing), 0, -1) for part in itertools.combinations(missing, k)
      if part == missing or _width(mesh, part) > 1
  ]
  return sorted(parts, key=lambda part: (-_width(mesh, part), -sum(1 << rank[a] for a in part)))


def _add_once(shape: Sequence[int], entries: list, mesh, missing: tuple[str, ...]):
  """The best part of ``missing`` some dimension can take, and that dimension; None if none can."""
  for part in _by_preference(missing, mesh):
    # Per device, dimension `dim` keeps size // parts[dim] (the axes on it x the part added).
    parts = [_width(mesh, entry_axes(entry)) * _width(mesh, part) for entry in entries]
    divisible = [dim for dim, size in enumerate(shape) if size % parts[dim] == 0]
    if divisible:
      # Prefer a dimension that keeps more than one row per device: a slice with a new size-1
      # dimension changes XLA's fusions (a transposed gradient's transpose becomes a bitcast) and
      # with them which multiply-add the CPU backend contracts into an FMA, so it rounds
      # differently from the whole leaf (docs/how_it_works.md, "The layout rule").
      return next((d for d in divisible if shape[d] // parts[d] > 1), divisible[0]), part
  return None


def zero1_layout(
    shape: Sequence[int], sharding: NamedSharding, data_axis: DataAxis = "data"
) -> tuple[NamedSharding, Reason | None]:
  """Like :func:`zero1_sharding`, and also says why a leaf was left as it was.

  Returns ``(sharding, reason)``; ``reason`` is ``None`` when every data axis
  was added, :attr:`Reason.PARTLY_SPLIT` when only some of them could be
  (the leaf is split, over fewer replicas), and otherwise :attr:`Reason.SCALAR`,
  :attr:`Reason.ALREADY_SHARDED` or :attr:`Reason.NOT_DIVISIBLE`.

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
    raise Zero1Error(f"sharding spec {sharding.spec} has more entries than shape {tuple(shape)}; pass one "
                     "entry per dimension at most")
  # With a tuple data axis, a spec may use some of them (FSDP over one): add only the others.
  missing = tuple(a for a in axes if a not in spec_axes(sharding.spec))
  if not missing:
    return sharding, Reason.ALREADY_SHARDED
  if not shape:
    return sharding, Reason.SCALAR
  entries = padded_entries(sharding.spec, len(shape))
  left = missing
  # Until no dimension takes what is left: the rule's own output then adds nothing (idempotent),
  # also where one part of the data axes fits one dimension and the rest another.
  while left and (step := _add_once(shape, entries, mesh, left)) is not None:
    dim, part = step
    entries[dim] = entry_axes(entries[dim]) + part
    left = tuple(a for a in left if a not in part)
  if left == missing:
    return sharding, Reason.ALREADY_SHARDED if len(missing) < len(axes) else Reason.NOT_DIVISIBLE
  # Optimizer state holds whole values: never partial sums (unreduced) or reduced copies.
  split = NamedSharding(mesh, canonical_spec(entries), memory_kind=sharding.memory_kind)
  return split, Reason.PARTLY_SPLIT if left else None


def zero1_sharding(
    shape: Sequence[int], sharding: NamedSharding, data_axis: DataAxis = "data"
) -> NamedSharding:
  """The Zero-1 layout of an optimizer leaf whose parameter has ``sharding``.

  Keeps every axis already in the spec and adds the data axis (or axes) to the
  first dimension whose size divides by (the product of the axes already on it)
  x (the data-axis size) and leaves more than one row per device; if every such
  dimension would leave one row, to the first of them. With a tuple data axis only
  the data axes the spec does not use yet are added (never one twice); where no
  dimension divides by all of them, the largest product of some of them that a
  dimension divides by is added the same way (among equal products, keeping the
  axes listed last: ``("replica", "data")`` drops ``replica`` first), and then
  the same for those still missing, until no dimension takes any more (a leaf
  split over only some data axes, ``Reason.PARTLY_SPLIT``). A spec that uses
  every data axis, a scalar, or a leaf with no such dimension is returned
  unchanged. The rule is idempotent.

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
    >>> mesh = jax.make_mesh((2, 4), ("replica", "data"))  # 20 and 5 divide by 4, neither by 8
    >>> zero1_sharding((20, 5), NamedSharding(mesh, P()), ("replica", "data")).spec
    P('data',)
  """
  return zero1_layout(shape, sharding, data_axis)[0]


def _added(before: Sequence, after: Sequence) -> tuple[str, ...]:
  """The axes ``after``'s entries add to ``before``'s (both padded to the same rank)."""
  return tuple(a for b, e in zip(before, after) for a in entry_axes(e)[len(entry_axes(b)):])


def declared_layout(
    shape: Sequence[int], sharding: NamedSharding, declared: PartitionSpec, data_axis: DataAxis = "data"
) -> tuple[NamedSharding, Reason | None]:
  """The Zero-1 layout of a leaf whose parameter's Variable declares ``optimizer_sharding``.

  ``declared`` is honoured when it is the parameter's layout with data axes
  appended to its entries (the layout Zero-1 reduce-scatters the gradient onto
  and gathers the parameter back from), divides every dimension, and splits the
  leaf over at least as many replicas as :func:`zero1_layout` would.

  Args:
    shape: the leaf's shape (its parameter's).
    sharding: the parameter's ``NamedSharding``.
    declared: the spec the Variable's ``optimizer_sharding`` names (logical names resolved).
    data_axis: the data-parallel mesh axis, or a tuple of axes.

  Returns:
    ``(sharding, reason)``: the declared layout and :attr:`Reason.DECLARED`; where it
    adds no data axis to a leaf the rule leaves as it is too, the rule's own answer.

  Raises:
    Zero1Error: saying why ``declared`` cannot be honoured: an axis not on the mesh
      or named twice, more entries than dimensions, a dimension its axes do not
      divide, the parameter's own axes not kept first, an axis added that is no
      data axis, or fewer replicas than the rule (no data axis at all: the state
      would be whole on every replica).

  Example::

    >>> import jax
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((2,), ("data",))
    >>> layout, reason = declared_layout((8, 6), NamedSharding(mesh, P()), P(None, "data"))
    >>> layout.spec, str(reason)
    (P(None, 'data'), "laid out as the variable's optimizer_sharding declares")
  """
  mesh = sharding.mesh
  axes = data_axes(data_axis)
  rule, reason = zero1_layout(shape, sharding, axes)
  named = spec_axes(declared)
  unknown = [a for a in named if a not in mesh.axis_names]
  if unknown:
    raise Zero1Error(f"it names {unknown[0]!r}, which is not a mesh axis")
  if len(set(named)) != len(named):
    raise Zero1Error("it names a mesh axis twice")
  if len(spec_entries(declared)) > len(shape):
    raise Zero1Error(f"it has more entries than the leaf's shape {tuple(shape)} has dimensions")
  entries = padded_entries(declared, len(shape))
  for dim, (size, entry) in enumerate(zip(shape, entries)):
    if size % _width(mesh, entry_axes(entry)):
      raise Zero1Error(
          f"dimension {dim} of shape {tuple(shape)} does not divide by {entry_axes(entry)} "
          f"({_width(mesh, entry_axes(entry))} devices)"
      )
  own = padded_entries(sharding.spec, len(shape))
  if any(entry_axes(e)[: len(entry_axes(o))] != entry_axes(o) for o, e in zip(own, entries)):
    raise Zero1Error(
        f"it does not keep the parameter's own layout {sharding.spec} first on each dimension "
        f"(Zero-1 reduce-scatters the gradient onto the state's layout and gathers the parameter "
        f"back from it: declare the parameter's axes with data axes after them)"
    )
  added = _added(own, entries)
  others = [a for a in added if a not in axes]
  if others:
    raise Zero1Error(f"it adds {tuple(others)} to the parameter's layout, which are not data axes {axes}")
  by_rule = _added(own, padded_entries(rule.spec, len(shape)))
  if _width(mesh, added) < _width(mesh, by_rule):
    held = "names no data axis, so every replica would hold the whole state" if not added else (
        f"splits the state over {added} ({_width(mesh, added)} replicas)")
    raise Zero1Error(
        f"it {held}, where the layout rule splits it over {by_rule} ({_width(mesh, by_rule)} replicas) "
        f"as {rule.spec}"
    )
  if not added and reason not in (None, Reason.PARTLY_SPLIT):
    return rule, reason  # the parameter's layout, as the rule leaves it (nothing divides, FSDP, a scalar)
  return NamedSharding(mesh, canonical_spec(entries), memory_kind=sharding.memory_kind), Reason.DECLARED


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
