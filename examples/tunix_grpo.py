"""GRPO with Tunix on a tiny model, on 4 virtual CPU devices, with Zero-1 optimizer state.

Tunix-style mesh ("fsdp", "tp") = (2, 2); Tunix splits the batch over "fsdp" (its
default ``data_sharding_axis``), and so does Zero-1. The only change from a plain Tunix
GRPO script is ``RLCluster`` -> ``Zero1RLCluster``. Runs in seconds:

  python examples/tunix_grpo.py [--steps N] [--compare]

``--compare`` also runs Tunix's own ``RLCluster`` and compares the trained actor.
"""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import argparse  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from grain import python as grain  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from tunix.rl import rl_cluster as rl_cluster_lib  # noqa: E402
from tunix.rl.grpo import grpo_learner  # noqa: E402
from tunix.rl.rollout import base_rollout  # noqa: E402
from tunix.tests import test_common  # noqa: E402  (sets flax_always_shard_variable=False, as Tunix does)

from nnx_zero1 import bytes_per_device, report  # noqa: E402
from nnx_zero1.adapters.tunix import Zero1RLCluster  # noqa: E402

PROMPTS = ["hello world", "My name", "hello there", "input string"]


def toy_model(vocab, mesh: Mesh) -> nnx.Module:
  """Tunix's one-layer ToyTransformer, each array placed on ``mesh`` as its metadata says."""
  model = test_common.ToyTransformer(
      test_common.ModelConfig(num_layers=1, vocab_size=vocab.GetPieceSize()), rngs=nnx.Rngs(0)
  )
  state = nnx.state(model)
  specs = nnx.get_partition_spec(state)
  nnx.update(model, jax.device_put(state, jax.tree.map(lambda s: NamedSharding(mesh, s), specs)))
  return model


def shorter_is_better(prompts, completions, **kwargs):
  """A reward: minus the number of words in each completion."""
  return np.array([-len(c.split()) for c in completions], np.float32)


def train(cluster_class, mesh: Mesh, steps: int):
  vocab = test_common.MockVocab()
  config = rl_cluster_lib.ClusterConfig(
      role_to_mesh={r: mesh for r in (rl_cluster_lib.Role.ACTOR, rl_cluster_lib.Role.REFERENCE,
                                       rl_cluster_lib.Role.ROLLOUT)},
      rollout_engine="vanilla",
      offload_to_cpu=False,
      training_config=rl_cluster_lib.RLTrainingConfig(
          actor_optimizer=optax.adamw(1e-2), eval_every_n_steps=steps, max_steps=steps, pbar_description=None
      ),
      rollout_config=base_rollout.RolloutConfig(
          max_tokens_to_generate=4, max_prompt_length=8, kv_cache_size=32
      ),
  )
  cluster = cluster_class(
      actor=toy_model(vocab, mesh), reference=toy_model(vocab, mesh), tokenizer=vocab, cluster_config=config
  )
  learner = grpo_learner.GRPOLearner(
      rl_cluster=cluster,
      reward_fns=shorter_is_better,
      algo_config=grpo_learner.GRPOConfig(num_generations=2, num_iterations=1),
  )
  data = grain.MapDataset.source(PROMPTS * steps).batch(2).map(lambda x: {"prompts": x, "answer": x})
  learner.train(data, None)
  return cluster.actor_trainer


def main(steps: int, compare: bool) -> None:
  mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("fsdp", "tp"))
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
