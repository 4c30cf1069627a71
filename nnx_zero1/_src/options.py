"""The Zero-1 options of one optimizer: one frozen record, checked once.

Every entry point turns the options it was given into a :class:`Zero1Options` and passes that
on. Building the record checks what the values alone can tell (a name, a dtype, a rounding);
what needs the parameters or the mesh is checked when the plan is built from it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from nnx_zero1._src.errors import Zero1Error
from nnx_zero1._src.specs import DataAxis, data_axes

__all__ = ["ROUNDINGS", "Zero1Options", "as_dtype", "levers_of"]

ROUNDINGS = ("stochastic", "nearest")
_LEVER = {"lever": True}  # a memory lever: the adapters read it off a trainer's or engine's attributes


@dataclasses.dataclass(frozen=True)
class Zero1Options:
  """What a ``Zero1Optimizer`` was asked for, beyond its model, ``tx``, mesh and ``wrt``.

  The fields are ``Zero1Optimizer``'s keyword arguments of the same names (see
  its docstring); building the record normalises them (``data_axis`` to a tuple
  of names, dtypes to numpy dtypes) and refuses what cannot apply. Every entry
  point takes the same options by these names: build the record once and pass it
  whole as ``Zero1Optimizer(..., options=options)`` (or ``Zero1ModelAndOptimizer``), or
  ``**options.keywords()`` to any of them and ``zero1_optimizers``; the trainer mixin and
  Tunix's config read them as ``zero1_<name>``, the engines' memory levers as ``<NAME>``.

  Raises:
    Zero1Error: a ``data_axis`` that is not a name or a tuple of distinct names; a
      flag that is not a bool; an ``offload_state_to_host`` that is neither a bool nor a
      fraction in (0, 1]; a ``state_rounding`` that is not one of
      ``ROUNDINGS``; a ``state_dtype`` or ``master_dtype`` that is not a floating
      dtype; stochastic rounding to anything but bfloat16; a ``params_across_dtype``
      neither floating nor int8, without ``master_dtype``, or with one data axis.

  Example::

    >>> import jax.numpy as jnp
    >>> from nnx_zero1 import Zero1Options
    >>> options = Zero1Options(data_axis="data", state_dtype=jnp.bfloat16)
    >>> options.data_axis, options.state_dtype, options.offload_state_to_host
    (('data',), dtype(bfloat16), False)
  """

  data_axis: DataAxis = "data"
  strict: bool = False
  pin_gradients: bool = True
  offload_state_to_host: bool | float = dataclasses.field(default=False, metadata=_LEVER)
  state_dtype: Any = dataclasses.field(default=None, metadata=_LEVER)
  state_rounding: str = dataclasses.field(default="stochastic", metadata=_LEVER)
  master_dtype: Any = dataclasses.field(default=None, metadata=_LEVER)
  params_across_dtype: Any = dataclasses.field(default=None, metadata=_LEVER)

  def __post_init__(self) -> None:
    normal: dict[str, Any] = {
        "data_axis": data_axes(self.data_axis),
        "state_dtype": _state_dtype(self.state_dtype, self.state_rounding),
        "master_dtype": _master_dtype(self.master_dtype),
        "offload_state_to_host": _offload(self.offload_state_to_host),
    }
    normal["params_across_dtype"] = _params_across_dtype(self.params_across_dtype, normal["master_dtype"],
                                                         normal["data_axis"])
    for name in ("strict", "pin_gradients"):
      value = getattr(self, name)
      if not isinstance(value, bool | np.bool_):
        raise Zero1Error(f"{name}={value!r} is not a bool; pass True or False")
      normal[name] = bool(value)
    for name, value in normal.items():
      object.__setattr__(self, name, value)  # frozen: the checked values replace the given ones

  @property
  def offload_fraction(self) -> float:
    """The share of the state's bytes kept in host memory: 0, a fraction, or 1 (``True``).

    Example::

      >>> Zero1Options(offload_state_to_host=True).offload_fraction
      1.0
    """
    return float(self.offload_state_to_host)

  def keywords(self) -> dict[str, Any]:
    """The record as ``Zero1Optimizer``'s keyword arguments.

    Example::

      >>> Zero1Options(strict=True).keywords()["strict"]
      True
    """
    return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}


def levers_of(obj: Any, attribute: Callable[[str], str]) -> dict[str, Any]:
  """Every memory lever of :class:`Zero1Options`, read off ``obj``'s attribute ``attribute(lever)``.

  The trainer mixin names them ``zero1_<lever>``, the engines ``<LEVER>``.

  Example::

    >>> class Engine:
    ...   OFFLOAD_STATE_TO_HOST, STATE_DTYPE, STATE_ROUNDING, MASTER_DTYPE = True, None, "nearest", None
    ...   PARAMS_ACROSS_DTYPE = None
    >>> levers_of(Engine(), str.upper)["state_rounding"]
    'nearest'
  """
  names = [f.name for f in dataclasses.fields(Zero1Options) if f.metadata.get("lever")]
  return {name: getattr(obj, attribute(name)) for name in names}


def as_dtype(option: str, value: Any, example: str) -> np.dtype:
  """``value`` as a numpy dtype, or a ``Zero1Error`` naming the option and a dtype to use.

  Example::

    >>> as_dtype("state_dtype", "bfloat16", "jnp.bfloat16")
    dtype(bfloat16)
  """
  try:
    return jnp.dtype(value)
  except TypeError as e:
    raise Zero1Error(f"{option}={value!r} is not a dtype ({e}); use e.g. {example}") from None


def _state_dtype(state_dtype: Any, rounding: str) -> np.dtype | None:
  """The storage dtype asked for: None, or a floating dtype that ``rounding`` can narrow to."""
  if rounding not in ROUNDINGS:
    raise Zero1Error(f"state_rounding={rounding!r} is not one of {ROUNDINGS}; pass one of them")
  if state_dtype is None:
    return None
  dtype = as_dtype("state_dtype", state_dtype, "jnp.bfloat16")
  if not jnp.issubdtype(dtype, jnp.floating):
    raise Zero1Error(
        f"state_dtype={dtype} is not a floating dtype: optimizer moments need one; pass e.g. jnp.bfloat16"
    )
  if rounding == "stochastic" and dtype != jnp.bfloat16:
    raise Zero1Error(
        f"state_rounding='stochastic' narrows float32 to bfloat16 only, not to {dtype}; "
        "pass state_rounding='nearest'"
    )
  return dtype


def _offload(offload: Any) -> bool | float:
  """``True``, ``False``, or the fraction of the state's bytes to keep in host memory, in (0, 1]."""
  if isinstance(offload, bool | np.bool_):
    return bool(offload)
  if isinstance(offload, int | float | np.floating | np.integer) and 0 < offload <= 1:
    return True if offload == 1 else float(offload)
  raise Zero1Error(
      f"offload_state_to_host={offload!r} is neither a bool nor a fraction in (0, 1]: pass True (all of "
      "the state), False (none) or the share of the state's bytes to keep in host memory, e.g. 0.25"
  )


