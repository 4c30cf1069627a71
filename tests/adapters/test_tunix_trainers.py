"""Every Tunix trainer, written as Tunix's users and tests write it, with only the class name changed.

Tunix-style meshes (``jax.sharding.Mesh``, Auto axes): ("fsdp", "tp") = (2, 2) and
("data", "fsdp", "tp") = (2, 2, 2). Models are Tunix's ToyTransformer (one layer, LoRA
through qwix where asked), placed on the mesh by their metadata, and trainers are built
outside any mesh context, with Tunix's default ``TrainingConfig`` (batch over "fsdp").
Each fixture trains the Tunix class and the Zero-1 class once, the same way, and the
tests compare them: (a) the swap trains, (b) same parameters, (c) optimizer bytes per
device as the layout rule says, (d) checkpoints cross both ways, (e) one compilation.
"""

import dataclasses
import inspect
import os
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from grain import python as grain
from tunix.distillation import distillation_trainer, strategies
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl import utils as rl_utils
from tunix.rl.grpo import grpo_learner
from tunix.rl.ppo import ppo_learner
from tunix.rl.rollout import base_rollout
from tunix.sft import peft_trainer
from tunix.sft.dpo import dpo_trainer

from nnx_zero1 import Zero1Error, Zero1Optimizer, bytes_per_device, report
from nnx_zero1.adapters import tunix as zero1_tunix
from tests.support.helpers import assert_trees_close, assert_trees_equal, pure, shardings
from tests.support.tunix_toys import (
  cache_size,
  expected_zero1_bytes,
  grpo_cluster_config,
  model_input,
  opt_state,
  place,
  sft_batches,
  test_common,
  toy,
  tunix_mesh,
)

FT = tunix_mesh((2, 2), ("fsdp", "tp"))
DFT = tunix_mesh((2, 2, 2), ("data", "fsdp", "tp"))
Role = rl_cluster_lib.Role
SWAPS = {
    peft_trainer.PeftTrainer: zero1_tunix.Zero1PeftTrainer,
    dpo_trainer.DPOTrainer: zero1_tunix.Zero1DPOTrainer,
    dpo_trainer.ORPOTrainer: zero1_tunix.Zero1ORPOTrainer,
    distillation_trainer.DistillationTrainer: zero1_tunix.Zero1DistillationTrainer,
    rl_cluster_lib.RLCluster: zero1_tunix.Zero1RLCluster,
}


@dataclasses.dataclass
class Pair:
  """The same training run with the Tunix class and with its Zero-1 swap."""

  plain: object  # the trainer (for RL: the actor's or the critic's rl.trainer.Trainer)
  zero1: object
  axes: tuple[str, ...]
  shardings_before: list


def check_pair(pair: Pair, *, steps: int, bit_identical: bool = True) -> float:
  """(a), (b), (c), (e) for one pair; returns the optimizer bytes ratio zero1 / plain."""
  assert type(pair.plain.optimizer) is nnx.Optimizer
  assert isinstance(pair.zero1.optimizer, Zero1Optimizer)
  assert pair.zero1.optimizer.data_axis == pair.axes
  assert pair.zero1.train_steps == pair.plain.train_steps == steps
  if bit_identical:
    assert_trees_equal(pair.zero1.model, pair.plain.model)
    assert_trees_equal(opt_state(pair.zero1), opt_state(pair.plain))
  else:
    assert_trees_close(pair.zero1.model, pair.plain.model, atol=1e-6, rtol=1e-6)
  # Parameters leave with the shardings they came in with. (Trained outside a mesh context,
  # the Tunix class's jit moves some: the embedding comes back P(None, 'fsdp') from P().)
  assert shardings(pair.zero1.model) == pair.shardings_before
  plain_bytes, zero1_bytes = bytes_per_device(opt_state(pair.plain)), bytes_per_device(opt_state(pair.zero1))
  assert zero1_bytes == expected_zero1_bytes(opt_state(pair.plain), pair.axes) < plain_bytes
  assert report(pair.zero1.optimizer).per_device_bytes == zero1_bytes - 4  # `step` is not in the report
  assert cache_size(pair.zero1) == 1  # (the Tunix class compiles twice for LoRA on ("fsdp", "tp"))
  print(f"{type(pair.zero1).__name__}: optimizer bytes/device {plain_bytes:,} -> {zero1_bytes:,} "
        f"({zero1_bytes / plain_bytes:.3f}x); Tunix class compiled {cache_size(pair.plain)}x")
  return zero1_bytes / plain_bytes


