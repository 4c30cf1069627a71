"""``Zero1MaxTextTrainingEngine``: MaxText's own training engine with Zero-1 from this plugin.

Needs Python >= 3.12 and ``maxtext`` (tested: 0.2.5). Import it as
``from nnx_zero1.adapters.maxtext import Zero1MaxTextTrainingEngine``, which
loads this module on first use.

MaxText's ``MaxTextTrainingEngine`` splits a step into ``fwd_bwd(batch)`` per
micro-batch and ``update()``; its kernels read their shardings off the live
arrays, and its optimizer comes from ``_build_optimizer(tx)``. This engine
answers that hook with a ``Zero1Optimizer``, so the moments live on the Zero-1
layout from the start and every kernel, checkpoint and metric is MaxText's.
Where MaxText defers the data-parallel gradient all-reduce to ``update`` (pure
data parallelism, ``shard_mode=explicit``), the update kernel reduce-scatters
the deferred gradients straight onto the Zero-1 layout instead.

``SHARD_ACCUMULATOR = True`` on a subclass adds ZeRO-2 there: each
micro-batch's gradients are reduce-scattered at once into an accumulator on the
Zero-1 layout (1/N of the gradients per device) instead of kept as full-size
per-replica partial sums, and the update kernel needs no reduction. Where
MaxText would not defer, the constructor refuses it with ``Zero1Error``.

MaxText's own flag, ``shard_optimizer_over_data``, asks for what this class
does: with it set, this engine provides the Zero-1 (also with FSDP meshes, with
``shard_mode=auto`` and with every ``opt_type``, where MaxText's declines) and
hands MaxText's engine a copy of the config with the flag off, so MaxText's own
mechanism never runs on the same state; it says so once, at info level. With
the flag off nothing changes: choosing this class is the opt-in.

``Zero1AbstractMaxTextEngine`` is the same for MaxText's ahead-of-time engine
(``maxtext_engine_compile.AbstractMaxTextEngine``: shapes, no arrays, compiled
for a topology this host need not have). That engine traces ``nnx.Optimizer``
in ``_trace_train_state``; it runs here under ``zero1_optimizers``, so the
traced optimizer is a ``Zero1Optimizer`` with its moments on the Zero-1 layout.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any

import jax
from flax import nnx
from jax.sharding import NamedSharding

from nnx_zero1._src.deferral import deferral_blocker
from nnx_zero1._src.errors import Zero1Error, describe_mesh
from nnx_zero1._src.mesh import sharding_on_mesh
from nnx_zero1._src.optimizer import Zero1Optimizer
from nnx_zero1._src.options import Zero1Options, levers_of
from nnx_zero1._src.reduction import reduce_unreduced
from nnx_zero1._src.scope import options_scope
from nnx_zero1._src.specs import keep_axes
from nnx_zero1._src.storage import master_shardings

from . import _compat
from ._compat import ensure_tunix_types

ensure_tunix_types()

from maxtext.training_engine import maxtext_engine as _maxtext_engine  # noqa: E402
from maxtext.training_engine import maxtext_engine_compile as _maxtext_engine_compile  # noqa: E402

__all__ = ["Zero1MaxTextTrainingEngine", "Zero1AbstractMaxTextEngine"]


logger = logging.getLogger(__name__)


def _config_for_maxtext(config: Any) -> Any:
  """The config MaxText's engine gets: ``config``, with MaxText's own Zero-1 switched off."""
  if not _compat.maxtext_zero1_requested(config):
    return config
  logger.info(
      "Zero1MaxTextTrainingEngine: shard_optimizer_over_data=True is served by nnx_zero1's Zero-1 "
      "(optimizer state split over 'data', gradients reduce-scattered); MaxText's own Zero-1 is bypassed."
  )
  return _compat.without_maxtext_zero1(config)


def _mesh_argument(training_config: Any, args: tuple, kwargs: dict) -> Any:
  """The ``mesh`` a call of ``MaxTextTrainingEngine(training_config, *args, **kwargs)`` passes."""
  signature = inspect.signature(_maxtext_engine.MaxTextTrainingEngine.__init__)
  bound = signature.bind(None, training_config, *args, **kwargs)
  bound.apply_defaults()
  return bound.arguments["mesh"]


def _accumulator_refusal(config: Any, mesh: Any) -> str | None:
  """Why ZeRO-2 cannot run on MaxText's engine for this config and mesh; None when it can."""
  if _compat.maxtext_defers_reduction(config, mesh):
    return None
  mode = getattr(config, "shard_mode", None)
  where = "no mesh"
  if mesh is not None:
    kinds = sorted({t.name for t in mesh.axis_types})
    where = f"{describe_mesh(mesh)}, axis types {kinds}"
  return (
      "MaxText reduces the gradients in every micro-batch here instead of deferring the data-parallel "
      "all-reduce (it defers only with shard_mode=explicit, every mesh axis Explicit, every axis but "
      "'data' of size 1, 'data' larger than 1 and the batch split over 'data' alone), so there are no "
      f"per-replica gradients to reduce-scatter; shard_mode={getattr(mode, 'value', mode)}, {where}"
  )


