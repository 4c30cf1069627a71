"""Tunix's own toy models and inputs, and what the Tunix tests compare, shared by the Tunix test files.

Importing ``tunix.tests.test_common`` or Tunix's model modules sets flax's global
``flax_always_shard_variable`` to False (Tunix's models are written for that). The flag
is put back right after the imports so other test files in the same pytest process keep
flax's default; models are built inside ``nnx.use_eager_sharding(False)`` instead, which
is scoped. Import Tunix's modules from here.
"""

import dataclasses
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from nnx_zero1 import zero1_sharding
from nnx_zero1._src.compat import jit_cache_size
from nnx_zero1._src.specs import canonical_spec

_always_shard = flax.config.flax_always_shard_variable
from tunix.models.llama3 import model as llama3  # noqa: E402, F401 (for the tests: Tunix's real model classes)
from tunix.models.qwen3 import model as qwen3  # noqa: E402, F401
from tunix.sft import peft_trainer  # noqa: E402
from tunix.tests import test_common  # noqa: E402

flax.config.update("flax_always_shard_variable", _always_shard)


def tunix_mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Mesh:
  """A mesh as Tunix's tests build one: ``jax.sharding.Mesh`` (Auto axes) over the first devices."""
  n = int(np.prod(shape))
  return Mesh(np.array(jax.devices()[:n]).reshape(shape), names)


def data_parallel(config: Any, batch: tuple[str, ...] = ("data", "fsdp")) -> Any:
  """Tunix's model ``config`` with its activations' batch entry (``act_btd``, ``act_btf``, ``act_btnh``)
  over ``batch``: what a mesh with a ``data`` axis needs (docs/tunix.md)."""
  shd = config.shd_config
  fields = {f: (batch, *getattr(shd, f)[1:]) for f in ("act_btd", "act_btf", "act_btnh")}
  return dataclasses.replace(config, shd_config=dataclasses.replace(shd, **fields))


def place(model: nnx.Module, mesh: Mesh | None) -> nnx.Module:
  """Every array of ``model`` on ``mesh`` as its sharding metadata says (``None``: left where it is)."""
  if mesh is not None:
    state = nnx.state(model)
    targets = jax.tree.map(lambda s: NamedSharding(mesh, canonical_spec(s)), nnx.get_partition_spec(state))
    nnx.update(model, jax.device_put(state, targets))
  return model


def toy(mesh: Mesh | None = None, *, lora: bool = False, vocab_size: int = 256, seed: int = 0) -> nnx.Module:
  """Tunix's ToyTransformer with one layer (LoRA on w1/w2 via qwix if asked), placed on ``mesh``."""
  with nnx.use_eager_sharding(False):
    model = test_common.ToyTransformer(
        test_common.ModelConfig(num_layers=1, vocab_size=vocab_size), rngs=nnx.Rngs(seed)
    )
    if lora:
      model = test_common.get_lora_model(model)
  return place(model, mesh)


def sft_batches(n: int, batch: int = 8, length: int = 8, seed: int = 0) -> list:
  rng = np.random.default_rng(seed)
  tokens = [rng.integers(1, 256, (batch, length)).astype(np.int32) for _ in range(n)]
  return [peft_trainer.TrainingInput(input_tokens=t, input_mask=np.ones(t.shape, bool)) for t in tokens]


def model_input(x) -> dict:
  """What PeftTrainer's default loss passes to the model: positions and a causal mask."""
  length = x.input_tokens.shape[1]
  causal = jnp.tril(jnp.ones((length, length), bool))
  return {
      "input_tokens": x.input_tokens,
      "input_mask": x.input_mask,
      "positions": jnp.broadcast_to(jnp.arange(length), x.input_tokens.shape),
      "attention_mask": causal[None] & x.input_mask[:, None, :],
  }


def opt_state(trainer) -> nnx.State:
  return nnx.state(trainer.optimizer, nnx.optimizer.OptState)


def cache_size(trainer) -> int:
  """How many times the trainer's jitted train step compiled."""
  return jit_cache_size(trainer._jitted_train_step_fn.func.jitted_fn)  # a Tunix 0.1.7 private


def expected_zero1_bytes(plain_state, axes) -> int:
  """Per-device bytes of ``plain_state`` with each leaf laid out by the Zero-1 rule (``zero1_sharding``)."""
  total = 0
  for x in jax.tree.leaves(nnx.as_pure(plain_state)):
    shard = zero1_sharding(x.shape, x.sharding, axes).shard_shape(x.shape)
    total += int(np.prod(shard)) * x.dtype.itemsize
  return total


def grpo_cluster_config(mesh: Mesh, roles: Any, config_cls: Any = None, **training: Any) -> Any:
  """The tests' GRPO cluster: every role on ``mesh``, Tunix's vanilla rollout of a few tokens, and an
  ``RLTrainingConfig`` (or ``config_cls``, a subclass) of adamw at 1e-2 with ``training``'s settings
  (``max_steps``, a checkpoint, ``zero1_*`` options...)."""
  from tunix.rl import rl_cluster as rl_cluster_lib
  from tunix.rl.rollout import base_rollout

  config_cls = config_cls or rl_cluster_lib.RLTrainingConfig
  return rl_cluster_lib.ClusterConfig(
      role_to_mesh={role: mesh for role in roles}, rollout_engine="vanilla", offload_to_cpu=False,
      training_config=config_cls(actor_optimizer=optax.adamw(1e-2), eval_every_n_steps=100, **training),
      rollout_config=base_rollout.RolloutConfig(max_tokens_to_generate=4, max_prompt_length=8,
                                                kv_cache_size=32))