def test_every_swap_has_the_tunix_constructor():
  for tunix_class, zero1_class in SWAPS.items():
    assert issubclass(zero1_class, tunix_class)
    assert inspect.signature(zero1_class) == inspect.signature(tunix_class), zero1_class
  assert zero1_tunix.Zero1ORPOTrainer is zero1_tunix.Zero1DPOTrainer  # as ORPOTrainer is DPOTrainer


# -- SFT --------------------------------------------------------------------------------------------


def sft_pair(lora: bool, mesh, *, in_mesh: bool) -> Pair:
  """Tunix's test_compile_once / test_basic_training way: built outside the mesh context."""
  config = peft_trainer.TrainingConfig(eval_every_n_steps=100, max_steps=2)
  trained = []
  for cls in (peft_trainer.PeftTrainer, zero1_tunix.Zero1PeftTrainer):
    model = toy(mesh, lora=lora)
    before = shardings(model)
    trainer = cls(model, optax.adamw(1e-2), config).with_gen_model_input_fn(model_input)
    if in_mesh:
      with mesh:
        trainer.train(sft_batches(2))
    else:
      trainer.train(sft_batches(2))
    trained.append(trainer)
  return Pair(trained[0], trained[1], ("fsdp",), before)


def test_sft_lora_on_fsdp_tp_mesh():
  ratio = check_pair(sft_pair(True, FT, in_mesh=True), steps=2)
  assert ratio < 0.75, ratio  # LoRA factors FSDP leaves whole are split over fsdp


def test_sft_full_trained_outside_any_mesh_context_takes_the_parameters_mesh():
  """Without a mesh context Tunix does not shard the batch and its jit has no shardings, so
  XLA's sharding propagation lays out the step itself (it even moves the Tunix class's
  parameters): results agree to ~1e-8, not bit for bit."""
  pair = sft_pair(False, FT, in_mesh=False)
  assert pair.zero1.optimizer.mesh == FT
  check_pair(pair, steps=2, bit_identical=False)


def test_sft_one_device_no_mesh_is_data_parallel_size_1():
  pair = sft_pair(False, None, in_mesh=False)
  check_one_device(pair)


def check_one_device(pair: Pair):
  assert pair.zero1.optimizer.zero1_plan.single_device
  assert_trees_equal(pair.zero1.model, pair.plain.model)
  assert_trees_equal(opt_state(pair.zero1), opt_state(pair.plain))
  kinds = {type(s).__name__ for s in shardings(pair.zero1.model) + shardings(opt_state(pair.zero1))}
  assert kinds == {"SingleDeviceSharding"}
  text = str(report(pair.zero1.optimizer))
  assert "data-parallel size 1 (one device, no mesh)" in text and "sharded 0 B" in text


def test_one_device_strict_refuses_before_anything_changes(tmp_path):
  model = toy()
  before = pure(model)
  config = zero1_tunix.Zero1TrainingConfig(
      eval_every_n_steps=10, zero1_strict=True, checkpoint_root_directory=str(tmp_path / "ckpt")
  )
  with pytest.raises(Zero1Error, match="one device"):
    zero1_tunix.Zero1PeftTrainer(model, optax.adamw(1e-2), config)
  assert_trees_equal(model, before)
  assert not (tmp_path / "ckpt").exists()


def test_model_spread_over_devices_without_a_mesh_is_refused():
  model = toy()
  model.lm_head.bias.set_value(jax.device_put(model.lm_head.bias[...], jax.devices()[1]))
  before = pure(model)
  with pytest.raises(Zero1Error, match="needs a device mesh"):
    zero1_tunix.Zero1PeftTrainer(model, optax.adamw(1e-2), peft_trainer.TrainingConfig(eval_every_n_steps=1))
  assert_trees_equal(model, before)


# -- DPO / ORPO -----------------------------------------------------------------------------------


