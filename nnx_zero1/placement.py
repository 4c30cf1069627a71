"""Moving arrays between layouts, the same way eagerly, under jit, on Explicit and Auto meshes."""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding

from nnx_zero1.specs import is_explicit

__all__ = ["place", "current_sharding", "is_explicit"]  # is_explicit: from nnx_zero1.specs


def place(x: Any, sharding: NamedSharding) -> Any:
  """Puts one array onto ``sharding``: ``jax.reshard`` on Explicit meshes,
  a sharding constraint under jit on Auto meshes, ``device_put`` eagerly.

  Example::

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> s = NamedSharding(jax.make_mesh((1,), ("data",)), P("data"))
    >>> place(jnp.ones(4), s).sharding == s
    True
  """
  if not isinstance(sharding, NamedSharding):
    return jax.device_put(x, sharding)
  if is_explicit(sharding):
    return jax.reshard(x, sharding)
  if isinstance(x, jax.core.Tracer):
    return jax.lax.with_sharding_constraint(x, sharding)
  return jax.device_put(x, sharding)


def current_sharding(x: Any, recorded: NamedSharding) -> Any:
  """The sharding ``x`` has now, so it can be put back there after the update.

  Concrete arrays know it; on an Explicit mesh a traced array's type carries
  it; on an Auto mesh under jit the layout recorded at construction stands in.

  Example::

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> s = NamedSharding(jax.make_mesh((1,), ("data",)), P())
    >>> current_sharding(jnp.ones(2), s) == jnp.ones(2).sharding
    True
  """
  if not isinstance(x, jax.core.Tracer):
    return x.sharding
  if is_explicit(recorded):
    spec = jax.typeof(x).sharding.spec
    return NamedSharding(recorded.mesh, spec, memory_kind=recorded.memory_kind)
  return recorded
