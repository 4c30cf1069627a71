"""The one exception nnx-zero1 raises when Zero-1 was asked for but cannot apply,
and how its messages name a mesh."""

from __future__ import annotations

from typing import Any

__all__ = ["Zero1Error", "describe_mesh"]


class Zero1Error(ValueError):
  """Zero-1 was requested but cannot be applied as asked.

  Raised before any model or optimizer state is changed, with a message that
  names the problem and the mesh's axes. It is a ``ValueError`` so callers that
  already guard configuration errors keep working. nnx-zero1 never falls back to
  a replicated optimizer silently: where Zero-1 cannot apply, this is raised.

  Example::

    >>> from nnx_zero1 import Zero1Error
    >>> issubclass(Zero1Error, ValueError)
    True
  """


def describe_mesh(mesh: Any) -> str:
  """How every ``Zero1Error`` names a mesh.

  Example::

    >>> import jax
    >>> describe_mesh(jax.make_mesh((1,), ("data",)))
    "mesh axes ('data',) (shape {'data': 1})"
  """
  return f"mesh axes {tuple(mesh.axis_names)} (shape {dict(mesh.shape)})"
