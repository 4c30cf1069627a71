"""Zero-1 for Tunix: every Tunix trainer, with its optimizer state split over the data axes.

Change the class name: same constructor, same training loop, same checkpoints on
disk (they cross both ways with the Tunix class, unless ``zero1_state_dtype`` or
``zero1_master_dtype`` changes what is saved). That is the whole change on Tunix's own
``("fsdp", "tp")`` mesh. On a mesh with a ``data`` axis, Tunix's ``data_sharding_axis`` and
the model's ``ShardingConfig`` must name it too (Tunix's defaults name ``fsdp`` only, and
would train without splitting the batch over ``data``): each class refuses them with a
``Zero1Error`` that gives the setting. docs/tunix.md shows the whole change.

=========================  ===============================================
Tunix 0.1.7                nnx_zero1.adapters.tunix
=========================  ===============================================
``PeftTrainer``            ``Zero1PeftTrainer`` (SFT: full and LoRA)
``DPOTrainer``             ``Zero1DPOTrainer``
``ORPOTrainer``            ``Zero1ORPOTrainer`` (as in Tunix, the DPO class)
``DistillationTrainer``    ``Zero1DistillationTrainer``
``RLCluster``              ``Zero1RLCluster`` (GRPO, DAPO, Dr.GRPO, PPO)
=========================  ===============================================

Each is the Tunix class run inside :func:`nnx_zero1.zero1_optimizers`, so the
``nnx.Optimizer`` it builds is a ``Zero1Optimizer``. Defaults follow Tunix:

- the data axes are the axes Tunix splits the batch over,
  ``training_config.data_sharding_axis`` (Tunix's default ``("fsdp",)``);
  a :class:`Zero1TrainingConfig` or a ``zero1_data_axis`` class attribute
  overrides them;
- the mesh is the current one (``jax.set_mesh`` or Tunix's ``with mesh:``), else
  the mesh the model's parameters live on; a model on one device with no mesh
  is data-parallel size 1 (trains exactly as the Tunix class; ``zero1_strict``
  refuses it).

On an FSDP mesh, leaves FSDP already splits over the data axis keep their
layout; Zero-1 splits what FSDP leaves whole (norms, biases, LoRA factors, the
leaves without an ``fsdp`` entry). ``nnx_zero1.report(trainer.optimizer)``
lists both.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

try:
  from tunix.distillation.distillation_trainer import DistillationTrainer
  from tunix.rl.rl_cluster import RLCluster, RLTrainingConfig, Role
  from tunix.sft.dpo.dpo_trainer import DPOTrainer
  from tunix.sft.peft_trainer import PeftTrainer, TrainingConfig
except ModuleNotFoundError as e:
  if e.name is None or e.name.split(".")[0] != "tunix":
    raise
  # One line that names the fix, not a traceback into Tunix's absence.
  raise ModuleNotFoundError(
      'nnx_zero1.adapters.tunix needs Tunix (tested: google-tunix 0.1.7): pip install "nnx-zero1[tunix]"',
      name=e.name,
  ) from None

from jax.sharding import Mesh

from nnx_zero1._src.errors import Zero1Error
from nnx_zero1._src.mixin import ShardedOptimizerMixin
from nnx_zero1._src.specs import DataAxis, data_axes

from ._tunix_batch import batch_axis_names, batch_mesh, check_trained_batch

__all__ = [
    "Zero1DPOTrainer",
    "Zero1DistillationTrainer",
    "Zero1ORPOTrainer",
    "Zero1PeftTrainer",
    "Zero1RLCluster",
    "Zero1RLTrainingConfig",
    "Zero1TrainingConfig",
    "batch_axes",
]


@dataclasses.dataclass(kw_only=True)
class _Zero1Fields:
  """The Zero-1 options a Tunix config carries, one set for every config class (see
  :class:`Zero1TrainingConfig`)."""

  # No instance dict: each config class's own slots hold these fields, so a misspelt option is refused.
  __slots__ = ()

  zero1_data_axis: DataAxis | None = None
  zero1_strict: bool | None = None
  zero1_pin_gradients: bool | None = None
  zero1_offload_state_to_host: bool | float | None = None
  zero1_state_dtype: Any = None
  zero1_state_rounding: str | None = None
  zero1_master_dtype: Any = None
  zero1_params_across_dtype: Any = None


@dataclasses.dataclass(slots=True, kw_only=True)
class Zero1TrainingConfig(TrainingConfig, _Zero1Fields):
  """Tunix's ``TrainingConfig`` plus the Zero-1 options; ``None`` keeps the trainer's default.

  Pass it wherever a Tunix trainer takes its ``training_config`` (for
  ``Zero1RLCluster``, whose ``cluster_config.training_config`` is an ``RLTrainingConfig``:
  :class:`Zero1RLTrainingConfig`).

  ``zero1_strict``, ``zero1_pin_gradients``, ``zero1_offload_state_to_host`` (``True`` or a
  fraction), ``zero1_state_dtype``, ``zero1_state_rounding``, ``zero1_master_dtype`` and
  ``zero1_params_across_dtype`` are
  ``Zero1Optimizer``'s keyword options of those names; ``None`` keeps the trainer class's
  attribute of the same name (``ShardedOptimizerMixin``'s defaults are ``Zero1Optimizer``'s).

  Attributes:
    zero1_data_axis: the mesh axis (or tuple of axes) to split the optimizer
      state over; ``None``: the axes of ``data_sharding_axis`` (see :func:`batch_axes`).

  Example::

    >>> from nnx_zero1.adapters.tunix import Zero1TrainingConfig
    >>> config = Zero1TrainingConfig(eval_every_n_steps=10, zero1_data_axis=("replica", "data"))
    >>> config.zero1_data_axis, config.zero1_strict
    (('replica', 'data'), None)
  """


@dataclasses.dataclass(slots=True, kw_only=True)
class Zero1RLTrainingConfig(RLTrainingConfig, _Zero1Fields):
  """Tunix's ``RLTrainingConfig`` plus the Zero-1 options of :class:`Zero1TrainingConfig`, by the same names.

  ``Zero1RLCluster`` reads its options from ``cluster_config.training_config``, which
  ``RLCluster`` needs to be an ``RLTrainingConfig`` (``actor_optimizer``, ...): pass this there.
  The actor's and the critic's optimizers both take them.

  Example::

    >>> import jax.numpy as jnp, optax
    >>> from nnx_zero1.adapters.tunix import Zero1RLTrainingConfig
    >>> config = Zero1RLTrainingConfig(actor_optimizer=optax.adamw(1e-6), eval_every_n_steps=10,
    ...                                zero1_state_dtype=jnp.bfloat16)
    >>> config.zero1_state_dtype.__name__, config.zero1_data_axis
    ('bfloat16', None)
  """



def batch_axes(data_sharding_axis: Any) -> tuple[str, ...]:
  """The mesh axes Tunix splits a batch over, from ``TrainingConfig.data_sharding_axis``.

  Tunix shards its inputs with ``PartitionSpec(*data_sharding_axis)``; every
  axis named in any entry splits the batch, so the gradients are reduced over
  it and the optimizer state can be split over it.

  Args:
    data_sharding_axis: Tunix's ``TrainingConfig.data_sharding_axis``: an axis
      name, or a sequence whose entries are axis names, tuples of them, or ``None``.

  Returns:
    The axis names, in order, each once.

  Raises:
    Zero1Error: it names no mesh axis.

  Example::

    >>> batch_axes(("fsdp",)), batch_axes((("data", "fsdp"),)), batch_axes(("data", None))
    (('fsdp',), ('data', 'fsdp'), ('data',))
  """
  names = batch_axis_names(data_sharding_axis)
  if not names:
    raise Zero1Error(
        f"training_config.data_sharding_axis={data_sharding_axis!r} names no mesh axis, so there is "
        "no data axis to split the optimizer state over; set zero1_data_axis"
    )
  return data_axes(names)


# The constructor arguments of Tunix's trainers that are models computing on the training batch.
_MODEL_ARGUMENTS = ("model", "ref_model", "student_model", "teacher_model")


class _Zero1Tunix(ShardedOptimizerMixin):
  """A Tunix class that builds its optimizers inside ``zero1_optimizers``, options from its config."""

  zero1_data_axis: DataAxis | None = None  # None: the config's data_sharding_axis
  zero1_strict: bool = False

  def _tunix_arguments(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
    mro = type(self).__mro__
    tunix_class = mro[mro.index(ShardedOptimizerMixin) + 1]
    return inspect.signature(tunix_class).bind(*args, **kwargs).arguments

  def _training_config(self, *args: Any, **kwargs: Any) -> TrainingConfig:
    return self._tunix_arguments(*args, **kwargs)["training_config"]

  def zero1_options(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """``Zero1TrainingConfig`` fields, else the class attributes, else the config's batch axes.

    Args:
      *args: the Tunix class's constructor arguments.
      **kwargs: the Tunix class's constructor keyword arguments.

    Returns:
      ``Zero1Optimizer``'s keyword options by name, for this construction.

    Raises:
      Zero1Error: the config's ``data_sharding_axis`` names no mesh axis and no
        ``zero1_data_axis`` is set.

    Example::

      >>> import inspect
      >>> from tunix.sft.peft_trainer import PeftTrainer
      >>> inspect.signature(Zero1PeftTrainer) == inspect.signature(PeftTrainer)
      True
    """
    config = self._training_config(*args, **kwargs)
    axis = getattr(config, "zero1_data_axis", None)
    if axis is None:
      axis = self.zero1_data_axis
    if axis is None:
      axis = batch_axes(config.data_sharding_axis)
    options = super().zero1_options(*args, **kwargs)  # the class attributes
    for name in options:
      value = getattr(config, f"zero1_{name}", None)
      options[name] = options[name] if value is None else value
    return {**options, "data_axis": axis}

  def _zero1_meshes(self, *args: Any, **kwargs: Any) -> list:
    """The meshes the optimizers will be built on, each checked for the data axes in Tunix's words."""
    meshes = self._tunix_meshes(*args, **kwargs)
    config = self._training_config(*args, **kwargs)
    axes = data_axes(self.zero1_options(*args, **kwargs)["data_axis"])
    for mesh in meshes:
      missing = [a for a in axes if a not in mesh.axis_names]
      if missing:
        chosen = getattr(config, "zero1_data_axis", None) or self.zero1_data_axis
        if chosen is None:
          source = f"training_config.data_sharding_axis={config.data_sharding_axis!r}"
          fix = "name this mesh's batch axes in data_sharding_axis (Tunix splits the batch over them)"
        else:
          source, fix = f"zero1_data_axis={chosen!r}", "set zero1_data_axis to axes of this mesh"
        raise Zero1Error(
            f"Zero-1 needs data axis {missing[0]!r} but the mesh has axes {tuple(mesh.axis_names)} "
            f"(shape {dict(mesh.shape)}); the data axes come from {source}: give the mesh that axis, or {fix}"
        )
    check_trained_batch(self._trained_models(*args, **kwargs), config.data_sharding_axis)
    return meshes

  def _tunix_meshes(self, *args: Any, **kwargs: Any) -> list:
    return super()._zero1_meshes(*args, **kwargs)  # the current mesh, if any

  def _trained_models(self, *args: Any, **kwargs: Any) -> list[tuple[Mesh, list]]:
    """Each mesh the trainer splits its batch over, with the models that compute on that batch: the
    current mesh, else the one the models' arrays are placed on (none: nothing to check)."""
    arguments = self._tunix_arguments(*args, **kwargs)
    models = [arguments[name] for name in _MODEL_ARGUMENTS if arguments.get(name) is not None]
    mesh = batch_mesh(models)
    return [] if mesh is None else [(mesh, models)]


