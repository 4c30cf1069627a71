"""MaxText and Tunix stand-ins, and every private MaxText name the adapters touch.

Two jobs, both for ``Zero1MaxTextTrainingEngine``:

- the four Tunix types ``maxtext`` 0.2.5 imports that google-tunix 0.1.7 lacks.
  MaxText's ``training_engine/abstract_engine.py`` imports ``LossOutput`` and
  ``WeightedMetric`` from ``tunix.sft.utils`` and ``TrainerPayload`` and
  ``RLTrainerPayload`` from ``tunix.experimental.common.datatypes``. Tunix's
  source tree has them; google-tunix 0.1.7, the newest release on PyPI, does
  not. ``ensure_tunix_types()`` supplies minimal versions written here (the
  fields MaxText's engine reads, nothing else) only where the installed Tunix has
  none, so a Tunix release that ships them is used as it is.
- MaxText's private names (a config's pydantic model, the engine's model, mesh
  and gradient shardings), each read or written by one small function here, so a MaxText
  release that renames one breaks one function, which ``tests/core/test_compat.py``
  names.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

__all__ = [
    "engine_model_and_mesh",
    "ensure_tunix_types",
    "maxtext_defers_reduction",
    "maxtext_reduction_not_deferred",
    "maxtext_zero1_requested",
    "plain_grad_shardings",
    "route_accumulator_shardings",
    "set_plain_grad_shardings",
    "unreduced_grad_shardings",
    "without_maxtext_zero1",
]

logger = logging.getLogger(__name__)


def engine_model_and_mesh(engine: Any) -> tuple[Any, Any]:
  """The model and mesh a MaxText ``MaxTextTrainingEngine`` holds when it calls ``_build_optimizer``.

  Raises:
    AttributeError: naming the installed maxtext version, when it keeps them elsewhere.

  Example::

    >>> class Stub:
    ...   _model, _mesh = "model", "mesh"
    >>> engine_model_and_mesh(Stub())
    ('model', 'mesh')
  """
  try:
    return engine._model, engine._mesh
  except AttributeError as e:
    version = getattr(sys.modules.get("maxtext"), "__version__", "unknown")
    raise AttributeError(
        f"nnx-zero1 reads MaxTextTrainingEngine._model and ._mesh in _build_optimizer; maxtext "
        f"{version} has no such attribute ({e}); tested with maxtext 0.2.5"
    ) from e


@flax.struct.dataclass
class WeightedMetric:
  """A sum and the weight it is divided by, kept apart so micro-batches add up exactly."""

  unreduced_sum: jax.Array
  denominator: jax.Array
  eps: float | None = flax.struct.field(default=None, pytree_node=False)
  min_denom: float | None = flax.struct.field(default=None, pytree_node=False)

  def compute_scale(self) -> jax.Array:
    """``1 / denominator`` (after ``eps`` and ``min_denom``); 0 where the denominator is 0."""
    denom = self.denominator
    if self.eps is not None:
      denom = denom + self.eps
    if self.min_denom is not None:
      denom = jnp.maximum(denom, self.min_denom)
    zero = denom == 0
    return jnp.where(zero, 0.0, 1.0 / jnp.where(zero, 1.0, denom))

  def compute(self) -> jax.Array:
    """The weighted mean."""
    return self.unreduced_sum * self.compute_scale()


@flax.struct.dataclass
class LossOutput:
  """A loss function's result: the loss to differentiate and auxiliary metrics."""

  primary_loss: WeightedMetric
  aux_metrics: dict[str, WeightedMetric]


@dataclasses.dataclass(kw_only=True)
class TrainerPayload:
  """Base of the batches a trainer worker hands an engine."""


@dataclasses.dataclass(kw_only=True)
class RLTrainerPayload(TrainerPayload):
  """An RL batch split into prompt and completion, with per-row advantages."""

  advantages: Any = None
  prompt_ids: Any = None
  prompt_mask: Any = None
  completion_ids: Any = None
  completion_mask: Any = None
  segment_ids: Any = None
  segment_positions: Any = None
  ref_per_token_logps: Any = None
  old_per_token_logps: Any = None
  sampler_is_weights: Any = None
  routed_experts: Any = None
  metadata: dict = dataclasses.field(default_factory=dict)


def _has(module: str, *names: str) -> bool:
  try:
    found = importlib.import_module(module)
  except ImportError:
    return False
  return all(hasattr(found, name) for name in names)


def _register(name: str) -> types.ModuleType:
  """The module ``name``, made (empty, attached to its parent) where it does not import."""
  try:
    return importlib.import_module(name)
  except ImportError:
    module = types.ModuleType(name, "nnx_zero1 compatibility stand-in (see nnx_zero1/adapters/_compat.py)")
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent:
      setattr(_register(parent), child, module)
    return module


def ensure_tunix_types() -> bool:
  """Makes ``tunix.sft.utils`` and ``tunix.experimental.common.datatypes`` importable
  with the types MaxText's engine imports; returns True when a stand-in was needed.

  Needs Tunix itself installed; changes nothing when it already has the types.

  Example::

    >>> from nnx_zero1.adapters._compat import ensure_tunix_types
    >>> _ = ensure_tunix_types()
    >>> from tunix.sft.utils import LossOutput, WeightedMetric
  """
  needed = False
  for module, types_ in (
      ("tunix.sft.utils", (WeightedMetric, LossOutput)),
      ("tunix.experimental.common.datatypes", (TrainerPayload, RLTrainerPayload)),
  ):
    if _has(module, *(t.__name__ for t in types_)):
      continue
    target = _register(module)
    for t in types_:
      if not hasattr(target, t.__name__):
        setattr(target, t.__name__, t)
    needed = True
  if needed:
    logger.info("nnx_zero1: supplied Tunix types MaxText imports and this Tunix lacks (temporary shim)")
  return needed


