"""A MaxText-style training engine and its Zero-1 adapter.

The engine splits a training step into ``fwd_bwd(batch)`` (forward and
backward of one micro-batch; gradients accumulated, nothing updated) and
``update()`` (applies the averaged gradients). Both are jitted kernels whose
in/out shardings are read off the live arrays. Gradients stay unreduced over
the data axis while they accumulate (one partial sum per replica) and
``update`` reduces them once per optimizer step: an all-reduce in ``Engine``,
a reduce-scatter straight onto the Zero-1 layout in ``Zero1Engine``.

Example::

  engine = Zero1Engine(model, optax.adamw(3e-4), mesh, loss_fn=loss_fn)
  for micro_batch in micro_batches:
    loss = engine.fwd_bwd(micro_batch)
  step = engine.update()
"""
from __future__ import annotations

from typing import Any

from nnx_zero1._src.engine.engine import Engine, LossFn
from nnx_zero1._src.engine.zero1 import Zero1EngineMixin

__all__ = ["Engine", "LossFn", "Zero1EngineMixin", "Zero1Engine", "Zero1MaxTextTrainingEngine",  # noqa: F822 (lazy)
           "Zero1AbstractMaxTextEngine"]

_LAZY = ("Zero1MaxTextTrainingEngine", "Zero1AbstractMaxTextEngine")


def __getattr__(name: str) -> Any:
  """``Zero1MaxTextTrainingEngine`` (and its ahead-of-time twin ``Zero1AbstractMaxTextEngine``) load
  MaxText (Python >= 3.12) on first use, not on import."""
  if name not in _LAZY:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  try:
    from . import _maxtext_engine
  except ImportError as e:
    raise ImportError(
        f"{name} needs MaxText's engine (maxtext.training_engine, Python >= 3.12; "
        f"tested with maxtext==0.2.5): {e}"
    ) from e
  return getattr(_maxtext_engine, name)


class Zero1Engine(Zero1EngineMixin, Engine):
  """``Engine`` with Zero-1: same signature, kernels and checkpoint format.

  Each of the N data-parallel replicas holds 1/N of the optimizer moments;
  ``update`` reduce-scatters the accumulated gradients onto that layout once,
  runs the optimizer on the slices and all-gathers the parameters back.

  Args:
    model: the NNX model; parameters not yet on ``mesh`` are put there replicated.
    tx: the optax transformation.
    mesh: the device mesh, with the data axis.
    loss_fn: ``loss_fn(model, batch) -> scalar`` mean loss.
    checkpoint_dir: where ``save_checkpoint`` writes (orbax); None for no checkpoints.
    wrt: which variables are trained.
    data_axis: the data-parallel mesh axis (or tuple of axes) the moments are split over.
    defer_reduction: keep gradients unreduced until ``update`` (default True).
    strict: raise ``Zero1Error`` when a parameter-shaped optimizer leaf cannot be
      split or the reduction cannot be deferred.

  Raises:
    Zero1Error: as ``Engine``, and when the optimizer cannot be made Zero-1
      (the model is then left as it was).

  Example::

    >>> import jax, jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    >>> loss_fn = lambda m, b: jnp.mean(m(b["x"]) ** 2)
    >>> engine = Zero1Engine(model, optax.adam(1e-3), mesh, loss_fn=loss_fn)
    >>> _ = engine.fwd_bwd({"x": jnp.ones((2, 2))})
    >>> engine.update()
    1
  """