def _zero2_blocker(model: Any, mesh: Any) -> str | None:
  """Why ZeRO-2 finds no whole per-replica gradients to reduce-scatter, or None: the core's
  ``deferral_blocker`` asked about the parameters' ``data`` axis alone.

  MaxText defers the data-parallel all-reduce only where every mesh axis but ``data`` has size 1
  (``_accumulator_refusal`` refuses the rest first), so a parameter's other axes split nothing;
  a parameter split over ``data`` has its gradient reduced in every micro-batch.
  """
  params = jax.tree.leaves(nnx.as_pure(nnx.state(model, nnx.Param)))
  over_data = [keep_axes(sharding_on_mesh(x, mesh), lambda a: a == "data") for x in params]
  return deferral_blocker((), over_data, ("data",))


def _restate(node: Any, shardings: list) -> None:
  """Gives the abstract arrays in ``node`` (in tree order) these shardings, memory kinds included."""
  leaves, treedef = jax.tree.flatten(nnx.as_pure(nnx.state(node)))
  homed = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
           for x, sharding in zip(leaves, shardings, strict=True)]
  nnx.update(node, jax.tree.unflatten(treedef, homed))


class Zero1MaxTextTrainingEngine(_maxtext_engine.MaxTextTrainingEngine):
  """MaxText's ``MaxTextTrainingEngine`` with its optimizer state split over ``"data"``.

  Same constructor, kernels, checkpoints and metrics as MaxText's engine; each
  of the N data-parallel replicas keeps 1/N of every parameter-shaped optimizer
  leaf. For elementwise optimizers (adamw, adam_pax, sgd) the parameters are
  bit-identical to MaxText's engine with Zero-1 off; checkpoints cross both
  ways, also between two micro-batches. ``shard_optimizer_over_data=True`` is
  served by this Zero-1 (MaxText's own is bypassed, logged once at info level).

  Args:
    training_config: MaxText's ``pyconfig.HyperParameters``.
    *args: the rest of ``MaxTextTrainingEngine``'s arguments, unchanged.
    **kwargs: the rest of its keyword arguments (``mesh=``, ...), unchanged.

  Two more levers, each a class attribute of a subclass (as on ``Zero1EngineMixin``):
  ``OFFLOAD_STATE_TO_HOST = True`` keeps the optimizer state's Zero-1 shards in
  host memory between steps (``Zero1Optimizer(offload_state_to_host=True)``, or a fraction of
  their bytes;
  MaxText's kernels read the host memory kind off the live arrays), and ZeRO-2:
  a subclass with ``SHARD_ACCUMULATOR = True`` reduce-scatters every
  micro-batch's gradients into an accumulator on the Zero-1 layout (1/N of the
  float32 gradients per device, one reduce-scatter per micro-batch instead of
  one per step). Parameters agree with the deferred accumulation's to float
  precision (another summation order); mid-accumulation checkpoints hold the
  summed gradients either way and cross both ways.

  Raises:
    Zero1Error: the engine is MaxText's ahead-of-time ``AbstractMaxTextEngine``
      (use ``Zero1AbstractMaxTextEngine``), or the optimizer cannot be made Zero-1;
      with ``SHARD_ACCUMULATOR``: MaxText does not defer the data-parallel
      all-reduce for this config and mesh, or a parameter is sharded over ``data``
      (no replica holds its whole gradient), or ``fwd_bwd`` runs before
      ``compile`` (MaxText's uncompiled kernels never defer).

  Example::

    config = pyconfig.initialize([..., "shard_mode=explicit", "ici_data_parallelism=4"])
    engine = Zero1MaxTextTrainingEngine(config, mesh=mesh)
    engine.compile(batch)
    for micro_batch in micro_batches:
      engine.fwd_bwd(micro_batch)
    step = engine.update()

    class Zero2Engine(Zero1MaxTextTrainingEngine):
      SHARD_ACCUMULATOR = True
  """

  SHARD_ACCUMULATOR = False
  # The memory levers, each at the record's default.
  OFFLOAD_STATE_TO_HOST: bool | float = Zero1Options.offload_state_to_host
  STATE_DTYPE: Any = Zero1Options.state_dtype
  STATE_ROUNDING: str = Zero1Options.state_rounding
  MASTER_DTYPE: Any = Zero1Options.master_dtype
  # Refused here: this engine's data axis is ``data`` alone, nothing it gathers crosses a slow axis.
  PARAMS_ACROSS_DTYPE: Any = Zero1Options.params_across_dtype

  def _zero1_options(self) -> Zero1Options:
    """The options this class asks for: the data axis ``data`` and its memory levers."""
    return Zero1Options(data_axis=Zero1Options.data_axis, **levers_of(self, str.upper))

  @functools.wraps(_maxtext_engine.MaxTextTrainingEngine.__init__)  # type: ignore[misc]  # shows MaxText's signature
  def __init__(self, training_config, *args, **kwargs):
    if isinstance(self, _maxtext_engine_compile.AbstractMaxTextEngine) and not isinstance(
        self, Zero1AbstractMaxTextEngine):
      raise Zero1Error(
          "Zero1MaxTextTrainingEngine does not cover maxtext_engine_compile.AbstractMaxTextEngine (the "
          "ahead-of-time engine): it traces nnx.Optimizer in _trace_train_state, not _build_optimizer. "
          "Use nnx_zero1.adapters.maxtext.Zero1AbstractMaxTextEngine."
      )
    config = _config_for_maxtext(training_config)
    if self.SHARD_ACCUMULATOR:
      # Before MaxText builds anything: a refused engine never exists.
      refusal = _accumulator_refusal(config, _mesh_argument(training_config, args, kwargs))
      if refusal is not None:
        raise Zero1Error(f"SHARD_ACCUMULATOR=True (ZeRO-2): {refusal}; set SHARD_ACCUMULATOR=False (Zero-1 "
                         "alone), or see docs/maxtext.md for the settings under which MaxText defers it")
    super().__init__(config, *args, **kwargs)

  def _build_optimizer(self, tx: Any) -> Zero1Optimizer:
    model, mesh = _compat.engine_model_and_mesh(self)
    if self.SHARD_ACCUMULATOR and (blocker := _zero2_blocker(model, mesh)) is not None:
      raise Zero1Error(
          f"SHARD_ACCUMULATOR=True (ZeRO-2) needs each replica's whole gradients, but {blocker}: MaxText "
          f"reduces the gradient of a parameter split over 'data' in every micro-batch; set "
          f"SHARD_ACCUMULATOR=False (Zero-1 alone); {describe_mesh(mesh)}"
      )
    return Zero1Optimizer(model, tx, mesh, wrt=nnx.Param, options=self._zero1_options())

  def _zero1_gradient_targets(self) -> Any:
    """The Zero-1 layout of every parameter, as a tree shaped like MaxText's parameter shardings."""
    structure = jax.tree.structure(_compat.unreduced_grad_shardings(self))
    return jax.tree.unflatten(structure, self.optimizer.zero1_plan.zero1_param_shardings)

  def _deferred(self) -> bool:
    """Whether the last compile kept the gradients ``unreduced`` (MaxText's deferral)."""
    return _compat.unreduced_grad_shardings(self) is not None

  def _accumulator_shardings(self, deferred: Any) -> Any:
    """Where MaxText's kernels take and return the accumulator: MaxText's ``unreduced``
    shardings, or (ZeRO-2) the Zero-1 layout, so it crosses every kernel boundary at 1/N."""
    if deferred is None or not self.SHARD_ACCUMULATOR:
      return deferred
    return self._zero1_gradient_targets()

  def _compile_for_batch(self, dynamic_batch: Any, static_batch: dict[str, Any]) -> None:
    super()._compile_for_batch(dynamic_batch, static_batch)
    if self._deferred():
      # Deferred: the update kernel reduce-scatters the gradients onto the Zero-1 layout
      # (below), where MaxText's own reshard to ``_plain_grad_shardings`` then finds them.
      # A mid-accumulation checkpoint reduces onto the same layout.
      _compat.set_plain_grad_shardings(self, self._zero1_gradient_targets())

  def _fwd_bwd_kernel(self, params, rest, batch, acc_grads=None, acc_denom=None):
    if not self.SHARD_ACCUMULATOR:
      return super()._fwd_bwd_kernel(params, rest, batch, acc_grads, acc_denom)
    if not self._deferred():
      # Refused at construction where MaxText would not defer; this is the uncompiled path.
      _, mesh = _compat.engine_model_and_mesh(self)
      raise Zero1Error(
          "SHARD_ACCUMULATOR=True (ZeRO-2) runs in MaxText's compiled kernels only (its uncompiled "
          f"fwd_bwd keeps no unreduced gradients): call engine.compile(batch) first; {describe_mesh(mesh)}"
      )
    # MaxText's kernel without an accumulator: this micro-batch's unreduced gradients, nothing summed.
    loss, aux, new_rest, grads, denominator = super()._fwd_bwd_kernel(params, rest, batch)
    acc_grads = reduce_unreduced(grads, _compat.plain_grad_shardings(self), into=acc_grads)
    if acc_denom is not None:
      denominator = acc_denom + denominator
    return loss, aux, new_rest, acc_grads, denominator

  def _update_kernel(self, state_pure, accumulated_grads, accumulated_denominator, mean_loss):
    # ZeRO-2's accumulator is reduced already, on the layout MaxText's reshard then finds it on.
    if self._deferred() and not self.SHARD_ACCUMULATOR and accumulated_grads is not None:
      accumulated_grads = reduce_unreduced(accumulated_grads, _compat.plain_grad_shardings(self))
    return super()._update_kernel(state_pure, accumulated_grads, accumulated_denominator, mean_loss)


