"""``Zero1Engine``: the reference ``Engine`` given Zero-1 by ``Zero1EngineMixin``, nothing else."""

from __future__ import annotations

from nnx_zero1.adapters.maxtext import Zero1EngineMixin
from tests.support.reference_engine.engine import Engine

__all__ = ["Zero1Engine"]


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