def dpo_batches(n: int) -> list:
  rng = np.random.default_rng(1)
  ids = lambda: rng.integers(1, 256, (4, 4)).astype(np.int32)
  ones = np.ones((4, 4), np.int32)
  return [
      dpo_trainer.TrainingInput(
          prompt_ids=ids(), prompt_mask=ones, chosen_ids=ids(), chosen_mask=ones,
          rejected_ids=ids(), rejected_mask=ones,
      )
      for _ in range(n)
  ]


@pytest.mark.parametrize("algorithm", ["dpo", "orpo"])
def test_dpo_and_orpo_on_fsdp_tp_mesh(algorithm):
  config = dpo_trainer.DPOTrainingConfig(eval_every_n_steps=100, max_steps=2, algorithm=algorithm)
  trained = []
  for cls in (dpo_trainer.DPOTrainer, zero1_tunix.Zero1DPOTrainer):
    model = toy(FT)
    before = shardings(model)
    ref = toy(FT) if algorithm == "dpo" else None
    trainer = cls(model, ref, optax.adamw(1e-2), config)
    with FT:
      trainer.train(dpo_batches(2))
    trained.append(trainer)
  check_pair(Pair(trained[0], trained[1], ("fsdp",), before), steps=2)


# -- distillation ---------------------------------------------------------------------------------


def logits(model, input_tokens, input_mask, positions, attention_mask):
  return model(input_tokens, positions, None, attention_mask)[0][:, :-1, :]


def labels(input_tokens, input_mask, **kwargs):
  return jax.nn.one_hot(input_tokens[:, 1:], 256) * input_mask[:, 1:, None]


def test_distillation_on_data_fsdp_tp_mesh():
  """Batch over ("data", "fsdp"): Zero-1 over both; leaves FSDP splits keep their layout."""
  config = distillation_trainer.TrainingConfig(
      eval_every_n_steps=100, max_steps=2, data_sharding_axis=(("data", "fsdp"),)
  )
  strategy = strategies.LogitStrategy(student_forward_fn=logits, teacher_forward_fn=logits, labels_fn=labels)
  trained = []
  for cls in (distillation_trainer.DistillationTrainer, zero1_tunix.Zero1DistillationTrainer):
    student, teacher = toy(DFT), toy(DFT, seed=1)
    before = shardings(student)
    trainer = cls(student, teacher, strategy, optax.adamw(1e-2), config).with_gen_model_input_fn(model_input)
    with DFT:
      trainer.train(sft_batches(2))
    trained.append(trainer)
  check_pair(Pair(trained[0], trained[1], ("data", "fsdp"), before), steps=2)


# -- RL: GRPO and PPO through RLCluster (vanilla rollout on CPU) ---------------------------------


def reward(completions, **kwargs):
  return np.arange(len(completions), dtype=np.float32)


def prompts():
  source = ["hello world", "My name", "hello there", "input string"]
  return grain.MapDataset.source(source).batch(2).map(lambda x: {"prompts": x, "answer": x})


def rl_cluster(cls, *, critic: bool, ckpt_dir=None):
  vocab = test_common.MockVocab()
  size = vocab.GetPieceSize()
  actor, reference = toy(FT, vocab_size=size), toy(FT, vocab_size=size)
  roles = [Role.ACTOR, Role.REFERENCE, Role.ROLLOUT] + ([Role.CRITIC] if critic else [])
  value = place(rl_utils.create_critic_model(actor), FT) if critic else None
  config = grpo_cluster_config(FT, roles, critic_optimizer=optax.adamw(1e-2) if critic else None, max_steps=2,
                               checkpoint_root_directory=ckpt_dir)
  return cls(actor=actor, critic=value, reference=reference, tokenizer=vocab, cluster_config=config)


@pytest.fixture(scope="module")
def grpo(tmp_path_factory):
  root = tmp_path_factory.mktemp("grpo")
  clusters = {}
  for cls in (rl_cluster_lib.RLCluster, zero1_tunix.Zero1RLCluster):
    cluster = rl_cluster(cls, critic=False, ckpt_dir=str(root / cls.__name__))
    before = shardings(cluster.actor_trainer.model)
    algo = grpo_learner.GRPOConfig(num_generations=2, num_iterations=1)
    grpo_learner.GRPOLearner(rl_cluster=cluster, reward_fns=reward, algo_config=algo).train(prompts(), None)
    clusters[cls] = cluster
  plain, zero1 = clusters.values()
  return Pair(plain.actor_trainer, zero1.actor_trainer, ("fsdp",), before), root