class Zero1PeftTrainer(_Zero1Tunix, PeftTrainer):
  """``PeftTrainer`` whose optimizer is a ``Zero1Optimizer``; same constructor, loop and checkpoints.

  The optimizer PeftTrainer builds in ``__init__`` (``wrt=nnx.LoRAParam`` for
  LoRA models, wrapped in ``optax.MultiSteps`` under
  ``gradient_accumulation_steps``) is created directly on the Zero-1 layout,
  and the layout is recorded in the state's variable metadata, so PeftTrainer's
  checkpoint restore and its ``_shard_optimizer`` keep it. Parameters keep their
  own layout.

  Args:
    model: the NNX model (full fine-tuning, or LoRA with ``nnx.LoRAParam``).
    optimizer: the optax transformation, as for ``PeftTrainer``.
    training_config: a Tunix ``TrainingConfig`` (or :class:`Zero1TrainingConfig`);
      ``data_sharding_axis`` names the data axes.
    *args: the rest of ``PeftTrainer``'s arguments, unchanged.
    **kwargs: the rest of ``PeftTrainer``'s keyword arguments, unchanged.

  Raises:
    Zero1Error: the current mesh lacks the data axes, or has a ``data``,
      ``replica`` or ``fsdp`` axis of size > 1 that ``data_sharding_axis`` leaves out, or
      a model's ``ShardingConfig`` leaves a batch axis out of its activations'
      batch (all checked before the Tunix constructor runs); the model is on
      several devices with no mesh; or (``zero1_strict``) a leaf cannot be split.

  Example::

    >>> import jax, optax
    >>> from flax import nnx
    >>> from tunix.sft.peft_trainer import TrainingConfig
    >>> from nnx_zero1.adapters.tunix import Zero1PeftTrainer
    >>> mesh = jax.sharding.Mesh(jax.devices()[:1], ("fsdp",))  # Tunix's default data axis
    >>> model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    >>> with mesh:
    ...   trainer = Zero1PeftTrainer(model, optax.adamw(1e-3), TrainingConfig(eval_every_n_steps=1))
    >>> type(trainer.optimizer).__name__, trainer.optimizer.data_axis
    ('Zero1Optimizer', ('fsdp',))
  """