_compat.route_accumulator_shardings(
    Zero1MaxTextTrainingEngine, Zero1MaxTextTrainingEngine._accumulator_shardings
)


class Zero1AbstractMaxTextEngine(Zero1MaxTextTrainingEngine, _maxtext_engine_compile.AbstractMaxTextEngine):
  """MaxText's ahead-of-time engine (``AbstractMaxTextEngine``) with Zero-1 from this plugin.

  Same constructor ``(training_config, mesh)``; ``compile_kernels(batch)`` compiles
  ``Zero1MaxTextTrainingEngine``'s kernels for ``mesh`` (a topology this host need
  not have), so ``memory_analysis()`` gives what they need per chip. Nothing runs.

  Example::

    mesh = maxtext.trainers.pre_train.train_compile.get_topology_mesh(config)  # e.g. compile_topology=v6e-4
    engine = Zero1AbstractMaxTextEngine(config, mesh)
    compiled = engine.compile_kernels(maxtext_engine_compile.get_shaped_micro_batch(config))
  """

  def _build_optimizer(self, tx: Any) -> Any:
    # MaxText's: installs the traced train state (``_trace_train_state``, below) and returns its optimizer.
    return _maxtext_engine_compile.AbstractMaxTextEngine._build_optimizer(self, tx)

  def _trace_train_state(self, tx: Any) -> Any:
    # MaxText traces ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` twice: ``nnx.eval_shape`` for the
    # module graph and ``jax.eval_shape`` under an all-Explicit stand-in mesh for the state. Inside
    # ``zero1_optimizers`` both build a ``Zero1Optimizer``: the state (moments on the Zero-1 layout)
    # comes from the second trace, the graph -- and so ``zero1_plan`` -- from the first, whose plan
    # reads the parameters' layouts off their traced types and, on axes the types do not carry, off
    # their Variables' sharding metadata. That the two agree is checked here.
    with options_scope(self._mesh, self._zero1_options()):
      state = super()._trace_train_state(tx)
    optimizer = state.optimizer
    if not isinstance(optimizer, Zero1Optimizer):
      raise Zero1Error(
          f"Zero1AbstractMaxTextEngine: MaxText's _trace_train_state built a {type(optimizer).__name__}, "
          "not an nnx.Optimizer that zero1_optimizers could route to Zero1Optimizer; use the maxtext version "
          "docs/maxtext.md names, or report it as a bug of nnx-zero1 with this message."
      )
    plan = optimizer.zero1_plan
    traced_state = nnx.as_pure(nnx.state(optimizer.opt_state))
    # Equal layouts, not equal specs: under shard_mode=auto the plan names the parameters' size-1 axes
    # (from their metadata) where the stand-in trace's types leave them out.
    leaves = jax.tree.leaves(traced_state)
    named = lambda spec: NamedSharding(self._mesh, spec)  # memory kinds are restated below
    same = [getattr(x, "sharding", None) is None
            or named(x.sharding.spec).is_equivalent_to(named(leaf.sharding.spec), len(x.shape))  # type: ignore[attr-defined]
            for x, leaf in zip(leaves, plan.state_leaves)]
    if len(leaves) != len(plan.state_leaves) or not all(same):
      raise Zero1Error(
          "Zero1AbstractMaxTextEngine: the traced optimizer state is not on the Zero-1 layout of the "
          f"parameters (mesh axes {dict(self._mesh.shape)}); report it as a bug of nnx-zero1 with this "
          "message."
      )
    if self.OFFLOAD_STATE_TO_HOST:
      # MaxText re-homes each traced aval on the real mesh by its spec alone, which drops the
      # host memory kind: restate the state (and offloaded master copies) on the plan's shardings.
      _restate(optimizer.opt_state, [leaf.sharding for leaf in plan.state_leaves])
      if plan.offload_masters:
        _restate(optimizer.master_params, master_shardings(plan))
    return state