_MAXTEXT_ZERO1_FLAG = "shard_optimizer_over_data"


def maxtext_zero1_requested(config: Any) -> bool:
  """Whether a MaxText config asks for MaxText's own Zero-1 (``shard_optimizer_over_data``).

  Args:
    config: a MaxText ``pyconfig.HyperParameters`` (or anything with the attribute).

  Returns:
    The flag's value; False where the config has no such field.

  Example::

    >>> import types
    >>> maxtext_zero1_requested(types.SimpleNamespace(shard_optimizer_over_data=True))
    True
  """
  return bool(getattr(config, _MAXTEXT_ZERO1_FLAG, False))


def without_maxtext_zero1(config: Any) -> Any:
  """A copy of a MaxText config with ``shard_optimizer_over_data`` off, every other field equal.

  MaxText's engine reads the flag wherever it decides on its own Zero-1; handing it
  this copy turns all of those off at once, without re-running MaxText's config
  validation (which the original already passed).

  Args:
    config: a MaxText ``pyconfig.HyperParameters``.

  Returns:
    A new ``HyperParameters``; ``config`` itself is unchanged (it is read-only).

  Example::

    config = without_maxtext_zero1(pyconfig.initialize([..., "shard_optimizer_over_data=true"]))
    assert config.shard_optimizer_over_data is False
  """
  hyper_parameters = type(config)
  pydantic_config = object.__getattribute__(config, "_pydantic_config")
  return hyper_parameters(pydantic_config.model_copy(update={_MAXTEXT_ZERO1_FLAG: False}))


_UNREDUCED_GRAD_SHARDINGS = "_unreduced_grad_shardings"


def maxtext_defers_reduction(config: Any, mesh: Any) -> bool:
  """Whether MaxText's engine keeps the data-parallel gradients ``unreduced`` (its all-reduce
  deferred to ``update``) for this config and mesh: MaxText's own decision, asked before any engine exists.

  Its rule depends on the config and the mesh only (the parameter tree is merely
  mapped over), so it is asked with an empty one.

  Example::

    if not maxtext_defers_reduction(config, mesh):
      ...  # every micro-batch all-reduces its gradients
  """
  from maxtext.training_engine import maxtext_engine

  reduced, _ = maxtext_engine._deferred_all_reduce_shardings(config, mesh, {})
  return reduced is not None


@contextlib.contextmanager
def maxtext_reduction_not_deferred() -> Iterator[None]:
  """MaxText's engines built inside reduce their data-parallel gradients in every micro-batch, as MaxText's
  engine did before it deferred that all-reduce to ``update`` (its ``_deferred_all_reduce_shardings`` made
  to answer "not deferred" for the block's length).

  Example::

    with maxtext_reduction_not_deferred():
      kernels = engine_class(config, mesh).compile_kernels(batch)  # fwd_bwd all-reduces its gradients
  """
  from maxtext.training_engine import maxtext_engine

  own = maxtext_engine._deferred_all_reduce_shardings
  maxtext_engine._deferred_all_reduce_shardings = lambda config, mesh, params_shardings: (None, None)
  try:
    yield
  finally:
    maxtext_engine._deferred_all_reduce_shardings = own


def unreduced_grad_shardings(engine: Any) -> Any:
  """The shardings MaxText's engine keeps deferred (``unreduced`` over data) gradients on,
  or None where it reduces them in every micro-batch; set by ``_compile_for_batch``.

  MaxText's own value, also where :func:`route_accumulator_shardings` changes what
  the engine's kernels read.

  Raises:
    KeyError: the installed maxtext keeps them elsewhere.

  Example::

    deferred = unreduced_grad_shardings(engine) is not None
  """
  return vars(engine)[_UNREDUCED_GRAD_SHARDINGS]


def route_accumulator_shardings(cls: type, layout: Callable[[Any, Any], Any]) -> None:
  """Makes MaxText's kernels take the gradient accumulator on ``layout(engine, deferred)``.

  ``_compile_for_batch`` writes the deferred gradients' shardings to
  ``_unreduced_grad_shardings`` and reads them back, in the same call, as the
  accumulator's in/out shardings of every kernel (and ``restore_checkpoint``
  reads them to place a restored accumulator). A property on ``cls`` is the
  one seam between that write and those reads, so the method is not copied.
  MaxText's own value stays where it wrote it (:func:`unreduced_grad_shardings`).

  Args:
    cls: a ``MaxTextTrainingEngine`` subclass.
    layout: ``(engine, MaxText's shardings or None) -> the shardings the kernels use``.

  Example::

    route_accumulator_shardings(MyEngine, lambda engine, deferred: deferred)  # changes nothing
  """

  def read(engine: Any) -> Any:
    return layout(engine, unreduced_grad_shardings(engine))

  def write(engine: Any, value: Any) -> None:
    vars(engine)[_UNREDUCED_GRAD_SHARDINGS] = value

  setattr(cls, _UNREDUCED_GRAD_SHARDINGS, property(read, write, doc=route_accumulator_shardings.__doc__))


def plain_grad_shardings(engine: Any) -> Any:
  """Where MaxText's update kernel reshards deferred gradients once reduced (None: not deferred).

  Example::

    target = plain_grad_shardings(engine)
  """
  return engine._plain_grad_shardings


def set_plain_grad_shardings(engine: Any, shardings: Any) -> None:
  """Points MaxText's reshard of the reduced gradients (and a mid-step checkpoint's) at ``shardings``.

  Example::

    set_plain_grad_shardings(engine, zero1_targets)
  """
  engine._plain_grad_shardings = shardings
