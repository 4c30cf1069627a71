"""The two Tunix settings that are silent no-ops on a data-parallel mesh, refused by every Zero-1 Tunix class.

Tunix's defaults, ``data_sharding_axis=("fsdp",)`` and its models' ``ShardingConfig`` (activations'
batch over ``fsdp``), are right on Tunix's own ``("fsdp", "tp")`` mesh. On a mesh with a ``data`` axis
the Tunix classes build and train with them, on a CPU without a sign: each data replica trains on the
whole batch (and Zero-1 splits the state over an axis of size 1), or on chips computes its ``fsdp``
group's whole batch. Each Zero-1 class refuses both before it builds anything, with the fix in the
message; Tunix's own mesh and defaults, and the fixed settings, build as before. Tunix's real
``Llama3`` and ``Qwen3`` classes (tiny configurations, LoRA through qwix) on Tunix-style Auto meshes;
nothing is trained here.
"""

import optax
import pytest
import qwix
from flax import nnx
from tunix.distillation import distillation_trainer, strategies
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.sft.dpo import dpo_trainer

from nnx_zero1 import Zero1Error, Zero1Optimizer
from nnx_zero1.adapters import tunix as zero1_tunix
from tests.support.helpers import assert_trees_equal, pure, shardings
from tests.support.tunix_toys import (
  data_parallel,
  grpo_cluster_config,
  llama3,
  peft_trainer,
  place,
  qwen3,
  test_common,
  tunix_mesh,
)

NAMES = ("data", "fsdp", "tp")
DATA8 = tunix_mesh((8, 1, 1), NAMES)  # data-parallel 8, as docs/tunix.md's diff
DATA4_FSDP2 = tunix_mesh((4, 2, 1), NAMES)
TUNIX_FSDP = tunix_mesh((8, 1), ("fsdp", "tp"))  # Tunix's own mesh: the class name is the whole change
BOTH = (("data", "fsdp"),)
SMALL = dict(num_layers=1, vocab_size=64, embed_dim=32, hidden_dim=64, num_heads=2, head_dim=16,
             num_kv_heads=1, rope_theta=10_000, norm_eps=1e-6)
KINDS = ("peft", "dpo", "distillation", "rl")


def tunix_model(mesh, *, family=llama3, fixed: bool = False, lora: bool = False) -> nnx.Module:
  """Tunix's class with Tunix's default ``ShardingConfig`` (``fixed``: its batch over data and fsdp)."""
  config = family.ModelConfig(**SMALL)
  config = data_parallel(config) if fixed else config
  model_class = llama3.Llama3 if family is llama3 else qwen3.Qwen3
  with nnx.use_eager_sharding(False):
    model = model_class(config, rngs=nnx.Rngs(0))
    if lora:
      provider = qwix.LoraProvider(module_path=".*q_proj|.*v_proj", rank=4, alpha=2.0)
      model = qwix.apply_lora_to_model(model, provider, **model.get_model_input(), rngs=nnx.Rngs(1))
  return place(model, mesh)


def build(kind: str, mesh, model, ckpt=None, **config):
  """The Zero-1 class of ``kind`` with Tunix's own config (``config``: its fields), under ``mesh``."""
  tx = optax.adamw(1e-3)
  root = None if ckpt is None else str(ckpt)
  with mesh:
    if kind == "peft":
      training = peft_trainer.TrainingConfig(eval_every_n_steps=10, checkpoint_root_directory=root, **config)
      return zero1_tunix.Zero1PeftTrainer(model, tx, training)
    if kind == "dpo":
      training = dpo_trainer.DPOTrainingConfig(eval_every_n_steps=10, algorithm="orpo",
                                               checkpoint_root_directory=root, **config)
      return zero1_tunix.Zero1DPOTrainer(model, None, tx, training)  # ORPO: the same class, no reference
    if kind == "distillation":
      logits = lambda model, **x: model(x["input_tokens"], x["positions"], None, x["attention_mask"])[0]
      strategy = strategies.LogitStrategy(student_forward_fn=logits, teacher_forward_fn=logits,
                                          labels_fn=lambda **x: x["input_tokens"])
      training = distillation_trainer.TrainingConfig(eval_every_n_steps=10, checkpoint_root_directory=root,
                                                     **config)
      return zero1_tunix.Zero1DistillationTrainer(model, model, strategy, tx, training)
    roles = (rl_cluster_lib.Role.ACTOR, rl_cluster_lib.Role.REFERENCE, rl_cluster_lib.Role.ROLLOUT)
    cluster_config = grpo_cluster_config(mesh, roles, checkpoint_root_directory=root, **config)
    return zero1_tunix.Zero1RLCluster(actor=model, reference=model, tokenizer=test_common.MockVocab(),
                                      cluster_config=cluster_config)