def _master_dtype(master_dtype: Any) -> np.dtype | None:
  """The master dtype asked for: None, or a floating dtype (checked against the parameters later)."""
  if master_dtype is None:
    return None
  dtype = as_dtype("master_dtype", master_dtype, "jnp.float32")
  if not jnp.issubdtype(dtype, jnp.floating):
    raise Zero1Error(f"master_dtype={dtype} is not a floating dtype (use jnp.float32)")
  return dtype


def _params_across_dtype(dtype: Any, master_dtype: np.dtype | None, axes: tuple[str, ...]) -> np.dtype | None:
  """The dtype the new parameters cross between slices or nodes in: None, a floating dtype or int8
  (block-scaled), with master copies (which keep the exact values) and a slow data axis to cross."""
  if dtype is None:
    return None
  dtype = as_dtype("params_across_dtype", dtype, "jnp.int8")
  if not (jnp.issubdtype(dtype, jnp.floating) or dtype == jnp.int8):
    raise Zero1Error(f"params_across_dtype={dtype} is neither a floating dtype nor int8: use jnp.int8 "
                     "(blocks with a float32 scale each) or a narrower float such as jnp.bfloat16")
  if master_dtype is None:
    # The model's copy is rounded on the way across; without masters the rounding would compound.
    raise Zero1Error(f"params_across_dtype={dtype} rounds the parameters every replica gets back, so the "
                     "exact values must live elsewhere: set master_dtype (e.g. jnp.float32; float32 "
                     "masters split over the data axes, allowed for a float32 model with this option)")
  if len(axes) < 2:
    raise Zero1Error(f"params_across_dtype={dtype} narrows the parameters' all-gather over the slow data "
                     f"axes (every one but the last listed, data_axis=(\"replica\", \"data\")); the state is "
                     f"split over {axes} only, so nothing crosses between slices or nodes; leave "
                     "params_across_dtype out")
  return dtype
