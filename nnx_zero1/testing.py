"""Test support for code that uses nnx-zero1, as ``flax.testing`` is for flax.

Two things the tests of this project and the benchmark both need, and that a
user checking their own training step needs too:

- counting collectives in compiled HLO text (``jitted.lower(...).compile().as_text()``):
  :func:`collectives`, :func:`loop_collectives`, :func:`sent_bytes` (what each device sends, one basis
  for all three collectives), :func:`shape_bytes`, and the copies between
  host and device memory an offloaded optimizer state makes in the TPU compiler's HLO:
  :func:`host_transfers`, :func:`loop_host_transfers`;
- the optax transformations this project runs against ``nnx.Optimizer``, with
  what Zero-1 promises for each: :data:`CASES` of :class:`OptimizerCase`.

Example::

  >>> import jax, jax.numpy as jnp
  >>> from nnx_zero1.testing import collectives
  >>> collectives(jax.jit(lambda x: x * 2).lower(jnp.ones(4)).compile().as_text())["all-reduce"]
  {'count': 0, 'bytes': 0}
"""

from nnx_zero1._src.hlo import COLLECTIVES, shape_bytes
from nnx_zero1._src.hlo_counts import (
    TRANSFERS,
    collectives,
    host_transfers,
    loop_collectives,
    loop_host_transfers,
    sent_bytes,
)
from nnx_zero1._src.optimizer_cases import CASES, ELEMENTWISE_CONTRACT, FROZEN, OptimizerCase

__all__ = [
    "CASES",
    "COLLECTIVES",
    "ELEMENTWISE_CONTRACT",
    "FROZEN",
    "OptimizerCase",
    "TRANSFERS",
    "collectives",
    "host_transfers",
    "loop_collectives",
    "loop_host_transfers",
    "sent_bytes",
    "shape_bytes",
]
