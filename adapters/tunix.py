"""Zero-1 for Tunix: ``Zero1PeftTrainer`` is ``tunix.sft.peft_trainer.PeftTrainer`` with its
optimizer state split over the data-parallel mesh axis.

Change the class name and nothing else: same constructor, same training loop,
same checkpoints on disk (they cross both ways with ``PeftTrainer``).
"""

import dataclasses
import inspect
from typing import Any

from tunix.sft.peft_trainer import PeftTrainer, TrainingConfig

from nnx_zero1.mixin import ShardedOptimizerMixin
from nnx_zero1.specs import DataAxis

__all__ = ["Zero1PeftTrainer", "Zero1TrainingConfig"]


@dataclasses.dataclass(slots=True, kw_only=True)
class Zero1TrainingConfig(TrainingConfig):
  """Tunix's ``TrainingConfig`` plus the Zero-1 options; ``None`` keeps the trainer's class default.

  Example::

    >>> from nnx_zero1.adapters.tunix import Zero1TrainingConfig
    >>> config = Zero1TrainingConfig(eval_every_n_steps=10, zero1_data_axis=("replica", "data"))
    >>> config.zero1_data_axis, config.zero1_strict
    (('replica', 'data'), None)
  """

  zero1_data_axis: DataAxis | None = None
  zero1_strict: bool | None = None


class Zero1PeftTrainer(ShardedOptimizerMixin, PeftTrainer):
  """``PeftTrainer`` whose optimizer is a ``Zero1Optimizer``; same constructor, loop and checkpoints.

  Build it under the mesh, as Tunix expects (``with mesh:``). The optimizer
  PeftTrainer builds in ``__init__`` (``wrt=nnx.LoRAParam`` for LoRA models,
  wrapped in ``optax.MultiSteps`` under ``gradient_accumulation_steps``) is
  created directly on the Zero-1 layout, and the layout is recorded in the
  state's variable metadata, so PeftTrainer's checkpoint restore and its
  ``_shard_optimizer`` keep it. Parameters keep their own layout.

  The data axis is ``zero1_data_axis`` (``"data"``); set it on a subclass, or
  use a :class:`Zero1TrainingConfig`. A mesh without that axis, or no mesh,
  is a ``Zero1Error`` at construction.

  Example::

    >>> import jax, optax
    >>> from flax import nnx
    >>> from nnx_zero1.adapters.tunix import Zero1PeftTrainer, Zero1TrainingConfig
    >>> mesh = jax.sharding.Mesh(jax.devices()[:1], ("data",))
    >>> model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    >>> with mesh:
    ...   trainer = Zero1PeftTrainer(model, optax.adamw(1e-3), Zero1TrainingConfig(eval_every_n_steps=1))
    >>> type(trainer.optimizer).__name__
    'Zero1Optimizer'
  """

  def zero1_options(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """The class defaults, overridden by a :class:`Zero1TrainingConfig`'s non-``None`` fields.

    Example::

      >>> import inspect
      >>> from tunix.sft.peft_trainer import PeftTrainer
      >>> inspect.signature(Zero1PeftTrainer) == inspect.signature(PeftTrainer)
      True
    """
    config = inspect.signature(PeftTrainer).bind(*args, **kwargs).arguments["training_config"]
    options = super().zero1_options(*args, **kwargs)
    for key in options:
      value = getattr(config, f"zero1_{key}", None)
      if value is not None:
        options[key] = value
    return options
