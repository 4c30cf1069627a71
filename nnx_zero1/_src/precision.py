"""Optimizer state stored in a narrower float dtype than ``tx`` computes it in (``state_dtype``).

Between steps each floating, parameter-tied state leaf (Adam's ``mu`` and ``nu``,
momentum traces) lives in ``state_dtype``; ``update`` widens it to the dtype
``tx.init`` created it in, runs ``tx`` and narrows the new state again. Scalars
(the count) and state tied to no parameter keep their dtype.

Narrowing is stochastic by default. Round-to-nearest loses every change smaller
than half a bfloat16 spacing (2**-9 relative): Adam's second moment moves by at
most ``1 - b2`` = 0.1% a step when it decays, so rounded to nearest it can only grow.
Stochastic rounding keeps the expected value of each change; its random bits come
from the step count and the leaf's index, generated where each slice lives (no
collective), and equal whatever the data-parallel size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nnx_zero1._src.errors import Zero1Error, describe_mesh
from nnx_zero1._src.layout import Reason
from nnx_zero1._src.layout_plan import LeafPlan, Zero1Plan

__all__ = [
    "ROUNDINGS", "as_dtype", "check_state_dtype", "narrow", "narrowed_plan", "stochastic_round", "widen",
]

ROUNDINGS = ("stochastic", "nearest")
_UNTIED = (Reason.SCALAR, Reason.NOT_PARAM_SHAPED)
_LOW_BITS = 16  # what float32 has beyond bfloat16's mantissa


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


def check_state_dtype(state_dtype: Any, rounding: str) -> np.dtype | None:
  """The storage dtype asked for, checked before any state exists.

  Args:
    state_dtype: ``None`` (state as ``tx`` makes it) or a floating dtype.
    rounding: ``"stochastic"`` or ``"nearest"``.

  Returns:
    ``state_dtype`` as a numpy dtype, or None.

  Raises:
    Zero1Error: a dtype that is not floating, an unknown rounding, or stochastic
      rounding to anything but bfloat16.

  Example::

    >>> import jax.numpy as jnp
    >>> check_state_dtype(jnp.bfloat16, "stochastic")
    dtype(bfloat16)
  """
  if rounding not in ROUNDINGS:
    raise Zero1Error(f"state_rounding={rounding!r} is not one of {ROUNDINGS}")
  if state_dtype is None:
    return None
  dtype = as_dtype("state_dtype", state_dtype, "jnp.bfloat16")
  if not jnp.issubdtype(dtype, jnp.floating):
    raise Zero1Error(
        f"state_dtype={dtype} is not a floating dtype: optimizer moments need one (e.g. jnp.bfloat16)"
    )
  if rounding == "stochastic" and dtype != jnp.bfloat16:
    raise Zero1Error(
        f"state_rounding='stochastic' narrows float32 to bfloat16 only, not to {dtype}; "
        "pass state_rounding='nearest'"
    )
  return dtype


def _narrowable(leaf: LeafPlan, dtype: np.dtype) -> bool:
  return (
      bool(leaf.shape) and leaf.reason not in _UNTIED
      and jnp.issubdtype(leaf.dtype, jnp.floating) and np.dtype(leaf.dtype) != dtype
  )


def narrowed_plan(plan: Zero1Plan, state_dtype: np.dtype | None, rounding: str = "stochastic") -> Zero1Plan:
  """``plan`` with each floating, parameter-tied, non-scalar state leaf stored in ``state_dtype``.

  Such a leaf's ``dtype`` becomes ``state_dtype`` and its ``compute_dtype`` the
  dtype ``tx`` made it in; the others are unchanged.

  Raises:
    Zero1Error: no leaf would change (no such state, or all of it in ``state_dtype``
      already): the option would be a silent no-op.

  Example::

    >>> import jax, jax.numpy as jnp, optax
    >>> from nnx_zero1._src.layout_plan import make_plan
    >>> plan = make_plan(optax.adam(1e-3), {"w": jnp.ones(4)}, jax.make_mesh((1,), ("data",)), ("data",))
    >>> [(leaf.dtype, leaf.compute_dtype) for leaf in narrowed_plan(plan, jnp.bfloat16).state_leaves]
    [('int32', None), ('bfloat16', 'float32'), ('bfloat16', 'float32')]
  """
  if state_dtype is None:
    return plan
  dtype = np.dtype(state_dtype)
  if not any(_narrowable(leaf, dtype) for leaf in plan.state_leaves):
    kept = sorted({leaf.dtype for leaf in plan.state_leaves if leaf.shape and leaf.reason not in _UNTIED})
    raise Zero1Error(
        f"state_dtype={dtype} changes nothing: the optimizer has no floating state tied to a parameter "
        f"in another dtype (its parameter-tied state is {kept or 'empty'}); drop state_dtype; "
        f"{describe_mesh(plan.mesh)}"
    )
  leaves = tuple(
      dataclasses.replace(leaf, dtype=str(dtype), compute_dtype=leaf.dtype)
      if _narrowable(leaf, dtype) else leaf
      for leaf in plan.state_leaves
  )
  return dataclasses.replace(plan, state_leaves=leaves, state_rounding=rounding)


def stochastic_round(x: jax.Array, key: jax.Array) -> jax.Array:
  """``x`` (float32) to bfloat16, rounded up with probability equal to the discarded fraction.

  Adds 16 random bits to the 16 low bits of each float's pattern and drops them:
  the result is one of the two nearest bfloat16 values, unbiased in expectation.

  Example::

    >>> import jax, jax.numpy as jnp
    >>> x = jnp.full((4096,), 1.0 + 2.0**-10)  # a quarter of the way from 1.0 to the next bfloat16
    >>> float(stochastic_round(x, jax.random.key(0)).astype(jnp.float32).mean())  # doctest: +ELLIPSIS
    1.00...
  """
  bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
  noise = jax.random.bits(key, x.shape, jnp.uint32) >> (32 - _LOW_BITS)
  kept = (bits + noise) & jnp.uint32(0xFFFFFFFF << _LOW_BITS & 0xFFFFFFFF)
  return jax.lax.bitcast_convert_type(kept, jnp.float32).astype(jnp.bfloat16)  # exact: low bits are 0


def _map_narrowed(state: Any, plan: Zero1Plan, cast: Callable[[int, Any, LeafPlan], Any]) -> Any:
  if plan.state_rounding is None:  # no state_dtype: nothing is narrowed, every update skips this
    return state
  leaves, treedef = jax.tree.flatten(state)
  return jax.tree.unflatten(treedef, [
      cast(i, x, leaf) if leaf.compute_dtype is not None else x
      for i, (x, leaf) in enumerate(zip(leaves, plan.state_leaves, strict=True))
  ])


def widen(state: Any, plan: Zero1Plan) -> Any:
  """The stored state (pure arrays, in tree-leaf order of the plan) in the dtypes ``tx`` computes in.

  Example::

    >>> import jax, jax.numpy as jnp, optax
    >>> from nnx_zero1._src.layout_plan import make_plan
    >>> plan = make_plan(optax.sgd(0.1, 0.9), {"w": jnp.ones(4)}, jax.make_mesh((1,), ("data",)), ("data",))
    >>> widen((optax.TraceState(trace={"w": jnp.ones(4, jnp.bfloat16)}), ()),
    ...       narrowed_plan(plan, jnp.bfloat16))[0].trace["w"].dtype
    dtype('float32')
  """
  return _map_narrowed(state, plan, lambda i, x, leaf: x.astype(leaf.compute_dtype))


def narrow(state: Any, plan: Zero1Plan, step: Any = None) -> Any:
  """The state computed by ``tx`` in the dtypes the plan stores it in.

  Args:
    state: pure arrays in the plan's tree-leaf order.
    plan: a plan from :func:`narrowed_plan`.
    step: the optimizer's step count, which seeds stochastic rounding (with the
      leaf's index); ``None`` rounds to nearest (the initial state).

  Returns:
    ``state`` with each narrowed leaf cast to its stored dtype.

  Example::

    >>> import jax, jax.numpy as jnp, optax
    >>> from nnx_zero1._src.layout_plan import make_plan
    >>> plan = make_plan(optax.sgd(0.1, 0.9), {"w": jnp.ones(4)}, jax.make_mesh((1,), ("data",)), ("data",))
    >>> state = (optax.TraceState(trace={"w": jnp.ones(4)}), ())
    >>> narrow(state, narrowed_plan(plan, jnp.bfloat16), step=jnp.uint32(3))[0].trace["w"].dtype
    dtype(bfloat16)
  """
  if plan.state_rounding is None:
    return state
  if step is None or plan.state_rounding == "nearest":
    return _map_narrowed(state, plan, lambda i, x, leaf: x.astype(leaf.dtype))
  key = jax.random.fold_in(jax.random.key(0), step)
  return _map_narrowed(state, plan, lambda i, x, leaf: stochastic_round(x, jax.random.fold_in(key, i)))