class Zero1DPOTrainer(_Zero1Tunix, DPOTrainer):
  """``DPOTrainer`` (DPO and ORPO) with a ``Zero1Optimizer`` for the policy; same constructor.

  The reference model has no optimizer and is not touched.

  Args:
    *args: ``DPOTrainer``'s arguments (``model``, ``ref_model``, ``optimizer``,
      ``training_config``, ...), unchanged.
    **kwargs: ``DPOTrainer``'s keyword arguments, unchanged.

  Raises:
    Zero1Error: the current mesh lacks the data axes, or has a ``data``,
      ``replica`` or ``fsdp`` axis of size > 1 that ``data_sharding_axis`` leaves out, or
      a model's ``ShardingConfig`` leaves a batch axis out of its activations'
      batch (all checked before the Tunix constructor runs); the model is on
      several devices with no mesh; or (``zero1_strict``) a leaf cannot be split.

  Example::

    >>> import inspect
    >>> from tunix.sft.dpo.dpo_trainer import DPOTrainer
    >>> inspect.signature(Zero1DPOTrainer) == inspect.signature(DPOTrainer)
    True
  """


Zero1ORPOTrainer = Zero1DPOTrainer  # Tunix 0.1.7: ORPOTrainer = DPOTrainer


class Zero1DistillationTrainer(_Zero1Tunix, DistillationTrainer):
  """``DistillationTrainer`` with a ``Zero1Optimizer`` for the student; same constructor.

  The teacher has no optimizer and is not touched.

  Args:
    *args: ``DistillationTrainer``'s arguments (``student_model``,
      ``teacher_model``, ``strategy``, ``optimizer``, ``training_config``, ...), unchanged.
    **kwargs: ``DistillationTrainer``'s keyword arguments, unchanged.

  Raises:
    Zero1Error: the current mesh lacks the data axes, or has a ``data``,
      ``replica`` or ``fsdp`` axis of size > 1 that ``data_sharding_axis`` leaves out, or
      a model's ``ShardingConfig`` leaves a batch axis out of its activations'
      batch (all checked before the Tunix constructor runs); the model is on
      several devices with no mesh; or (``zero1_strict``) a leaf cannot be split.

  Example::

    >>> import inspect
    >>> from tunix.distillation.distillation_trainer import DistillationTrainer
    >>> inspect.signature(Zero1DistillationTrainer) == inspect.signature(DistillationTrainer)
    True
  """


