"""A model and its optimizer as shapes on a mesh: what a step compiles from, and no memory used."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_zero1._src.companion import memory_kind_of, spec_axes


def _bytes(shape: tuple[int, ...], dtype: Any) -> int:
  return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def _totals(tree: Any, key: Callable[[Any], str | None], size: Callable[[Any], int]) -> dict[str, int]:
  """The ``size`` of a tree's leaves summed by ``key``, sorted by it (a leaf whose key is None left out)."""
  totals: dict[str, int] = {}
  for x in jax.tree.leaves(tree):
    if (k := key(x)) is not None:
      totals[k] = totals.get(k, 0) + size(x)
  return dict(sorted(totals.items()))


def abstract_bytes_per_device(tree: Any) -> int:
  """Bytes one device holds of a tree of sharded ``ShapeDtypeStruct``s (every device alike)."""
  shard = lambda x: x.sharding.shard_shape(x.shape) if isinstance(x.sharding, NamedSharding) else x.shape
  return sum(_bytes(shard(x), x.dtype) for x in jax.tree.leaves(tree))


def bytes_by_memory_kind(tree: Any) -> dict[str, int]:
  """Per-device bytes of a tree of sharded ``ShapeDtypeStruct``s, by memory kind (None is ``device``)."""
  return _totals(tree, memory_kind_of, abstract_bytes_per_device)


def bytes_by_dtype(tree: Any) -> dict[str, int]:
  """Per-device bytes of a tree of sharded ``ShapeDtypeStruct``s by dtype, its arrays only (a step count is
  not a moment): what the table says the optimizer state is stored in."""
  return _totals(tree, lambda x: str(x.dtype) if getattr(x, "ndim", 0) else None, abstract_bytes_per_device)


def state_split(tree: Any, data_axes: tuple[str, ...]) -> dict[str, float]:
  """The share of a state's bytes split over each combination of ``data_axes`` (``"none"``: not split over
  any of them), from the ``ShapeDtypeStruct``s' shardings: what a plan's row says its layout splits."""
  def over(x: Any) -> str:
    named = spec_axes(x.sharding.spec) if isinstance(x.sharding, NamedSharding) else ()
    return ",".join(a for a in data_axes if a in named) or "none"

  totals = _totals(tree, over, lambda x: _bytes(x.shape, x.dtype))
  whole = sum(totals.values()) or 1
  return {split: n / whole for split, n in totals.items()}


def with_state_homes(shardings: Any, optimizer: Any) -> Any:
  """``shardings`` of a split (model, optimizer) with the optimizer state where its plan keeps it
  (``nnx.eval_shape`` keeps a leaf's layout, not its memory kind: offloaded state would compile on device)."""
  plan = getattr(optimizer, "zero1_plan", None)
  if plan is None or not plan.offload_state:
    return shardings
  treedef = jax.tree.structure(shardings[1]["opt_state"])
  shardings[1]["opt_state"] = jax.tree.unflatten(treedef, [row.sharding for row in plan.state_leaves])
  return shardings


def describe_model(build: Callable[[], Any]) -> tuple[tuple[str, ...], frozenset[str]]:
  """The mesh axes a model's variables are annotated with, and its floating parameters' dtypes, from one
  abstract build with no mesh."""
  with nnx.use_eager_sharding(False):
    model = nnx.eval_shape(build)
  specs = jax.tree.leaves(nnx.get_partition_spec(nnx.state(model)), is_leaf=lambda x: isinstance(x, P))
  names = dict.fromkeys(axis for spec in specs if isinstance(spec, P) for axis in spec_axes(spec))
  params = jax.tree.leaves(nnx.state(model, nnx.Param))
  dtypes = frozenset(str(x.dtype) for x in params if jax.numpy.issubdtype(x.dtype, jax.numpy.floating))
  return tuple(names), dtypes


@dataclasses.dataclass
class AbstractState:
  """A split (model, optimizer) as ``ShapeDtypeStruct``s carrying their shardings."""

  graphdef: Any
  state: Any
  shardings: Any
  optimizer: Any  # the abstract optimizer (its zero1_plan, when it has one)

  @property
  def opt_state_bytes_by_memory_kind(self) -> dict[str, int]:
    """Per-device optimizer-state bytes by memory kind (``pinned_host`` when offloaded)."""
    return bytes_by_memory_kind(self.state[1])


def abstract_state(build: Callable[[], tuple[Any, Any]], mesh: Mesh) -> AbstractState:
  """``build() -> (model, optimizer)`` traced on ``mesh``; each leaf's sharding from its metadata, replicated
  where it names none (optax's scalar count)."""
  with jax.set_mesh(mesh):
    model, optimizer = nnx.eval_shape(build)
  graphdef, state = nnx.split((model, optimizer))
  named = nnx.get_named_sharding(state, mesh)
  replicated = NamedSharding(mesh, P())
  shardings = jax.tree.map(lambda s: s if isinstance(s, NamedSharding) else replicated, named,
                           is_leaf=lambda x: isinstance(x, NamedSharding) or x is None)
  shardings = with_state_homes(shardings, optimizer)
  state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)
  return AbstractState(graphdef, state, shardings, optimizer)
