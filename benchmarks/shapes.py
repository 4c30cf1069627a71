"""How much optimizer state Zero-1 leaves replicated on real LLM shapes (abstract, no weights).

For each named config of Qwen3, Llama and Gemma shape, the parameters are
built abstractly (``nnx.eval_shape``), given a replicated sharding on an
abstract data-parallel mesh of size dp, and run through
:func:`nnx_zero1._src.layout_plan.make_plan`. A leaf that no dimension of divides stays
replicated; the table says what fraction of the optimizer's bytes that is.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks.model import CONFIGS, Config, Transformer
from nnx_zero1._src.layout_plan import make_plan

__all__ = ["REAL_SHAPES", "abstract_params", "replicated_fraction", "shape_rows"]

REAL_SHAPES = ("qwen3-0.6b", "qwen3-8b", "llama-3.2-1b", "llama-3.1-8b", "gemma-3-1b", "gemma-2-2b")


def abstract_params(cfg: Config, mesh: AbstractMesh) -> Any:
  """The model's parameters as ``ShapeDtypeStruct``s, replicated on ``mesh``; no memory used.

  Example::

    >>> from benchmarks.model import CONFIGS
    >>> mesh = AbstractMesh((2,), ("data",))
    >>> params = abstract_params(CONFIGS["tiny"], mesh)
    >>> jax.tree.leaves(params)[0].sharding.spec
    P()
  """
  replicated = NamedSharding(mesh, P())
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), _shapes(cfg))


@functools.cache
def _shapes(cfg: Config) -> Any:
  model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  return nnx.as_pure(nnx.state(model, nnx.Param))


def _nbytes(row) -> int:
  return int(np.prod(row.shape, dtype=np.int64)) * np.dtype(row.dtype).itemsize


def replicated_fraction(cfg: Config, dp: int, tx: optax.GradientTransformation | None = None) -> dict:
  """Optimizer bytes Zero-1 leaves replicated at data-parallel size ``dp``, and per-device totals.

  Returns a row with ``replicated_bytes`` (summed over the leaves left whole),
  ``total_bytes`` (the whole optimizer state), ``replicated_fraction`` and
  ``per_device_vs_ideal``: (bytes one device holds) / (total / dp).

  Example::

    >>> from benchmarks.model import CONFIGS
    >>> row = replicated_fraction(CONFIGS["tiny"], 4)
    >>> row["replicated_fraction"] < 1e-3
    True
  """
  mesh = AbstractMesh((dp,), ("data",))
  # make_plan reads only the mesh's axis sizes and types, which an AbstractMesh has too.
  plan = make_plan(tx or optax.adamw(1e-3), abstract_params(cfg, mesh), mesh, ("data",))  # type: ignore[arg-type]
  total = sum(_nbytes(r) for r in plan.state_leaves)
  replicated = sum(_nbytes(r) for r in plan.state_leaves if r.reason is not None)
  per_device = replicated + (total - replicated) / dp
  leaves = [r.path for r in plan.state_leaves if r.reason is not None and r.shape]
  return {
      "dp": dp,
      "total_bytes": total,
      "replicated_bytes": replicated,
      "replicated_fraction": replicated / total,
      "per_device_vs_ideal": per_device / (total / dp),
      "replicated_leaves": len(leaves),
  }


def shape_rows(names: Sequence[str] = REAL_SHAPES, dps: Sequence[int] = (2, 4, 8, 16)) -> list[dict]:
  """One row per (model shape, dp): the table the bench prints under its main one.

  Example::

    >>> [r["dp"] for r in shape_rows(["tiny"], dps=(2, 4))]
    [2, 4]
  """
  return [{"model": name, **replicated_fraction(CONFIGS[name], dp)} for name in names for dp in dps]