def optimizer_of(built) -> Zero1Optimizer:
  return built.actor_trainer.optimizer if isinstance(built, rl_cluster_lib.RLCluster) else built.optimizer


def assert_refused(kind, mesh, model, tmp_path, match, **config):
  before, placed = pure(model), shardings(model)
  with pytest.raises(Zero1Error, match=match) as raised:
    build(kind, mesh, model, tmp_path / "ckpt", **config)
  assert_trees_equal(model, before)  # nothing changed: the values, where they live, no checkpoint
  assert shardings(model) == placed
  assert not (tmp_path / "ckpt").exists()
  return str(raised.value)


@pytest.mark.parametrize("kind", KINDS)
def test_tunix_default_data_sharding_axis_on_a_data_mesh_is_refused(kind, tmp_path):
  """``data_sharding_axis`` left at Tunix's ``("fsdp",)`` on data 8: the message gives the setting."""
  model = tunix_model(DATA8, fixed=True)
  message = assert_refused(kind, DATA8, model, tmp_path, r"data_sharding_axis=\('fsdp',\) does not split")
  assert "axis 'data' (size 8) of the mesh axes ('data', 'fsdp', 'tp') (shape {'data': 8, " in message
  assert message.endswith("set data_sharding_axis=(('data', 'fsdp'),)")


def test_on_data_x_fsdp_the_batch_over_either_axis_alone_is_refused_and_over_both_builds(tmp_path):
  model = tunix_model(DATA4_FSDP2, fixed=True)
  assert_refused("peft", DATA4_FSDP2, model, tmp_path, r"axis 'data' \(size 4\)",
                 data_sharding_axis=("fsdp",))
  message = assert_refused("peft", DATA4_FSDP2, model, tmp_path, r"axis 'fsdp' \(size 2\)",
                           data_sharding_axis=("data",))
  assert message.endswith("set data_sharding_axis=(('data', 'fsdp'),)")
  trainer = build("peft", DATA4_FSDP2, model, data_sharding_axis=BOTH)
  assert optimizer_of(trainer).data_axis == ("data", "fsdp")


@pytest.mark.parametrize("kind", KINDS)
def test_tunix_default_sharding_config_on_a_data_mesh_is_refused(kind, tmp_path):
  """The batch over ``("data", "fsdp")`` but the model's activations over ``fsdp`` only."""
  model = tunix_model(DATA8)
  message = assert_refused(kind, DATA8, model, tmp_path, r"Llama3's ShardingConfig puts the activations' "
                           r"batch over 'fsdp' \(act_btd=\('fsdp', None, 'tp'\)\), without 'data'",
                           data_sharding_axis=BOTH)
  assert "act_btd=(('data', 'fsdp'), *shd.act_btd[1:])" in message


def test_a_lora_wrapped_qwen3_with_the_default_sharding_config_is_refused(tmp_path):
  model = tunix_model(DATA8, family=qwen3, lora=True)
  assert_refused("peft", DATA8, model, tmp_path, "Qwen3's ShardingConfig .* without 'data'",
                 data_sharding_axis=("data",))


def test_a_model_built_outside_the_mesh_context_is_checked_on_its_parameters_mesh(tmp_path):
  model = tunix_model(DATA8)
  before = pure(model)
  config = peft_trainer.TrainingConfig(eval_every_n_steps=10, data_sharding_axis=BOTH)
  with pytest.raises(Zero1Error, match="ShardingConfig"):
    zero1_tunix.Zero1PeftTrainer(model, optax.adamw(1e-3), config)
  assert_trees_equal(model, before)


@pytest.mark.parametrize("kind", KINDS)
def test_the_fixed_settings_on_a_data_mesh_build(kind):
  trainer = build(kind, DATA8, tunix_model(DATA8, fixed=True), data_sharding_axis=BOTH)
  assert optimizer_of(trainer).data_axis == ("data", "fsdp")


@pytest.mark.parametrize("kind", KINDS)
def test_tunix_defaults_on_tunix_fsdp_mesh_build_unchanged(kind):
  """Tunix's own mesh, config and model defaults: the class name is the whole change."""
  trainer = build(kind, TUNIX_FSDP, tunix_model(TUNIX_FSDP))
  assert optimizer_of(trainer).data_axis == ("fsdp",)
