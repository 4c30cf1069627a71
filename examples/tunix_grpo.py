"""GRPO with Tunix's own Llama3 class at data-parallel 8, Zero-1 optimizer state for the actor.

On 8 virtual CPU devices, a small configuration of ``tunix.models.llama3`` (random weights,
nothing downloaded; the tokenizer is a small word list of its own, so that no tokenizer is
downloaded either: on chips, your model's tokenizer). What a Tunix GRPO script changes (marked
``# Zero-1:`` / ``# data-parallel:``):

- the mesh has a ``data`` axis: ``("data", "fsdp", "tp") = (8, 1, 1)``;
- the model's ``ShardingConfig`` puts its activations' batch over ``("data", "fsdp")``;
- the ``RLTrainingConfig`` says ``data_sharding_axis=(("data", "fsdp"),)``; it is a
  ``Zero1RLTrainingConfig`` where ``zero1_*`` options are wanted (none here);
- ``RLCluster`` -> ``Zero1RLCluster``; ``GRPOLearner`` is unchanged.

  python examples/tunix_grpo.py [--steps N] [--compare]

``--compare`` also runs Tunix's own ``RLCluster`` and compares the trained actor. Each step
generates with the vanilla rollout engine and trains once: seconds per step on a CPU.
"""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import argparse  # noqa: E402
import dataclasses  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from grain import python as grain  # noqa: E402
from jax.sharding import AxisType, Mesh  # noqa: E402
from tunix.models.llama3 import model as llama3  # noqa: E402
from tunix.rl import rl_cluster as rl_cluster_lib  # noqa: E402
from tunix.rl.grpo import grpo_learner  # noqa: E402
from tunix.rl.rollout import base_rollout  # noqa: E402

from nnx_zero1 import bytes_per_device, report  # noqa: E402
from nnx_zero1.adapters.tunix import Zero1RLCluster, Zero1RLTrainingConfig  # noqa: E402

PROMPTS = ["hello world", "My name", "hello there", "input string"]
BATCH_AXES = ("data", "fsdp")  # data-parallel: the batch over both axes


class WordTokenizer:
  """A tokenizer of whole words from a fixed list (ids 0-2: padding, start, end), what Tunix's rollout
  asks of one: ``encode``, ``decode``, ``bos_id``, ``eos_id``, ``pad_id``."""

  WORDS = ("<pad>", "<s>", "</s>", "hello", "world", "there", "My", "name", "is", "input", "string", "the",
           "a", "short", "long", "answer", "yes", "no", "one", "two", "three", "!")

  def __init__(self):
    self.ids = {word: i for i, word in enumerate(self.WORDS)}

  def __len__(self) -> int:
    return len(self.WORDS)

  def encode(self, text: str, **kwargs) -> list[int]:
    return [self.ids[w] for w in text.split() if w in self.ids]

  def decode(self, ids, **kwargs) -> str:
    return " ".join(self.WORDS[int(i)] for i in ids)

  def pad_id(self) -> int:
    return 0

  def bos_id(self) -> int:
    return 1

  def eos_id(self) -> int:
    return 2


def llama(vocab_size: int, mesh: Mesh) -> nnx.Module:
  """Tunix's Llama3 class, 2 small layers, random weights, each array placed on ``mesh`` by its metadata."""
  config = llama3.ModelConfig(
      num_layers=2, vocab_size=vocab_size, embed_dim=64, hidden_dim=128, num_heads=4, head_dim=16,
      num_kv_heads=2, rope_theta=10_000, norm_eps=1e-6,
  )
  shd = config.shd_config  # data-parallel: the activations' batch entry over both axes
  shd = dataclasses.replace(
      shd, act_btd=(BATCH_AXES, *shd.act_btd[1:]), act_btf=(BATCH_AXES, *shd.act_btf[1:]),
      act_btnh=(BATCH_AXES, *shd.act_btnh[1:]),
  )
  model = llama3.Llama3(dataclasses.replace(config, shd_config=shd), rngs=nnx.Rngs(0))
  state = nnx.state(model)
  nnx.update(model, jax.device_put(state, nnx.get_named_sharding(state, mesh)))
  return model


def shorter_is_better(prompts, completions, **kwargs):
  """A reward: minus the number of words in each completion."""
  return np.array([-len(c.split()) for c in completions], np.float32)


def train(cluster_class, mesh: Mesh, steps: int):
  tokenizer = WordTokenizer()
  config = rl_cluster_lib.ClusterConfig(
      role_to_mesh={r: mesh for r in (rl_cluster_lib.Role.ACTOR, rl_cluster_lib.Role.REFERENCE,
                                       rl_cluster_lib.Role.ROLLOUT)},
      rollout_engine="vanilla",
      training_config=Zero1RLTrainingConfig(  # Zero-1: or Tunix's RLTrainingConfig, with the same fields
          actor_optimizer=optax.adamw(1e-2),
          eval_every_n_steps=steps,
          max_steps=steps,
          data_sharding_axis=(BATCH_AXES,),  # data-parallel: each batch over ("data", "fsdp")
          pbar_description=None,
      ),
      rollout_config=base_rollout.RolloutConfig(
          max_tokens_to_generate=4, max_prompt_length=8, kv_cache_size=32
      ),
  )
  cluster = cluster_class(  # Zero-1: Zero1RLCluster, was RLCluster
      actor=llama(len(tokenizer), mesh), reference=llama(len(tokenizer), mesh), tokenizer=tokenizer,
      cluster_config=config,
  )
  learner = grpo_learner.GRPOLearner(
      rl_cluster=cluster,
      reward_fns=shorter_is_better,
      algo_config=grpo_learner.GRPOConfig(num_generations=2),
  )
  # 4 prompts x 2 generations: 8 sequences a step, one per data-parallel replica.
  train_ds = grain.MapDataset.source(PROMPTS * steps).batch(4).map(lambda x: {"prompts": x, "answer": x})
  learner.train(train_ds)
  return cluster.actor_trainer


def main(steps: int, compare: bool) -> None:
  # data-parallel: 8 replicas; Auto axes, as Tunix's meshes (jax.make_mesh's default is Explicit).
  mesh = jax.make_mesh((8, 1, 1), ("data", "fsdp", "tp"), axis_types=(AxisType.Auto,) * 3)
  actor = train(Zero1RLCluster, mesh, steps)
  print(f"trained {actor.train_steps} GRPO steps; actor optimizer: {type(actor.optimizer).__name__}")
  print(report(actor.optimizer))
  if compare:
    plain = train(rl_cluster_lib.RLCluster, mesh, steps)
    same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(nnx.state(actor.model)),
                                                    jax.tree.leaves(nnx.state(plain.model))))
    state = lambda t: nnx.state(t.optimizer, nnx.optimizer.OptState)
    ratio = bytes_per_device(state(actor)) / bytes_per_device(state(plain))
    print(f"parameters bit-identical to RLCluster: {same}")
    print(f"optimizer bytes per device vs RLCluster: {ratio:.3f}x")


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--steps", type=int, default=2)
  parser.add_argument("--compare", action="store_true")
  args = parser.parse_args()
  main(args.steps, args.compare)