class Zero1RLCluster(_Zero1Tunix, RLCluster):
  """``RLCluster`` whose actor and critic trainers have a ``Zero1Optimizer``; same constructor.

  ``RLCluster.__init__`` builds a Tunix ``rl.trainer.Trainer`` for the actor
  (and, for PPO, the critic) under that role's mesh; both optimizers are built
  on the Zero-1 layout of their own mesh, over the axes of
  ``cluster_config.training_config.data_sharding_axis``. ``GRPOLearner``,
  ``PPOLearner`` and the other learners built on it train with 1/N of the
  optimizer state. Rollout, reference and reward models have no optimizer.

  Args:
    **kwargs: ``RLCluster``'s keyword-only arguments (``actor``, ``critic``,
      ``reference``, ``reward``, ``tokenizer``, ``cluster_config``,
      ``perf_config``), unchanged.

  Raises:
    Zero1Error: the actor's (or critic's) mesh lacks the data axes of
      ``cluster_config.training_config``, or has a ``data``, ``replica`` or ``fsdp``
      axis of size > 1 that its ``data_sharding_axis`` leaves out, or the actor's (or
      critic's) ``ShardingConfig`` leaves a batch axis out of its activations'
      batch (all checked before the Tunix constructor runs); or an optimizer
      cannot be made Zero-1.

  Example::

    >>> import inspect
    >>> from tunix.rl.rl_cluster import RLCluster
    >>> inspect.signature(Zero1RLCluster) == inspect.signature(RLCluster)
    True
  """

  def _training_config(self, *args: Any, **kwargs: Any) -> TrainingConfig:
    return self._tunix_arguments(*args, **kwargs)["cluster_config"].training_config

  def _tunix_meshes(self, *args: Any, **kwargs: Any) -> list:
    arguments = self._tunix_arguments(*args, **kwargs)
    role_to_mesh = arguments["cluster_config"].role_to_mesh
    roles = [Role.ACTOR] + ([Role.CRITIC] if arguments.get("critic") is not None else [])
    return [role_to_mesh[r] for r in roles if r in role_to_mesh and not role_to_mesh[r].empty]

  def _trained_models(self, *args: Any, **kwargs: Any) -> list[tuple[Mesh, list]]:
    arguments = self._tunix_arguments(*args, **kwargs)
    role_to_mesh = arguments["cluster_config"].role_to_mesh
    trained = ((Role.ACTOR, arguments.get("actor")), (Role.CRITIC, arguments.get("critic")))
    return [(role_to_mesh[role], [model]) for role, model in trained
            if model is not None and role in role_to_mesh and not role_to_mesh[role].empty]
