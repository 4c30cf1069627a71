"""``report(opt)``: what every optimizer leaf costs per device, and why."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from nnx_zero1._src.errors import Zero1Error
from nnx_zero1._src.layout import NOTES, Reason, is_split
from nnx_zero1._src.specs import data_axis_size, keep_axes, spec_axes

__all__ = ["Zero1Report", "ReportRow", "report", "bytes_per_device", "memory_kind_of"]


def bytes_per_device(tree: Any) -> int:
  """The most bytes any one device holds of ``tree``'s arrays (from ``addressable_shards``).

  What the data actually occupies, shard by shard, not what a spec says.

  Args:
    tree: a pytree of ``jax.Array`` s (e.g. ``nnx.as_pure(opt.opt_state)``); other leaves count 0.

  Returns:
    The largest per-device total, in bytes, over this process's devices.

  Example::

    >>> import jax.numpy as jnp
    >>> bytes_per_device({"a": jnp.ones(4, jnp.float32)})
    16
  """
  per_device: dict[Any, int] = {}
  for leaf in jax.tree.leaves(tree):
    for shard in getattr(leaf, "addressable_shards", ()):
      per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
  return max(per_device.values(), default=0)


def memory_kind_of(x: Any) -> str:
  """The memory kind an array's shards live in (``"device"`` when the backend names none).

  Example::

    >>> import jax.numpy as jnp
    >>> memory_kind_of(jnp.ones(2))
    'device'
  """
  return getattr(getattr(x, "sharding", None), "memory_kind", None) or "device"


@dataclasses.dataclass(frozen=True)
class ReportRow:
  """One optimizer leaf: where it lives and what it costs on one device."""

  path: str
  shape: tuple[int, ...]
  dtype: str
  spec: str
  bytes_per_device: int
  full_bytes: int
  replicated_optimizer_bytes: int  # what nnx.Optimizer holds of it per device
  sharded: bool
  reason: str  # "" when sharded
  by_parameter: bool = False  # split already by its parameter's layout (FSDP): Zero-1 added nothing
  memory_kind: str = "device"  # where it lives between steps: "device", or "pinned_host" when offloaded
  compute_dtype: str = ""  # the dtype ``update`` computes it in, when stored narrower (``state_dtype``)
  master: bool = False  # a master copy of a parameter (``master_dtype``), not optax state
  data_axes: tuple[str, ...] = ()  # the data axes it is split over (fewer than all: see ``note``)
  note: str = ""  # how a sharded leaf is laid out: over only some data axes, or as its Variable declares


@dataclasses.dataclass(frozen=True)
class Zero1Report:
  """Per-leaf placement of an optimizer's state and its per-device totals; ``str()`` is a table.

  Attributes:
    rows: one ``ReportRow`` per optimizer-state leaf (path, shape, dtype, spec,
      bytes per device, whether split and, if not, why).
    data_axis: the data axes the state is split over.
    data_size: the data-parallel size (product of the data axes' sizes).

  Example::

    >>> import jax, optax
    >>> from flax import nnx
    >>> from nnx_zero1 import Zero1Optimizer, report
    >>> model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    >>> opt = Zero1Optimizer(model, optax.adam(1e-3), jax.make_mesh((1,), ("data",)))
    >>> r = report(opt)
    >>> r.per_device_bytes == r.sharded_bytes + r.replicated_bytes
    True
  """

  rows: tuple[ReportRow, ...]
  data_axis: tuple[str, ...]
  data_size: int

  @property
  def sharded_bytes(self) -> int:
    """Bytes per device of the leaves split over the data axis."""
    return sum(r.bytes_per_device for r in self.rows if r.sharded)

  @property
  def replicated_bytes(self) -> int:
    """Bytes per device of the leaves every replica holds whole."""
    return sum(r.bytes_per_device for r in self.rows if not r.sharded)

  @property
  def per_device_bytes(self) -> int:
    """All optimizer-state bytes one device holds."""
    return self.sharded_bytes + self.replicated_bytes

  @property
  def host_bytes(self) -> int:
    """Of :attr:`per_device_bytes`, those kept in host memory between steps (``offload_state_to_host``)."""
    return sum(r.bytes_per_device for r in self.rows if r.memory_kind != "device")

  @property
  def device_resident_bytes(self) -> int:
    """Of :attr:`per_device_bytes`, those in device memory between steps."""
    return self.per_device_bytes - self.host_bytes

  @property
  def master_bytes(self) -> int:
    """Of :attr:`per_device_bytes`, the master copies of the parameters (``master_dtype``)."""
    return sum(r.bytes_per_device for r in self.rows if r.master)

  @property
  def unsharded_bytes(self) -> int:
    """What one device would hold with ``nnx.Optimizer`` (its state laid out like the parameters)."""
    return sum(r.replicated_optimizer_bytes for r in self.rows)

  def __str__(self) -> str:
    header = ("leaf", "shape", "dtype", "spec", "memory", "bytes/device", "status")
    body = [
        (r.path, "x".join(map(str, r.shape)) or "()",
         f"{r.dtype} ({r.compute_dtype} in update)" if r.compute_dtype else r.dtype, r.spec, r.memory_kind,
         f"{r.bytes_per_device:,}", _status(r))
        for r in self.rows
    ]
    widths = [max(len(str(row[i])) for row in [header, *body]) for i in range(len(header))]
    line = lambda row: "  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip()
    axis = "x".join(self.data_axis)
    total = (
        f"optimizer state per device: {self.per_device_bytes:,} B "
        f"(sharded {self.sharded_bytes:,} B + replicated {self.replicated_bytes:,} B; "
        f"in host memory {self.host_bytes:,} B"
        f"{f'; master copies {self.master_bytes:,} B' if self.master_bytes else ''}); "
        f"nnx.Optimizer: {self.unsharded_bytes:,} B; data axis {axis} = {self.data_size}"
    )
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, body), total])


def _status(row: ReportRow) -> str:
  if row.master:
    return f"master copy, {_sharded(row) if row.sharded else 'replicated: ' + row.reason}"
  if not row.sharded:
    return f"replicated: {row.reason}"
  return "sharded by its parameter's layout" if row.by_parameter else _sharded(row)


def _sharded(row: ReportRow) -> str:
  """'sharded', and over which data axes when fewer than all, or laid out as declared."""
  if row.note == Reason.PARTLY_SPLIT:
    return f"sharded over {'x'.join(row.data_axes)} only ({row.note})"
  if row.note:
    return f"sharded over {'x'.join(row.data_axes) or 'no data axis'}, {row.note}"
  return "sharded"


def _split_over(sharding, data_axis: tuple[str, ...]) -> tuple[str, ...]:
  """The data axes ``sharding`` splits a leaf over, in ``data_axis`` order."""
  used = set(spec_axes(sharding.spec)) if isinstance(sharding, NamedSharding) else set()
  return tuple(a for a in data_axis if a in used)


def _without_data_axes(sharding, data_axis: tuple[str, ...]):
  """The layout ``nnx.Optimizer`` would give this leaf: the same spec less the data axes."""
  if not isinstance(sharding, NamedSharding):
    return sharding
  return keep_axes(sharding, lambda a: a not in data_axis)


def report(opt) -> Zero1Report:
  """Where each leaf of a ``Zero1Optimizer``'s state lives and what it costs.

  Args:
    opt: a ``Zero1Optimizer`` (or one a trainer built inside ``zero1_optimizers``).

  Returns:
    A :class:`Zero1Report`: one row per state leaf (split, or why not; device or
    host memory) and the per-device totals, next to what ``nnx.Optimizer`` would hold.

  Raises:
    Zero1Error: ``opt`` is not a ``Zero1Optimizer``.

  Example::

    >>> import jax, optax
    >>> from flax import nnx
    >>> from nnx_zero1 import Zero1Optimizer, report
    >>> model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    >>> r = report(Zero1Optimizer(model, optax.adam(1e-3), jax.make_mesh((1,), ("data",))))
    >>> r.per_device_bytes == r.unsharded_bytes  # a data axis of size 1 saves nothing
    True
  """
  plan = getattr(opt, "zero1_plan", None)
  if plan is None:
    raise Zero1Error(f"report() needs a Zero1Optimizer, got {type(opt).__name__}; build the optimizer "
                     "with Zero1Optimizer (or under nnx_zero1.zero1_optimizers())")
  leaves = jax.tree.leaves(nnx.as_pure(opt.opt_state))
  rows = []
  for leaf, row in zip(leaves, plan.state_leaves, strict=True):
    # nnx.Optimizer keeps the state in the dtype tx makes it in.
    itemsize = np.dtype(row.compute_dtype or leaf.dtype).itemsize
    # nnx.Optimizer places a leaf by its Variable's optimizer_sharding too (flax >= 0.12.7).
    own_layout = row.by_parameter or row.note == Reason.DECLARED
    rows.append(
        ReportRow(
            path=row.path,
            shape=row.shape,
            dtype=str(leaf.dtype),
            spec=str(leaf.sharding.spec) if hasattr(leaf.sharding, "spec") else type(leaf.sharding).__name__,
            bytes_per_device=bytes_per_device(leaf),
            full_bytes=leaf.nbytes,
            replicated_optimizer_bytes=math.prod(
                (leaf.sharding if own_layout else _without_data_axes(leaf.sharding, plan.data_axis))
                .shard_shape(leaf.shape)
            ) * itemsize,
            sharded=row.reason is None,
            reason=str(row.reason) if row.reason else "",
            by_parameter=row.by_parameter,
            memory_kind=memory_kind_of(leaf),
            compute_dtype=row.compute_dtype or "",
            data_axes=_split_over(leaf.sharding, plan.data_axis) if row.reason is None else (),
            note=str(row.note) if row.note else "",
        )
    )
  if plan.master_dtype is not None:
    rows.extend(_master_rows(opt, plan))
  size = data_axis_size(plan.mesh, plan.data_axis)
  return Zero1Report(rows=tuple(rows), data_axis=plan.data_axis, data_size=size)


def _master_rows(opt, plan) -> list[ReportRow]:
  """One row per master copy (``master_dtype``): ``nnx.Optimizer`` holds none of these bytes."""
  flat = jax.tree_util.tree_flatten_with_path(nnx.as_pure(opt.master_params))[0]
  rows = []
  for (path, leaf), reason in zip(flat, plan.param_reasons, strict=True):
    by_parameter = reason == Reason.ALREADY_SHARDED
    split = is_split(reason)
    rows.append(ReportRow(
        path=f"master_params{jax.tree_util.keystr(path)}", shape=tuple(leaf.shape), dtype=str(leaf.dtype),
        spec=str(leaf.sharding.spec), bytes_per_device=bytes_per_device(leaf), full_bytes=leaf.nbytes,
        replicated_optimizer_bytes=0, sharded=split, reason="" if split else str(reason),
        by_parameter=by_parameter, memory_kind=memory_kind_of(leaf), master=True,
        data_axes=_split_over(leaf.sharding, plan.data_axis) if split else (),
        note=str(reason) if reason in NOTES else "",
    ))
  return rows