def test_grpo_actor_trains_with_zero1_state(grpo):
  pair, _ = grpo
  ratio = check_pair(pair, steps=2)
  assert ratio < 0.6, ratio
  r = report(pair.zero1.optimizer)  # on FSDP: its baseline is what the Tunix class holds
  assert r.unsharded_bytes == bytes_per_device(opt_state(pair.plain)) - 4
  fsdp_kept = {row.path for row in r.rows if row.by_parameter}
  assert "[0].mu['layers'][0]['w1']['kernel']" in fsdp_kept and "[0].mu['emb']['embedding']" not in fsdp_kept


@pytest.mark.parametrize("writer,reader", [("RLCluster", "Zero1RLCluster"), ("Zero1RLCluster", "RLCluster")])
def test_grpo_actor_checkpoints_cross_both_ways(grpo, writer, reader):
  pair, root = grpo
  cls = {"RLCluster": rl_cluster_lib.RLCluster, "Zero1RLCluster": zero1_tunix.Zero1RLCluster}[reader]
  resumed = rl_cluster(cls, critic=False, ckpt_dir=str(root / writer)).actor_trainer
  written = pair.zero1 if writer == "Zero1RLCluster" else pair.plain
  assert resumed.train_steps == 2
  assert_trees_equal(resumed.model, written.model)
  assert_trees_equal(opt_state(resumed), opt_state(written))
  same_class = pair.zero1 if reader == "Zero1RLCluster" else pair.plain
  assert shardings(opt_state(resumed)) == shardings(opt_state(same_class))
  resumed.close()


def test_ppo_actor_and_critic_train_with_zero1_state():
  clusters = []
  for cls in (rl_cluster_lib.RLCluster, zero1_tunix.Zero1RLCluster):
    cluster = rl_cluster(cls, critic=True)
    before = (shardings(cluster.actor_trainer.model), shardings(cluster.critic_trainer.model))
    ppo = ppo_learner.PPOConfig()
    ppo_learner.PPOLearner(rl_cluster=cluster, reward_fns=reward, ppo_config=ppo).train(prompts(), None)
    clusters.append(cluster)
  plain, zero1 = clusters
  check_pair(Pair(plain.actor_trainer, zero1.actor_trainer, ("fsdp",), before[0]), steps=2)
  check_pair(Pair(plain.critic_trainer, zero1.critic_trainer, ("fsdp",), before[1]), steps=2)


def test_rl_cluster_refuses_a_role_mesh_without_the_data_axis_before_building_anything():
  mesh = tunix_mesh((2, 2), ("dp", "tp"))
  vocab = test_common.MockVocab()
  config = rl_cluster_lib.ClusterConfig(
      role_to_mesh={role: mesh for role in (Role.ACTOR, Role.ROLLOUT)},
      training_config=rl_cluster_lib.RLTrainingConfig(actor_optimizer=optax.sgd(0.1), eval_every_n_steps=1),
      rollout_config=base_rollout.RolloutConfig(),
  )
  with pytest.raises(Zero1Error, match=r"'fsdp'.*\('dp', 'tp'\)"):
    zero1_tunix.Zero1RLCluster(actor=toy(), tokenizer=vocab, cluster_config=config)


def test_example_grpo_runs():
  script = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "tunix_grpo.py")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  out = subprocess.run([sys.executable, script, "--steps", "1", "--compare"], env=env, capture_output=True,
                       text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "trained 1 GRPO steps; actor optimizer: Zero1Optimizer" in out.stdout
  # Tunix's Llama3 at data-parallel 8: an eighth of the moments per device, the actor as RLCluster trains it.
  assert "optimizer state per device: 76,868 B" in out.stdout
  assert "nnx.Optimizer: 614,916 B; data axis dataxfsdp = 8" in out.stdout
  assert "parameters bit-identical to RLCluster: True" in out.stdout
  assert "optimizer bytes per device vs RLCluster: 0.125x" in out.stdout
