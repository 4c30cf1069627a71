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
in a narrower dtype (``bfloat16``: half the bytes; ``int8`` blocks with scales: a quarter and the
scales), the stages inside at the gradient's own. :func:`gather_by_stages` is the way back: the new
parameters' all-gather, the hop across narrowed first, then the one inside at full precision.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from nnx_zero1._src.errors import Zero1Error, describe_mesh

__all__ = [
    "EXACT", "INT8_BLOCK", "Across", "across_for", "all_reduce_by_stages", "dequantize", "gather_by_stages",
    "int8_all_gather", "int8_psum", "int8_psum_scatter", "psum_by_network", "quantize", "scatter_by_stages",
    "slow_axes",
]


@dataclasses.dataclass(frozen=True)
class Across:
  """The data axes between slices or nodes, and the dtype the gradients cross them in.

  A floating ``dtype`` (``bfloat16``) runs each collective over the slow axes in it. ``int8`` runs
  them block-scaled (:data:`INT8_BLOCK` values, one float32 scale each): a reduce-scatter as an
  all-to-all of quantized chunks, each peer dequantising and summing in float32 (its own chunk exact);
  an all-gather of the quantized blocks; an all-reduce as the two.

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

  @property
  def _blocks(self) -> bool:
    return self.dtype is not None and jnp.issubdtype(self.dtype, jnp.integer)

  def run(self, collective: Callable[[jax.Array], jax.Array], x: jax.Array,
          over: tuple[str, ...]) -> jax.Array:
    """``collective(x)``, in :attr:`dtype` where it runs over the slow axes, back in ``x``'s dtype
    (a floating :attr:`dtype`; the block-scaled int8 collectives are :meth:`psum`, :meth:`psum_scatter`
    and :meth:`all_gather`)."""
    if not self.narrows(over):
      return collective(x)
    return collective(x.astype(self.dtype)).astype(x.dtype)

  def psum(self, x: jax.Array, over: tuple[str, ...]) -> jax.Array:
    """``jax.lax.psum(x, over)``, narrowed where ``over`` is slow."""
    if self._blocks and self.narrows(over):
      return int8_psum(x, over)
    return self.run(lambda v: jax.lax.psum(v, over), x, over)

  def psum_scatter(self, x: jax.Array, over: tuple[str, ...], dim: int) -> jax.Array:
    """``jax.lax.psum_scatter(x, over, scatter_dimension=dim, tiled=True)``, narrowed where slow."""
    if self._blocks and self.narrows(over):
      return int8_psum_scatter(x, over, dim)
    return self.run(lambda v: jax.lax.psum_scatter(v, over, scatter_dimension=dim, tiled=True), x, over)

  def all_gather(self, x: jax.Array, over: tuple[str, ...], dim: int) -> jax.Array:
    """``jax.lax.all_gather(x, over, axis=dim, tiled=True)``, invariant over ``over``, narrowed where slow."""
    if self._blocks and self.narrows(over):
      return int8_all_gather(x, over, dim)
    return self.run(lambda v: jax.lax.all_gather(v, over, axis=dim, tiled=True, to="invarying"), x, over)


INT8_BLOCK = 256
"""The most values per float32 scale in the int8 collectives (a chunk of m values is split into the fewest
equal blocks of at most this many): 1 + 4/256 bytes per value across, a quarter of float32's and 1.6%
more."""


def quantize(x: jax.Array, block: int = INT8_BLOCK) -> tuple[jax.Array, jax.Array]:
  """``x`` (``(..., m)``, ``m`` a multiple of ``block``) as int8 blocks ``(..., m // block, block)`` and one
  float32 scale per block (its largest magnitude / 127), rounded to nearest.

  Example::

    >>> import jax.numpy as jnp
    >>> q, s = quantize(jnp.array([0.0, 1.0, -2.0, 0.5]), block=2)
    >>> q.tolist(), s.tolist()
    ([[0, 127], [-127, 32]], [0.007874015718698502, 0.015748031437397003])
  """
  blocks = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // block, block)
  scale = jnp.max(jnp.abs(blocks), axis=-1) / 127
  q = jnp.round(blocks / jnp.where(scale > 0, scale, 1)[..., None])
  return jnp.clip(q, -127, 127).astype(jnp.int8), scale


def dequantize(q: jax.Array, scale: jax.Array) -> jax.Array:
  """:func:`quantize`'s blocks back in float32, ``(..., m)``."""
  x = q.astype(jnp.float32) * scale[..., None]
  return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])


def _blocked(x: jax.Array) -> tuple[jax.Array, int]:
  """``x`` (``(..., m)``) padded with the fewest zeros that split its last dimension into equal blocks of at
  most :data:`INT8_BLOCK` values (fewer than one per block), and the block size."""
  m = x.shape[-1]
  blocks = max(1, -(-m // INT8_BLOCK))
  block = -(-m // blocks)
  pad = blocks * block - m
  return (jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)]) if pad else x), block


