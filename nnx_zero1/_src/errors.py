"""The one exception nnx-zero1 raises when Zero-1 was asked for but cannot apply, the
one warning it gives when Zero-1 applies but splits nothing, and how messages name a mesh."""

from __future__ import annotations

from typing import Any

__all__ = ["Zero1Error", "Zero1Warning", "describe_mesh"]


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


class Zero1Warning(UserWarning):
  """Zero-1 applies but splits nothing, most likely by mistake.

  Given once per call site (Python's default warning filter) when an optimizer
  finds no mesh and the model on one device while more devices are visible: a
  forgotten ``jax.set_mesh``. ``strict=True`` raises ``Zero1Error`` there instead;
  ``warnings.simplefilter("ignore", Zero1Warning)`` silences it where one device
  is meant.

  Example::

    >>> from nnx_zero1 import Zero1Warning
    >>> issubclass(Zero1Warning, UserWarning)
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
