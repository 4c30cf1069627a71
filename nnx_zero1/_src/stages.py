"""Collectives over several mesh axes, one axis at a time: what each network carries on a pod.

A data axis tuple lists the slow axis first (``("replica", "data")``: ``replica`` across TPU
slices or GPU nodes, ``data`` inside each). The compilers lower one collective over both axes
in ways that can send more over a network than its share (the TPU compiler turns one
``psum_scatter`` over both into an all-reduce inside each slice and a reduce-scatter across);
reduced one axis at a time, the axis listed last first, each network carries a reduce-scatter's
or an all-reduce's bytes of what reaches it, and every replica sums in the same order, so a plain
optimizer's gradients and Zero-1's stay equal to the bit. Both functions run inside ``shard_map``;
:mod:`nnx_zero1._src.reduction` decides which leaf takes which.

:class:`Across` narrows the stages over the slow axes: what crosses between slices or nodes goes
in a narrower dtype (``bfloat16``: half the bytes), the stages inside at the gradient's own.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax

__all__ = ["EXACT", "Across", "all_reduce_by_stages", "psum_by_network", "scatter_by_stages"]


@dataclasses.dataclass(frozen=True)
class Across:
  """The data axes between slices or nodes, and the dtype the gradients cross them in.

  Attributes:
    axes: the slow axes (every data axis but the last listed: ``("replica",)`` of ``("replica", "data")``).
    dtype: the dtype of a collective over them; ``None``: the gradient's own (bit-identical).

  Example::

    >>> import jax.numpy as jnp
    >>> Across(frozenset({"replica"}), jnp.bfloat16).narrows(("replica",)), EXACT.narrows(("replica",))
    (True, False)
  """

  axes: frozenset[str] = frozenset()
  dtype: Any = None

  def narrows(self, over: tuple[str, ...]) -> bool:
    """Whether a collective over ``over`` runs narrowed: a dtype is set and ``over`` is all slow axes."""
    return self.dtype is not None and bool(over) and set(over) <= self.axes

  def run(self, collective: Callable[[jax.Array], jax.Array], x: jax.Array,
          over: tuple[str, ...]) -> jax.Array:
    """``collective(x)``, in :attr:`dtype` where it runs over the slow axes, back in ``x``'s dtype."""
    if not self.narrows(over):
      return collective(x)
    return collective(x.astype(self.dtype)).astype(x.dtype)


EXACT = Across()
"""Every stage in the gradient's own dtype."""


def psum_by_network(x: jax.Array, axes: tuple[str, ...], across: Across = EXACT) -> jax.Array:
  """Inside ``shard_map``: ``psum`` over ``axes``; with a narrowed :class:`Across`, the axes inside first,
  then the slow ones in its dtype (an all-reduce of the narrowed sum)."""
  slow = tuple(a for a in axes if a in across.axes)
  if not across.narrows(slow):
    return jax.lax.psum(x, axes)
  inside = tuple(a for a in axes if a not in across.axes)
  x = jax.lax.psum(x, inside) if inside else x
  return across.run(lambda v: jax.lax.psum(v, slow), x, slow)


def all_reduce_by_stages(x: jax.Array, axes: tuple[str, ...], across: Across = EXACT) -> jax.Array:
  """Inside ``shard_map``: ``psum`` of ``x`` over ``axes``, the axis listed last first: a reduce-scatter
  over it, the slice all-reduced over the others, then all-gathered back.

  The bytes on each network are one all-reduce's, as the TPU compiler lowers a ``psum`` over a slice's
  and the slices' axes, and every replica sums in the order :func:`scatter_by_stages` and
  :func:`reduce_local` do (inside the last axis first), so a plain optimizer's gradients are Zero-1's to
  the bit, wherever Zero-1 splits them. One axis, or no dimension that divides by the last axis's size:
  one ``psum`` (two with a narrowed ``across``: inside, then across). ``across`` names the slow axes
  and the dtype their stages run in.

  Example::

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((1, 1), ("replica", "data"))
    >>> f = lambda g: all_reduce_by_stages(g, ("replica", "data"))
    >>> jax.shard_map(f, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)(jnp.arange(4.0)).tolist()
    [0.0, 1.0, 2.0, 3.0]
  """
  inner, outer = axes[-1], axes[:-1]
  size = jax.lax.axis_size(inner)
  dim = next((d for d, n in enumerate(x.shape) if n % size == 0), None)
  if not outer or dim is None:
    return psum_by_network(x, axes, across)
  x = across.run(lambda v: jax.lax.psum_scatter(v, inner, scatter_dimension=dim, tiled=True), x, (inner,))
  x = all_reduce_by_stages(x, outer, across)
  return across.run(lambda v: jax.lax.all_gather(v, inner, axis=dim, tiled=True, to="invarying"), x, (inner,))


def scatter_by_stages(x: jax.Array, over: tuple[str, ...], dim: int, across: Across = EXACT) -> jax.Array:
  """Inside ``shard_map``: ``psum_scatter`` of ``x`` over the axes ``over`` on ``dim``, one axis at a time,
  the axis listed last first, onto the block ``P((*over,))`` gives this replica.

  A data axis tuple lists the slow axis first (``("replica", "data")``: ``replica`` across TPU slices or
  GPU nodes). The TPU compiler lowers one ``psum_scatter`` over both as an all-reduce inside each slice
  and a reduce-scatter across them; scattered over ``data`` first and then over ``replica``, it is a
  reduce-scatter inside the slice and one across, half the bytes inside and the same across. The blocks
  of ``dim`` are reordered first (a local transpose) so that the scatter over the last axis listed takes
  the outermost blocks, and the result is this replica's block of the layout ``over`` names, as one
  ``psum_scatter`` over all of them would give it (the sums taken in another order).

  Args:
    x: this replica's partial sum (whole along ``dim``, which divides by the axes' sizes).
    over: the mesh axes, as the target layout lists them on ``dim``.
    dim: the dimension scattered.
    across: the slow axes and the dtype their stages run in (default: every stage exact).

  Returns:
    The sum over ``over`` of this replica's block, ``x.shape[dim] // prod(sizes)`` along ``dim``.

  Example::

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((1, 1), ("replica", "data"))
    >>> f = lambda g: scatter_by_stages(g, ("replica", "data"), 0)
    >>> jax.shard_map(f, mesh=mesh, in_specs=P(), out_specs=P(("replica", "data")), check_vma=False)(
    ...     jnp.arange(4.0)).tolist()
    [0.0, 1.0, 2.0, 3.0]
  """
  scatter = lambda axis: lambda v: jax.lax.psum_scatter(v, axis, scatter_dimension=dim, tiled=True)
  if len(over) == 1:
    return across.run(scatter(over), x, over)
  sizes = tuple(jax.lax.axis_size(a) for a in over)
  blocks = x.shape[dim] // math.prod(sizes)
  split = x.reshape(*x.shape[:dim], *sizes, blocks, *x.shape[dim + 1:])
  k = len(over)
  order = (*range(dim), *reversed(range(dim, dim + k)), *range(dim + k, split.ndim))
  x = split.transpose(order).reshape(x.shape)
  for axis in reversed(over):
    x = across.run(scatter(axis), x, (axis,))
  return x