def int8_psum_scatter(x: jax.Array, over: tuple[str, ...], dim: int) -> jax.Array:
  """Inside ``shard_map``: ``psum_scatter(x, over, scatter_dimension=dim, tiled=True)`` whose payload crosses
  in int8: each replica's chunk for each peer quantized (:func:`quantize`), an all-to-all, and each
  replica's chunk summed in float32 from its peers' dequantized ones and its own, exact. Every chunk is
  summed by one replica, so no two disagree. Back in ``x``'s dtype."""
  n = jax.lax.axis_size(over)
  moved = jnp.moveaxis(x, dim, 0)
  chunks = moved.reshape(n, -1).astype(jnp.float32)
  m = chunks.shape[1]
  q, scale = quantize(*_blocked(chunks))
  q = jax.lax.all_to_all(q, over, 0, 0, tiled=True)
  scale = jax.lax.all_to_all(scale, over, 0, 0, tiled=True)
  rows = dequantize(q, scale)[:, :m]
  me = jax.lax.axis_index(over)
  own = jax.lax.dynamic_index_in_dim(chunks, me, keepdims=False)
  rows = jax.lax.dynamic_update_index_in_dim(rows, own, me, 0)
  total = rows.sum(0).reshape(moved.shape[0] // n, *moved.shape[1:])
  return jnp.moveaxis(total, 0, dim).astype(x.dtype)


def int8_all_gather(x: jax.Array, over: tuple[str, ...], dim: int) -> jax.Array:
  """Inside ``shard_map``: ``all_gather(x, over, axis=dim, tiled=True)`` (invariant over ``over``) of ``x``
  quantized (:func:`quantize`), dequantized on arrival: every replica, this one included, gets the same
  values. Back in ``x``'s dtype."""
  moved = jnp.moveaxis(x, dim, 0)
  flat = moved.reshape(1, -1)
  m = flat.shape[1]
  q, scale = quantize(*_blocked(flat))
  q = jax.lax.all_gather(q, over, axis=0, tiled=True, to="invarying")
  scale = jax.lax.all_gather(scale, over, axis=0, tiled=True, to="invarying")
  rows = dequantize(q, scale)[:, :m]
  whole = rows.reshape(rows.shape[0] * moved.shape[0], *moved.shape[1:])
  return jnp.moveaxis(whole, 0, dim).astype(x.dtype)


def int8_psum(x: jax.Array, over: tuple[str, ...]) -> jax.Array:
  """Inside ``shard_map``: ``psum(x, over)`` as :func:`int8_psum_scatter` and :func:`int8_all_gather` of the
  flattened ``x``: the bytes of an all-reduce, in int8 with scales; every replica gets the same values."""
  n = jax.lax.axis_size(over)
  flat = x.reshape(-1)
  flat = jnp.pad(flat, (0, -flat.size % n))
  summed = int8_all_gather(int8_psum_scatter(flat, over, 0), over, 0)
  return summed[: x.size].reshape(x.shape).astype(x.dtype)


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
  return across.psum(x, slow)


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
  x = across.psum_scatter(x, (inner,), dim)
  x = all_reduce_by_stages(x, outer, across)
  return across.all_gather(x, (inner,), dim)


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
  if len(over) == 1:
    return across.psum_scatter(x, over, dim)
  sizes = tuple(jax.lax.axis_size(a) for a in over)
  blocks = x.shape[dim] // math.prod(sizes)
  split = x.reshape(*x.shape[:dim], *sizes, blocks, *x.shape[dim + 1:])
  k = len(over)
  order = (*range(dim), *reversed(range(dim, dim + k)), *range(dim + k, split.ndim))
  x = split.transpose(order).reshape(x.shape)
  for axis in reversed(over):
    x = across.psum_scatter(x, (axis,), dim)
  return x


def gather_by_stages(x: jax.Array, over: tuple[str, ...], dim: int, across: Across = EXACT) -> jax.Array:
  """Inside ``shard_map``: ``all_gather`` of ``x`` over the axes ``over`` on ``dim`` (tiled, invariant over
  them), the slow ones first, narrowed as ``across`` says, then the others at ``x``'s precision.

  The mirror of :func:`scatter_by_stages`: a reduce-scatter shrinks a gradient inside the slice before its
  hop across, an all-gather grows the parameters across before its hop inside, so the slow network carries
  the smallest piece: among k slices each device sends (k - 1) times ``x`` across, where gathering inside
  the slice first (d chips) would send d times that. Every replica, this one included, gets the same
  (narrowed) values of every block. The blocks arrive in the order (inside axes, slow axes) and are
  reordered locally (a transpose, no bytes sent) into the layout's, ``over`` as listed.

  Args:
    x: this replica's block of the layout ``P((*over,))`` on ``dim``.
    over: the mesh axes, as the layout lists them on ``dim``.
    dim: the dimension gathered.
    across: the slow axes and the dtype their stage runs in (default: exact, one ``all_gather``).

  Returns:
    ``x`` gathered: ``x.shape[dim] * prod(sizes)`` along ``dim``, in ``x``'s dtype.

  Example::

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((1, 1), ("replica", "data"))
    >>> split = P(("replica", "data"))
    >>> f = lambda w: gather_by_stages(w, ("replica", "data"), 0, Across(frozenset({"replica"}), jnp.int8))
    >>> w = jax.device_put(jnp.array([0.0, -1.0, 0.5]), NamedSharding(mesh, split))
    >>> jax.shard_map(f, mesh=mesh, in_specs=split, out_specs=P())(w).tolist()  # 0.5 is 63.5 / 127
    [0.0, -1.0, 0.5039370059967041]
  """
  slow = tuple(a for a in over if a in across.axes)
  inside = tuple(a for a in over if a not in across.axes)
  if not across.narrows(slow):
    return jax.lax.all_gather(x, over, axis=dim, tiled=True, to="invarying")
  x = across.all_gather(x, slow, dim)
  if not inside:
    return x
  x = jax.lax.all_gather(x, inside, axis=dim, tiled=True, to="invarying")
  # The blocks of ``dim`` now run (inside axes, slow axes, block); the layout lists them as ``over`` does.
  arrived = (*inside, *slow)
  sizes = [jax.lax.axis_size(a) for a in arrived]
  split = x.reshape(*x.shape[:dim], *sizes, x.shape[dim] // math.prod(sizes), *x.shape[dim + 1:])
  k = len(over)
  order = (*range(dim), *(dim + arrived.index(a) for a in over), *range(dim + k, split.ndim))
  return split.transpose(order).reshape(x.shape)


def slow_axes(axes: tuple[str, ...], mesh: Any) -> frozenset[str]:
  """The data axes between slices or nodes that anything crosses: every one but the last listed (the axis
  inside each slice or node), of size above 1 (one slice: none).

  Example::

    >>> import jax
    >>> slow_axes(("replica", "data"), jax.make_mesh((1, 1), ("replica", "data")))
    frozenset()
  """
  return frozenset(a for a in axes[:-1] if mesh.shape[a] > 1)


def across_for(dtype: Any, axes: tuple[str, ...], mesh: Any, grad_dtypes: list) -> Across:
  """What ``value_and_grad_accumulated(across_dtype=dtype)`` runs: the slow axes (every data axis but the last
  listed) and ``dtype`` for their stages; :data:`EXACT` where nothing is asked, or nothing crosses.

  Raises:
    Zero1Error: ``dtype`` neither floating nor int8, an integer gradient, one data axis, or no gradient wider
      than ``dtype`` (nothing to narrow).

  Example::

    >>> import jax, jax.numpy as jnp
    >>> mesh = jax.make_mesh((1, 1), ("replica", "data"))
    >>> across_for(jnp.bfloat16, ("replica", "data"), mesh, [jnp.float32]) is EXACT  # one slice
    True
  """
  if dtype is None:
    return EXACT
  try:
    dtype = jnp.dtype(dtype)
  except TypeError:
    dtype = None
  if dtype is None or not (jnp.issubdtype(dtype, jnp.floating) or dtype == jnp.int8):
    raise Zero1Error("across_dtype must be a floating dtype or jnp.int8 (block-scaled); pass e.g. "
                     f"across_dtype=jnp.bfloat16; {describe_mesh(mesh)}")
  integer = sorted({jnp.dtype(g).name for g in grad_dtypes if not jnp.issubdtype(g, jnp.inexact)})
  if integer:
    raise Zero1Error(
        f"across_dtype={dtype.name} rounds the gradients that cross between slices or nodes; parameters of "
        f"{', '.join(integer)} have no gradient to round: leave them out of the optimizer's wrt or leave "
        f"across_dtype out; {describe_mesh(mesh)}")
  if len(axes) < 2:
    raise Zero1Error(
        f"across_dtype={dtype.name} narrows the reduction over the slow axes of a data axis over several "
        f"mesh axes, the slow one first (data_axis=(\"replica\", \"data\")); the gradients are summed "
        f"over {axes} only; leave across_dtype out; {describe_mesh(mesh)}")
  if not any(jnp.dtype(g).itemsize > dtype.itemsize for g in grad_dtypes):
    # A lever that sends the bytes it would send without it: refused, as state_dtype is on bf16 state.
    raise Zero1Error(
        f"across_dtype={dtype.name} narrows wider gradients across slices or nodes; these are "
        f"{', '.join(sorted({jnp.dtype(g).name for g in grad_dtypes}))} already (the gradients have the "
        f"parameters' dtype): leave across_dtype out; {describe_mesh(mesh)}")
  slow = slow_axes(axes, mesh)
  return Across(slow, dtype) if slow else EXACT  # one slice or node: nothing crosses, nothing is rounded
