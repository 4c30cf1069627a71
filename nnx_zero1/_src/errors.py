"""The one exception nnx-zero1 raises when Zero-1 was asked for but cannot apply, the
one warning it gives when Zero-1 applies but splits nothing, how messages name a mesh,
and the user's line a warning points at."""

from __future__ import annotations

import sys
import warnings
from typing import Any

__all__ = ["Zero1Error", "Zero1Warning", "describe_mesh", "warn_at_user_line"]

# Frames of these packages lie between a user's call and the warning: nnx-zero1's own (its
# adapters included), flax's metaclass and pytree machinery, the hosts that build optimizers.
_LIBRARIES = ("nnx_zero1", "flax", "jax", "tunix", "maxtext", "MaxText")


class Zero1Error(ValueError):
  """Zero-1 was requested but cannot be applied as asked.

  Raised before any model or optimizer state is changed, with a message that
  names the problem, the mesh's axes and what to do instead. It is a
  ``ValueError`` so callers that already guard configuration errors keep
  working. nnx-zero1 never falls back to a replicated optimizer silently: where
  Zero-1 cannot apply, this is raised.

  Example::

    >>> from nnx_zero1 import Zero1Error
    >>> issubclass(Zero1Error, ValueError)
    True
  """

  __module__ = "nnx_zero1"  # tracebacks name the public path


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

  __module__ = "nnx_zero1"


def describe_mesh(mesh: Any) -> str:
  """How every ``Zero1Error`` names a mesh.

  Example::

    >>> import jax
    >>> describe_mesh(jax.make_mesh((1,), ("data",)))
    "mesh axes ('data',) (shape {'data': 1})"
  """
  return f"mesh axes {tuple(mesh.axis_names)} (shape {dict(mesh.shape)})"


def _in_library(frame: Any) -> bool:
  name = frame.f_globals.get("__name__", "")
  return any(name == package or name.startswith(package + ".") for package in _LIBRARIES)


def warn_at_user_line(message: str, category: type[Warning]) -> None:
  """``warnings.warn`` pointing at the first caller outside nnx-zero1, flax, jax and the host
  trainers: the user's own line, however many library frames (flax's metaclass ``__call__``,
  a Tunix constructor) lie between.

  Example::

    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...   warnings.simplefilter("always")
    ...   warn_at_user_line("look here", UserWarning)
    >>> str(caught[0].message)
    'look here'
  """
  frame: Any = sys._getframe(0)
  level = 1
  while frame is not None and _in_library(frame):
    frame, level = frame.f_back, level + 1
  warnings.warn(message, category, stacklevel=level)
