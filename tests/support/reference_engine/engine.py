"""``Engine``: the reference MaxText-style engine (``fwd_bwd`` per micro-batch, ``update`` per step).

Test scaffolding (``tests.support.reference_engine``); ``Zero1Engine`` is this class with
``Zero1EngineMixin``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_zero1._src import deferral
from nnx_zero1._src.checkpoint import restore_into
from nnx_zero1._src.compat import Filter
from nnx_zero1._src.errors import Zero1Error, describe_mesh
from nnx_zero1._src.mesh import sharding_on_mesh
from nnx_zero1._src.specs import DataAxis, data_axes, data_axis_size
from tests.support.reference_engine import checkpoint as _checkpoint
from tests.support.reference_engine import kernels as _kernels
from tests.support.reference_engine import rows as replica_rows

__all__ = ["Engine", "LossFn"]

logger = logging.getLogger("tests.support.reference_engine")

LossFn = Callable[[Any, dict], jax.Array]  # (model, batch) -> mean loss; the model: any nnx.Module


def _on_mesh(tree: Any, mesh: Mesh) -> Any:
  """Arrays not yet on ``mesh`` go there replicated, so every kernel sharding is a mesh sharding."""
  def put(x):
    if isinstance(getattr(x, "sharding", None), NamedSharding) and x.sharding.mesh == mesh:
      return x
    return jax.device_put(x, sharding_on_mesh(x, mesh))

  return jax.tree.map(put, tree)


class Engine:
  """A compact training engine of MaxText's shape: ``fwd_bwd`` / ``update`` kernels.

  ``loss_fn(model, batch) -> scalar`` is the mean loss over ``batch``, a dict of
  arrays whose leading dimension is the batch (put on the data axis when it is
  not already). Call ``fwd_bwd`` once per micro-batch and ``update`` once per
  optimizer step. Checkpoints hold the parameters, the optimizer state, the
  accumulated gradients and the micro-batch count, so a save between two
  micro-batches resumes exactly.

  With deferral (the default) ``loss_fn`` runs once per replica inside
  ``shard_map``, on that replica's rows: the model must work on local arrays
  (no ``out_sharding=`` requests, which ``auto_axes`` cannot serve in Manual
  mode). Deferral needs replicated parameters and a batch split over the data
  axes only; otherwise (or with ``defer_reduction=False``) XLA differentiates
  the global program and reduces every micro-batch, logged at info level.
  Only ``wrt`` variables change: a ``loss_fn`` that updates other model state
  (batch statistics, RNG counters) is refused with ``Zero1Error``, as
  ``value_and_grad_accumulated`` refuses it.

  Example::

    >>> import jax, jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> loss_fn = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)
    >>> engine = Engine(model, optax.sgd(0.1), mesh, loss_fn=loss_fn)
    >>> _ = engine.fwd_bwd({"x": jnp.ones((4, 2)), "y": jnp.zeros((4, 1))})
    >>> engine.update()
    1

  Args:
    model: the NNX model; parameters not yet on ``mesh`` are put there replicated.
    tx: the optax transformation.
    mesh: the device mesh.
    loss_fn: ``loss_fn(model, batch) -> scalar`` mean loss.
    checkpoint_dir: where ``save_checkpoint`` writes (orbax); None for no checkpoints.
    wrt: which variables are trained.
    data_axis: the data-parallel mesh axis (or tuple of axes).
    defer_reduction: keep gradients unreduced until ``update`` (default: the
      class attribute ``DEFER_REDUCTION``, True). False reduces every micro-batch.
    strict: raise ``Zero1Error`` instead of reducing every micro-batch when the
      reduction cannot be deferred (and, with Zero-1, when a parameter-shaped
      optimizer leaf cannot be split).
    shard_accumulator: ZeRO-2 (Zero-1 engines only): keep the gradient
      accumulator on the Zero-1 layout, 1/N of the gradients per device instead
      of one whole row per replica, at the price of one reduce-scatter per
      micro-batch instead of one per step. Checkpoints then hold the summed
      accumulator (parameter-shaped) and cross with the per-replica rows.

  Raises:
    Zero1Error: the mesh lacks the data axis, the optimizer cannot be built as
      asked (the model is then left as it was), ``update`` without a ``fwd_bwd``
      before it, a ``loss_fn`` that updates model state other than ``wrt``, or
      (``strict``) a reduction that cannot be deferred.
  """

  DEFER_REDUCTION = True

  def __init__(
      self,
      model: nnx.Module,
      tx: optax.GradientTransformation,
      mesh: Mesh,
      *,
      loss_fn: LossFn,
      checkpoint_dir: str | os.PathLike | None = None,
      wrt: Filter = nnx.Param,
      data_axis: DataAxis = "data",
      defer_reduction: bool | None = None,
      strict: bool = False,
      shard_accumulator: bool = False,
  ):
    self.mesh = mesh
    self.data_axis = data_axes(data_axis)
    self.data_size = data_axis_size(mesh, self.data_axis)
    self.loss_fn = loss_fn
    self.wrt = wrt
    self.defer_reduction = self.DEFER_REDUCTION if defer_reduction is None else defer_reduction
    self.strict = strict
    self.shard_accumulator = shard_accumulator
    if shard_accumulator and not self.defer_reduction:
      raise Zero1Error(
          "shard_accumulator=True reduce-scatters every micro-batch's per-replica gradients; "
          f"defer_reduction=False asks for the global program instead; {describe_mesh(mesh)}"
      )
    before = nnx.as_pure(nnx.state(model))
    nnx.update(model, _on_mesh(before, mesh))
    try:
      self.optimizer = self._make_optimizer(model, tx)
      if shard_accumulator:
        self.model = model  # the targets are read off the live parameters
        self._check_shardable(nnx.as_pure(nnx.state(model, wrt)))
    except Exception:
      nnx.update(model, before)  # a refused engine leaves the model as it was
      raise
    self.model = model
    nnx.update(self.optimizer, _on_mesh(nnx.state(self.optimizer), mesh))
    params = nnx.as_pure(nnx.state(model, wrt))
    self._grad_acc = (
        replica_rows.zeros_on(params, self._gradient_targets()) if shard_accumulator
        else replica_rows.zeros_accumulator(params, mesh, self.data_axis)
    )
    self._micro_steps = jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(mesh, P()))
    self._pending = 0  # host mirror of _micro_steps, so update() can refuse an empty step
    self.grad_norm: jax.Array | None = None
    self._fwd_bwd_kernels: dict = {}
    self._eval_kernels: dict = {}
    self._update_kernel: tuple[_kernels.KernelSpec, Callable] | None = None
    self._manager = None
    if checkpoint_dir is not None:
      self._manager = _checkpoint.make_manager(checkpoint_dir)

  # -- hooks a Zero-1 mixin overrides ---------------------------------------------------------
  def _make_optimizer(self, model: nnx.Module, tx: optax.GradientTransformation) -> nnx.Optimizer:
    """The optimizer; built before any kernel reads its shardings."""
    return nnx.Optimizer(model, tx, wrt=self.wrt)

  def _gradient_targets(self) -> tuple[NamedSharding, ...]:
    """Where ``update`` puts the reduced gradients, per parameter: their own layout (all-reduce)."""
    return tuple(_kernels.shardings_of(jax.tree.leaves(self._params())))

  def _check_shardable(self, params: Any) -> None:
    """``shard_accumulator`` needs a Zero-1 layout to scatter onto, and whole gradients per replica."""
    homes = tuple(_kernels.shardings_of(jax.tree.leaves(params)))
    if tuple(self._gradient_targets()) == homes:
      raise Zero1Error(
          f"shard_accumulator=True reduce-scatters each micro-batch's gradients onto the optimizer's "
          f"Zero-1 layout, which {type(self).__name__}'s plain nnx.Optimizer does not have (its state is "
          f"whole on every replica); use a Zero-1 engine; {describe_mesh(self.mesh)}"
      )
    self._refuse_blocked(deferral.deferral_blocker([], list(homes), self.data_axis))

  def _refuse_blocked(self, blocker: str | None) -> None:
    if self.shard_accumulator and blocker is not None:
      raise Zero1Error(f"shard_accumulator=True needs each replica's whole gradients, but {blocker}; "
                       f"{describe_mesh(self.mesh)}")

  # -- live state -------------------------------------------------------------------------------
  def _params(self) -> Any:
    return nnx.as_pure(nnx.state(self.model, self.wrt))

  def _rest(self) -> Any:
    return nnx.as_pure(nnx.state(self.model, nnx.Not(self.wrt)))

  def _opt_state(self) -> Any:
    return nnx.as_pure(nnx.state(self.optimizer))

  def _place_batch(self, batch: dict) -> dict:
    def put(x):
      target = deferral.batch_sharding(jnp.shape(x), getattr(x, "sharding", None), self.mesh, self.data_axis)
      if isinstance(x, jax.Array) and x.sharding == target:
        return x
      return jax.device_put(x, target)

    return jax.tree.map(put, batch)

  def _batch_key(self, batch: dict) -> tuple:
    leaves, treedef = jax.tree.flatten(batch)
    return (treedef, *((x.shape, x.dtype, x.sharding.spec) for x in leaves))

  def _spec(self, mode: str | None = None) -> _kernels.KernelSpec:
    """The update kernel's static spec (``mode=None``) or a micro-batch/eval kernel's, which
    leaves the optimizer out so engines that differ only in it share compiled kernels."""
    homes = tuple(jax.tree.leaves(_kernels.shardings_of(self._params())))
    if mode is not None:
      targets = tuple(self._gradient_targets()) if mode == _kernels.SCATTERED else ()
      return _kernels.KernelSpec(
          nnx.graphdef(self.model), None, self.loss_fn, self.mesh, self.data_axis, self.wrt, homes, targets,
          mode,
      )
    return _kernels.KernelSpec(
        nnx.graphdef(self.model), nnx.graphdef(self.optimizer), self.loss_fn, self.mesh, self.data_axis,
        self.wrt, homes, tuple(self._gradient_targets()), self._accumulation(),
    )

  def _accumulation(self) -> str:
    return _kernels.SCATTERED if self.shard_accumulator else _kernels.DEFERRED

  def _mode(self, batch: dict, *, log: bool = False) -> str:
    """How ``batch``'s gradients are reduced: deferred when each replica can compute whole
    gradients of its own rows and deferral is on; otherwise every micro-batch."""
    blocker = deferral.deferral_blocker(
        jax.tree.leaves(_kernels.shardings_of(batch)),
        jax.tree.leaves(_kernels.shardings_of(self._params())),
        self.data_axis,
    )
    self._refuse_blocked(blocker)
    deferred = deferral.defer(
        blocker, requested=self.defer_reduction, strict=self.strict, mesh=self.mesh,
        who=type(self).__name__, log=logger if log else None,
    )
    return self._accumulation() if deferred else _kernels.GLOBAL

  def _fwd_bwd_call(self, batch: dict) -> tuple:
    key = self._batch_key(batch)
    if key not in self._fwd_bwd_kernels:
      spec = self._spec(self._mode(batch, log=True))
      state = (self._params(), self._rest(), self._grad_acc, self._micro_steps)
      self._fwd_bwd_kernels[key] = (spec, _kernels.jit_fwd_bwd(spec, *state, batch))
    spec, kernel = self._fwd_bwd_kernels[key]
    return kernel, (spec, self._params(), self._rest(), self._grad_acc, self._micro_steps, batch)

  def _update_call(self) -> tuple:
    args = (self._params(), self._rest(), self._opt_state(), self._grad_acc, self._micro_steps)
    if self._update_kernel is None:
      spec = self._spec()
      self._update_kernel = (spec, _kernels.jit_update(spec, *args))
    spec, kernel = self._update_kernel
    return kernel, (spec, *args)

  # -- public API -------------------------------------------------------------------------------
  def fwd_bwd(self, batch: dict) -> jax.Array:
    """Forward and backward of one micro-batch; adds its gradients, updates nothing.

    Under deferral no gradient collective runs here: each replica adds its own
    gradient to its row of the accumulator.

    Args:
      batch: a dict of arrays whose leading dimension is the batch; put on the
        data axis when it is not already.

    Returns:
      The micro-batch's mean loss, a scalar ``jax.Array``.

    Raises:
      Zero1Error: ``loss_fn`` updates model state other than ``wrt``, or
        (``strict``) the reduction cannot be deferred for this batch.

    Example::

      for micro_batch in micro_batches:  # dicts of arrays, batch dimension first
        loss = engine.fwd_bwd(micro_batch)
    """
    with jax.set_mesh(self.mesh):
      batch = self._place_batch(batch)
      kernel, args = self._fwd_bwd_call(batch)
      loss, self._grad_acc, self._micro_steps = kernel(*args)
    self._pending += 1
    return loss

  def update(self) -> int:
    """Reduces the accumulated gradients once, averages them over the micro-batches,
    applies them, resets the accumulator and returns the new step. The averaged
    gradients' global norm is kept in ``self.grad_norm``.

    Returns:
      The optimizer's step count after this update.

    Raises:
      Zero1Error: no ``fwd_bwd`` since the last ``update``.

    Example::

      step = engine.update()
      print(step, float(engine.grad_norm))
    """
    if self._pending == 0:
      raise Zero1Error(
          f"update() needs at least one fwd_bwd() since the last update; {describe_mesh(self.mesh)}"
      )
    with jax.set_mesh(self.mesh):
      kernel, args = self._update_call()
      params, opt_state, self._grad_acc, self._micro_steps, self.grad_norm = kernel(*args)
    nnx.update(self.model, params)
    nnx.update(self.optimizer, opt_state)
    self._pending = 0
    return int(self.optimizer.step[...])

  def eval_step(self, batch: dict) -> jax.Array:
    """The mean loss of ``batch``; changes nothing.

    Args:
      batch: a dict of arrays whose leading dimension is the batch.

    Returns:
      The mean loss, a scalar ``jax.Array``.

    Example::

      val_loss = float(engine.eval_step(val_batch))
    """
    with jax.set_mesh(self.mesh):
      batch = self._place_batch(batch)
      key = self._batch_key(batch)
      if key not in self._eval_kernels:
        spec = self._spec(self._mode(batch))
        self._eval_kernels[key] = (spec, _kernels.jit_eval(spec, self._params(), self._rest(), batch))
      spec, kernel = self._eval_kernels[key]
      return kernel(spec, self._params(), self._rest(), batch)

  def lowered_fwd_bwd(self, batch: dict) -> jax.stages.Lowered:
    """The micro-batch kernel lowered for ``batch``, to read its compiled HLO.

    Args:
      batch: a micro-batch, as for :meth:`fwd_bwd`.

    Returns:
      The ``jax.stages.Lowered`` kernel; ``.compile().as_text()`` is its HLO.

    Example::

      hlo = engine.lowered_fwd_bwd(batch).compile().as_text()
    """
    with jax.set_mesh(self.mesh):
      kernel, args = self._fwd_bwd_call(self._place_batch(batch))
      return kernel.lower(*args)

  def lowered_update(self) -> jax.stages.Lowered:
    """The update kernel lowered, to read its compiled HLO.

    Returns:
      The ``jax.stages.Lowered`` kernel; ``.compile().as_text()`` is its HLO.

    Example::

      hlo = engine.lowered_update().compile().as_text()
    """
    with jax.set_mesh(self.mesh):
      kernel, args = self._update_call()
      return kernel.lower(*args)

  def _checkpoint_tree(self) -> dict:
    return {
        "params": nnx.to_pure_dict(nnx.state(self.model, self.wrt)),
        "optimizer": nnx.to_pure_dict(nnx.state(self.optimizer)),
        "grad_acc": nnx.to_pure_dict(self._grad_acc),
        "micro_steps": self._micro_steps,
    }

  def _require_manager(self) -> ocp.CheckpointManager:
    if self._manager is None:
      raise Zero1Error(f"this engine was built without checkpoint_dir; {describe_mesh(self.mesh)}")
    return self._manager

  def save_checkpoint(self, step: int) -> None:
    """Saves params, optimizer state, accumulated gradients and micro-batch count as ``step``.

    The tree is ``{"params", "optimizer", "grad_acc", "micro_steps"}`` with the
    same paths, shapes and dtypes for ``Engine`` and ``Zero1Engine``.

    Args:
      step: the step number to save as.

    Raises:
      Zero1Error: the engine was built without ``checkpoint_dir``.

    Example::

      engine.save_checkpoint(step)  # also fine between two fwd_bwd calls
    """
    self._require_manager().save(step, args=ocp.args.StandardSave(self._checkpoint_tree()))

  def restore_checkpoint(self, step: int | None = None) -> int:
    """Restores ``step`` (the latest when None) onto this engine's own layouts; returns the step.

    Orbax lays every array out as this engine's live one is, so checkpoints
    cross between ``Engine`` and ``Zero1Engine``. An accumulator saved at
    another data-parallel size (another number of rows) is summed into row 0:
    the same gradient, though not bit-for-bit the same reduction order.

    Args:
      step: the step to restore; ``None`` for the latest.

    Returns:
      The step restored.

    Raises:
      Zero1Error: the engine was built without ``checkpoint_dir``, or there is no
        checkpoint in it.

    Example::

      step = engine.restore_checkpoint()  # the latest
    """
    manager = self._require_manager()
    manager.wait_until_finished()
    step = manager.latest_step() if step is None else step
    if step is None:
      raise Zero1Error(f"no checkpoint in {manager.directory}; {describe_mesh(self.mesh)}")
    tree, convert = _checkpoint.restore(manager, step, self._checkpoint_tree(), self.mesh)
    params = nnx.state(self.model, self.wrt)
    nnx.replace_by_pure_dict(params, tree["params"])
    nnx.update(self.model, params)
    optimizer = nnx.state(self.optimizer)
    nnx.replace_by_pure_dict(optimizer, tree["optimizer"])
    restore_into(self.optimizer, optimizer)  # the core restore path: checked, on the optimizer's layout
    grad_acc = tree["grad_acc"]
    if convert:
      grad_acc = self._converted_accumulator(grad_acc)
    nnx.replace_by_pure_dict(self._grad_acc, grad_acc)
    self._micro_steps = tree["micro_steps"]
    self._pending = int(self._micro_steps)
    return step

  def _converted_accumulator(self, saved: Any) -> Any:
    pure_params = nnx.to_pure_dict(self._params())
    targets = None
    if self.shard_accumulator:
      targets = jax.tree.unflatten(jax.tree.structure(pure_params), list(self._gradient_targets()))
    what = _checkpoint.conversion(saved, pure_params, targets, self.data_size)
    logger.info("%s: %s", type(self).__name__, what)
    return _checkpoint.converted_accumulator(saved, pure_params, self.mesh, self.data_axis, targets)

  def close(self) -> None:
    """Waits for pending checkpoint writes and releases the checkpoint manager.

    Example::

      engine.close()
    """
    if self._manager is not None:
      self._manager.wait_until_finished()
      self._manager.close()
      self._manager = None
