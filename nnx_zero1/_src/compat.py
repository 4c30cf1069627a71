"""Every private (or unexported) API of jax / flax that nnx-zero1 relies on, in one place.

Each is wrapped in one small function so that a dependency upgrade that moves
or removes it breaks here, with a message naming the installed version, and
``tests/core/test_compat.py`` fails loudly. Public APIs are used wherever they exist.
"""

from __future__ import annotations

from typing import Any

import flax
import jax
from flax.nnx import filterlib  # a documented flax module; nnx has no top-level ``Filter``

__all__ = [
    "Filter", "context_mesh", "jit_cache_size", "legacy_context_mesh", "optimizer_sharding_of",
    "set_metaclass", "to_opt_state",
]

Filter = filterlib.Filter
"""The type of ``wrt`` (``nnx.Optimizer``'s filter): a Variable type, a string, a predicate, ..."""


def _missing(what: str, package: str, version: str, error: Exception) -> RuntimeError:
  return RuntimeError(
      f"nnx-zero1 needs {what}, which {package} {version} no longer provides ({error}); "
      f"please report this with your {package} version"
  )


def legacy_context_mesh() -> Any:
  """The mesh of a legacy ``with mesh:`` block (an empty mesh when there is none).

  Tunix 0.1.7 still enters its mesh with ``with mesh:``, which jax only
  records in the private ``jax._src.mesh.thread_resources``; the public
  ``jax.sharding.get_mesh()`` sees ``jax.set_mesh`` only.

  Example::

    >>> import jax
    >>> legacy_context_mesh().empty
    True
  """
  try:
    from jax._src.mesh import thread_resources
  except ImportError as e:  # pragma: no cover -- only on a jax that moved it
    raise _missing("jax._src.mesh.thread_resources", "jax", jax.__version__, e) from e
  return thread_resources.env.physical_mesh


def context_mesh() -> Any:
  """The concrete mesh of ``jax.set_mesh``, also while tracing (empty when there is none).

  ``jax.sharding.get_mesh()`` refuses to answer inside ``jit`` (and so inside
  ``nnx.eval_shape``), though ``jax.set_mesh`` set it outside; the value it
  would return lives in the private ``jax._src.mesh.get_concrete_mesh``.

  Example::

    >>> import jax
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> seen = []
    >>> with jax.set_mesh(mesh):
    ...   _ = jax.jit(lambda: seen.append(context_mesh()))()
    >>> seen == [mesh]
    True
  """
  try:
    return jax.sharding.get_mesh()
  except ValueError:  # inside a trace
    pass
  try:
    from jax._src.mesh import get_concrete_mesh
  except ImportError as e:  # pragma: no cover -- only on a jax that moved it
    raise _missing("jax._src.mesh.get_concrete_mesh", "jax", jax.__version__, e) from e
  return get_concrete_mesh()


def to_opt_state(tree: Any) -> Any:
  """flax's own conversion of ``tx.init``'s output into ``nnx.Optimizer``'s ``opt_state``.

  ``OptVariable``s for parameter-derived leaves (copying the parameter's
  metadata), ``OptArray``s for the rest, exactly as ``nnx.Optimizer`` builds
  them; flax does not export it from ``flax.nnx``.

  Example::

    >>> import jax.numpy as jnp
    >>> type(to_opt_state({"count": jnp.zeros(())})["count"]).__name__
    'OptArray'
  """
  try:
    from flax.nnx.training.optimizer import to_opt_state as flax_to_opt_state
  except ImportError as e:  # pragma: no cover -- only on a flax that moved it
    raise _missing("flax.nnx.training.optimizer.to_opt_state", "flax", flax.__version__, e) from e
  return flax_to_opt_state(tree)


def optimizer_sharding_of(variable: Any) -> Any:
  """The sharding a Variable's ``optimizer_sharding`` metadata declares for its optimizer state
  (None when it declares none).

  flax (>= 0.12.7) spells it as Variable metadata, ``nnx.Param(x,
  optimizer_sharding=(None, "data"))``, and its ``to_opt_state`` (:func:`to_opt_state`)
  turns it into the state's ``out_sharding``; the name is flax's convention, read in
  that private function only, not an exported API.

  Example::

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> optimizer_sharding_of(nnx.Param(jnp.ones((2, 4)), optimizer_sharding=(None, "data")))
    (None, 'data')
    >>> optimizer_sharding_of(nnx.Param(jnp.ones(2))) is None
    True
  """
  return variable.get_metadata("optimizer_sharding", None)


def jit_cache_size(jitted: Any) -> int:
  """How many compiled versions a ``jax.jit`` function holds (``jitted._cache_size()``).

  Tests and the bench use it to prove a step compiles once; jax has no public
  equivalent.

  Example::

    >>> import jax
    >>> f = jax.jit(lambda x: x + 1)
    >>> _ = f(1.0)
    >>> jit_cache_size(f)
    1
  """
  try:
    return jitted._cache_size()
  except AttributeError as e:  # pragma: no cover -- only on a jax that dropped it
    raise _missing("the jitted function's _cache_size()", "jax", jax.__version__, e) from e


def set_metaclass(cls: type, metaclass: type) -> None:
  """Gives flax's class ``cls`` (``nnx.Optimizer``) the metaclass ``metaclass`` in place.

  ``metaclass`` must derive from ``type(cls)``, flax's ``Pytree`` metaclass. Python
  allows the swap only while both have the same memory layout, which is flax's
  implementation, not its API: a flax that changes it fails here, by name.

  Example::

    >>> class Base(type):
    ...   pass
    >>> class Derived(Base):
    ...   pass
    >>> class A(metaclass=Base):
    ...   pass
    >>> set_metaclass(A, Derived)
    >>> type(A).__name__
    'Derived'
  """
  try:
    cls.__class__ = metaclass
  except TypeError as e:  # pragma: no cover -- only on a flax whose metaclass layout changed
    raise _missing(f"to give {cls.__qualname__} a derived metaclass", "flax", flax.__version__, e) from e
