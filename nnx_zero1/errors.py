"""The one exception nnx-zero1 raises when Zero-1 was asked for but cannot apply."""

from __future__ import annotations

__all__ = ["Zero1Error"]


class Zero1Error(ValueError):
  """Zero-1 was requested but cannot be applied as asked.

  Raised before any model or optimizer state is changed. It is a ``ValueError``
  so callers that already guard configuration errors keep working.

  Example::

    >>> from nnx_zero1 import Zero1Error
    >>> issubclass(Zero1Error, ValueError)
    True
  """
