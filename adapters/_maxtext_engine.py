"""``Zero1MaxTextTrainingEngine``: MaxText's own training engine with Zero-1 from this plugin.

Needs Python >= 3.12 and ``maxtext`` (tested: 0.2.5). Import it as
``from nnx_zero1.adapters.maxtext import Zero1MaxTextTrainingEngine``, which
loads this module on first use.

MaxText's ``MaxTextTrainingEngine`` splits a step into ``fwd_bwd(batch)`` per
micro-batch and ``update()``; its kernels read their shardings off the live
arrays, and its optimizer comes from ``_build_optimizer(tx)``. This engine
answers that hook with a ``Zero1Optimizer`` (through ``Zero1EngineMixin``, the
mixin the reference ``Zero1Engine`` uses), so the moments live on the Zero-1
layout from the start and every kernel, checkpoint and metric is MaxText's.
Where MaxText defers the data-parallel gradient all-reduce to ``update`` (pure
data parallelism, ``shard_mode=explicit``), the update kernel reduce-scatters
the deferred gradients straight onto the Zero-1 layout instead.

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
import logging
from typing import Any

import jax
from flax import nnx

from nnx_zero1._src.engine.zero1 import Zero1EngineMixin
from nnx_zero1._src.errors import Zero1Error
from nnx_zero1._src.optimizer import Zero1Optimizer
from nnx_zero1._src.plan import make_plan
from nnx_zero1._src.reduction import reduce_unreduced
from nnx_zero1._src.scope import zero1_optimizers

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


class Zero1MaxTextTrainingEngine(Zero1EngineMixin, _maxtext_engine.MaxTextTrainingEngine):
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

  Raises:
    Zero1Error: the engine is MaxText's ahead-of-time ``AbstractMaxTextEngine``
      (use ``Zero1AbstractMaxTextEngine``), or the optimizer cannot be made Zero-1.

  Example::

    config = pyconfig.initialize([..., "shard_mode=explicit", "ici_data_parallelism=4"])
    engine = Zero1MaxTextTrainingEngine(config, mesh=mesh)
    engine.compile(batch)
    for micro_batch in micro_batches:
      engine.fwd_bwd(micro_batch)
    step = engine.update()
  """

  @functools.wraps(_maxtext_engine.MaxTextTrainingEngine.__init__)  # type: ignore[misc]  # shows MaxText's signature
  def __init__(self, training_config, *args, **kwargs):
    if isinstance(self, _maxtext_engine_compile.AbstractMaxTextEngine) and not isinstance(
        self, Zero1AbstractMaxTextEngine):
      raise Zero1Error(
          "Zero1MaxTextTrainingEngine does not cover maxtext_engine_compile.AbstractMaxTextEngine (the "
          "ahead-of-time engine): it traces nnx.Optimizer in _trace_train_state, not _build_optimizer. "
          "Use nnx_zero1.adapters.maxtext.Zero1AbstractMaxTextEngine."
      )
    super().__init__(_config_for_maxtext(training_config), *args, **kwargs)

  def _build_optimizer(self, tx: Any) -> Zero1Optimizer:
    model, mesh = _compat.engine_model_and_mesh(self)
    return Zero1Optimizer(model, tx, mesh, wrt=nnx.Param, data_axis="data")

  def _zero1_gradient_targets(self) -> Any:
    """The Zero-1 layout of every parameter, as a tree shaped like MaxText's parameter shardings."""
    structure = jax.tree.structure(_compat.unreduced_grad_shardings(self))
    return jax.tree.unflatten(structure, self.optimizer.zero1_plan.zero1_param_shardings)

  def _compile_for_batch(self, dynamic_batch: Any, static_batch: dict[str, Any]) -> None:
    super()._compile_for_batch(dynamic_batch, static_batch)
    if _compat.unreduced_grad_shardings(self) is not None:
      # Deferred: the update kernel reduce-scatters the gradients onto the Zero-1 layout
      # (below), where MaxText's own reshard to ``_plain_grad_shardings`` then finds them.
      # A mid-accumulation checkpoint reduces onto the same layout.
      _compat.set_plain_grad_shardings(self, self._zero1_gradient_targets())

  def _update_kernel(self, state_pure, accumulated_grads, accumulated_denominator, mean_loss):
    if _compat.unreduced_grad_shardings(self) is not None and accumulated_grads is not None:
      accumulated_grads = reduce_unreduced(accumulated_grads, _compat.plain_grad_shardings(self))
    return super()._update_kernel(state_pure, accumulated_grads, accumulated_denominator, mean_loss)


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
    # module graph (its avals carry no shardings) and ``jax.eval_shape`` on the sharded avals for the
    # state. Inside ``zero1_optimizers`` both build a ``Zero1Optimizer``: the state (moments on the
    # Zero-1 layout) comes from the second trace, the graph -- and so ``zero1_plan`` -- from the first,
    # where every parameter looked replicated. The plan is therefore rebuilt from the parameters'
    # real layouts (with tensor or FSDP axes the first trace's plan would drop them).
    with zero1_optimizers(mesh=self._mesh, data_axis="data"):
      state = super()._trace_train_state(tx)
    optimizer = state.optimizer
    if not isinstance(optimizer, Zero1Optimizer):
      raise Zero1Error(
          f"Zero1AbstractMaxTextEngine: MaxText's _trace_train_state built a {type(optimizer).__name__}, "
          "not an nnx.Optimizer that zero1_optimizers could route to Zero1Optimizer."
      )
    params = nnx.as_pure(nnx.state(state.model, nnx.Param))
    plan = make_plan(optimizer.tx, params, self._mesh, optimizer.zero1_plan.data_axis)
    traced_state = nnx.as_pure(nnx.state(optimizer.opt_state))
    traced = [getattr(x, "sharding", None) for x in jax.tree.leaves(traced_state)]
    planned = [row.sharding for row in plan.state_leaves]
    if len(traced) != len(planned) or any(
        t is not None and t.spec != p.spec for t, p in zip(traced, planned)):
      raise Zero1Error(
          "Zero1AbstractMaxTextEngine: the traced optimizer state is not on the Zero-1 layout of the "
          f"parameters (mesh axes {dict(self._mesh.shape)})."
      )
    optimizer.zero1_plan = plan
    return state
