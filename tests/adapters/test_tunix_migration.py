"""docs/tunix.md's migration, held to the code: the Zero1Error it quotes is what a Tunix user whose mesh
lacks the data axis meets, and the ``zero1_*`` options reach ``Zero1RLCluster``'s actor through
``Zero1RLTrainingConfig`` (Tunix's ``RLTrainingConfig`` plus those options)."""

import ast
import dataclasses
import math
import re
from pathlib import Path

import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from tunix.rl import rl_cluster as rl_cluster_lib

from nnx_zero1 import Zero1Error
from nnx_zero1.adapters.tunix import (
  Zero1PeftTrainer,
  Zero1RLCluster,
  Zero1RLTrainingConfig,
  Zero1TrainingConfig,
)
from tests.support.docs_tables import table_under
from tests.support.helpers import assert_trees_equal, pure
from tests.support.tunix_toys import (
    data_parallel,
    grpo_cluster_config,
    llama3,
    peft_trainer,
    place,
    qwen3,
    test_common,
    toy,
    tunix_mesh,
)

PAGE = Path(__file__).resolve().parents[2] / "docs" / "tunix.md"


def quoted_errors() -> list[str]:
  """The lines of docs/tunix.md's ``text`` blocks that show a Zero1Error as a traceback ends with it."""
  blocks = re.findall(r"```text\n(.*?)```", PAGE.read_text(), flags=re.S)
  return [line for block in blocks for line in block.splitlines() if "Zero1Error: " in line]


def _met(mesh, config, data_sharding_axis) -> str:
  """The Zero1Error a Tunix user meets building ``Zero1PeftTrainer`` on Tunix's ``Llama3`` of ``config`` under
  ``mesh``, shown as a traceback ends with it; the model is left as it was."""
  with nnx.use_eager_sharding(False):
    model = place(llama3.Llama3(config, rngs=nnx.Rngs(0)), mesh)
  before = pure(model)
  training_config = peft_trainer.TrainingConfig(eval_every_n_steps=100, data_sharding_axis=data_sharding_axis)
  with mesh, pytest.raises(Zero1Error) as raised:
    Zero1PeftTrainer(model, optax.adamw(1e-5), training_config)
  assert_trees_equal(model, before)
  return f"{type(raised.value).__module__}.{type(raised.value).__name__}: {raised.value}"


def test_the_quoted_zero1_errors_are_what_a_tunix_user_meets():
  """The page's three quotes, word for word and in its order: Tunix's default ``data_sharding_axis`` and
  Tunix's default ``ShardingConfig`` on the data-parallel mesh; ``("data",)`` on Tunix's fsdp-only mesh."""
  config = llama3.ModelConfig(
      num_layers=1, vocab_size=64, embed_dim=32, hidden_dim=64, num_heads=2, head_dim=16, num_kv_heads=1,
      rope_theta=10_000, norm_eps=1e-6,
  )
  data8 = tunix_mesh((8, 1, 1), ("data", "fsdp", "tp"))
  assert quoted_errors() == [
      _met(data8, data_parallel(config), ("fsdp",)),
      _met(data8, config, (("data", "fsdp"),)),
      _met(tunix_mesh((8, 1), ("fsdp", "tp")), config, ("data",)),
  ]


def test_no_example_imports_a_hosts_test_package():
  for script in (PAGE.parents[1] / "examples").glob("*.py"):
    imported = {alias.name for node in ast.walk(ast.parse(script.read_text())) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module for node in ast.walk(ast.parse(script.read_text()))
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert not {m for m in imported if ".tests" in m or m.startswith("tests")}, script.name


def test_the_rl_config_has_every_zero1_option_of_the_sft_config():
  def options(cls):
    return {(f.name, f.default) for f in dataclasses.fields(cls) if f.name.startswith("zero1_")}

  assert options(Zero1RLTrainingConfig) == options(Zero1TrainingConfig)
  assert issubclass(Zero1RLTrainingConfig, rl_cluster_lib.RLTrainingConfig)
  for config in (Zero1TrainingConfig(eval_every_n_steps=1),
                 Zero1RLTrainingConfig(actor_optimizer=optax.sgd(1e-2), eval_every_n_steps=1)):
    with pytest.raises(AttributeError):  # a misspelt option is refused, not kept and ignored
      config.zero1_strcit = True


def test_zero1_rl_training_config_options_reach_the_actor():
  mesh = tunix_mesh((2, 2), ("fsdp", "tp"))
  vocab = test_common.MockVocab()
  roles = (rl_cluster_lib.Role.ACTOR, rl_cluster_lib.Role.REFERENCE, rl_cluster_lib.Role.ROLLOUT)
  config = grpo_cluster_config(mesh, roles, Zero1RLTrainingConfig, zero1_state_dtype=jnp.bfloat16)
  size = vocab.GetPieceSize()
  cluster = Zero1RLCluster(actor=toy(mesh, vocab_size=size), reference=toy(mesh, vocab_size=size),
                           tokenizer=vocab, cluster_config=config)
  optimizer = cluster.actor_trainer.optimizer
  assert optimizer.data_axis == ("fsdp",)
  mu = nnx.state(optimizer.opt_state[0].mu)
  assert {x[...].dtype for _, x in nnx.to_flat_state(mu)} == {jnp.dtype(jnp.bfloat16)}


LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _counts(name: str) -> tuple[int, int]:
  """The parameters of Tunix's ``name`` configuration (abstract: nothing allocated) and of rank-16 LoRA
  factors on its 7 projections (``lora_a`` ``(in, 16)``, ``lora_b`` ``(16, out)``, the einsum kernels'
  head axes on their side)."""
  family, cls = {"llama3p2_1b": (llama3, llama3.Llama3), "qwen3_1p7b": (qwen3, qwen3.Qwen3)}[name]
  with nnx.use_eager_sharding(False):
    model = nnx.eval_shape(lambda: cls(getattr(family.ModelConfig, name)(), rngs=nnx.Rngs(0)))
  full = lora = 0
  for path, x in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    assert any(size % 8 == 0 for size in x.shape), path  # Zero-1 at data 8 splits every leaf
    full += math.prod(x.shape)
    if any(m in str(path) for m in LORA_MODULES):
      inputs = x.shape[0] * (x.shape[1] if "o_proj" in str(path) else 1)
      lora += 16 * (inputs + math.prod(x.shape) // inputs)
  return full, lora


def test_the_savings_table_is_the_layout_rule_on_tunixs_configurations():
  """docs/tunix.md's savings at data-parallel 8: two moments per trained parameter in its dtype, 1/8 with
  Zero-1 (every leaf of these models divides by 8), GiB to two decimals; the counts in the first column."""
  rows = table_under("docs/tunix.md", "| model (parameters) |")
  assert len(rows) == 6
  model = None
  for first, training, dtype, plain, zero1, saved in rows:
    model = re.search(r"`(\w+)`", first)[1] if first.startswith("`") else model
    full, lora = _counts(model)
    if "(" in first:
      assert first == f"`{model}` ({full:,})"
    count = lora if training.startswith("LoRA") else full
    if training.startswith("LoRA"):
      assert training == f"LoRA rank 16, 7 projections ({lora:,})"
    state = 2 * count * (2 if dtype.startswith("bfloat16") else 4) / 2**30
    assert [plain, zero1, saved] == [f"{state:.2f}", f"{state / 8:.2f}", f"{state * 7 / 8:.2f}"], first
