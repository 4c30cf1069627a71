"""Zero1PeftTrainer against the real Tunix PeftTrainer, on Tunix's own toy transformer.

Mesh ("data", "fsdp", "tp") = (2, 2, 2), batch split over ("data", "fsdp"), which is
also what Zero-1 splits over by default. Each case (full / LoRA, with / without gradient
accumulation) trains both trainers once (module-scoped fixture) and the tests read the
results. (Toy models and the flax-flag care around ``tunix.tests.test_common``:
``tunix_toys``.)
"""

import dataclasses
import inspect
import os
import subprocess
import sys

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from tunix.sft import peft_trainer

from nnx_zero1 import Zero1Error, Zero1Optimizer, bytes_per_device, report
from nnx_zero1.adapters.tunix import Zero1PeftTrainer, Zero1TrainingConfig
from tests.support.helpers import assert_trees_close, assert_trees_equal, pure, shardings
from tests.support.tunix_toys import (
  cache_size,
  expected_zero1_bytes,
  model_input,
  opt_state,
  sft_batches,
  toy,
)

PeftTrainer = peft_trainer.PeftTrainer
AUTO = (AxisType.Auto,) * 3
MESH = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tp"), axis_types=AUTO)
BATCH_AXES = (("data", "fsdp"),)
STEPS = 3
CASES = {"full": (False, None), "full-ga2": (False, 2), "lora": (True, None), "lora-ga2": (True, 2)}


def toy_model(lora: bool, mesh=MESH) -> nnx.Module:
  return toy(mesh, lora=lora)


def batches(n: int) -> list:
  return sft_batches(n)


def config(ga, ckpt_dir=None, cls=peft_trainer.TrainingConfig, **kwargs):
  """Checkpoints at step 2 and (on close) at the last step: by step count, not by wall clock."""
  return cls(
      eval_every_n_steps=1000,
      max_steps=STEPS,
      gradient_accumulation_steps=ga,
      data_sharding_axis=BATCH_AXES,
      checkpoint_root_directory=None if ckpt_dir is None else str(ckpt_dir),
      checkpointing_options=ocp.CheckpointManagerOptions(save_interval_steps=2),
      **kwargs,
  )


def new_trainer(cls, lora, ga, ckpt_dir=None):
  with MESH:
    trainer = cls(toy_model(lora), optax.adamw(1e-2), config(ga, ckpt_dir))
  return trainer.with_gen_model_input_fn(model_input)


@dataclasses.dataclass
class Pair:
  lora: bool
  ga: int | None
  plain: PeftTrainer
  zero1: Zero1PeftTrainer
  plain_dir: str
  zero1_dir: str
  param_shardings: list  # before training


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory) -> Pair:
  """A PeftTrainer and a Zero1PeftTrainer trained the same way, each writing checkpoints."""
  lora, ga = CASES[request.param]
  root = tmp_path_factory.mktemp(request.param)
  trained = {}
  for cls in (PeftTrainer, Zero1PeftTrainer):
    trainer = new_trainer(cls, lora, ga, root / cls.__name__)
    before = shardings(trainer.model)
    with MESH:
      trainer.train(batches(STEPS * (ga or 1)))
    trained[cls] = trainer
  return Pair(lora, ga, trained[PeftTrainer], trained[Zero1PeftTrainer],
              str(root / "PeftTrainer"), str(root / "Zero1PeftTrainer"), before)


def test_signature_is_peft_trainers():
  assert inspect.signature(Zero1PeftTrainer) == inspect.signature(PeftTrainer)


def test_same_parameters_and_losses_as_peft_trainer(pair):
  assert isinstance(pair.zero1.optimizer, Zero1Optimizer)
  assert type(pair.plain.optimizer) is nnx.Optimizer
  assert pair.zero1.train_steps == pair.plain.train_steps == STEPS
  assert_trees_close(pair.zero1.model, pair.plain.model, atol=1e-6, rtol=1e-6)
  assert_trees_close(opt_state(pair.zero1), opt_state(pair.plain), atol=1e-6, rtol=1e-6)
  losses = [t.metrics_logger.get_metric_history("", "loss", "train") for t in (pair.plain, pair.zero1)]
  np.testing.assert_allclose(losses[1], losses[0], atol=1e-6, rtol=1e-6)
  assert len(losses[0]) == STEPS


def test_optimizer_bytes_per_device_follow_the_layout_rule(pair):
  """Data axes default to the batch axes ("data", "fsdp"): 4 replicas. Leaves FSDP already
  splits keep their layout; the rest drop to 1/4. Measured: 0.27 (full), 0.50 (LoRA, whose
  factors mostly carry "fsdp" already)."""
  axes = ("data", "fsdp")
  assert pair.zero1.optimizer.data_axis == axes
  plain, zero1 = bytes_per_device(opt_state(pair.plain)), bytes_per_device(opt_state(pair.zero1))
  assert zero1 == expected_zero1_bytes(opt_state(pair.plain), axes)
  assert zero1 / plain < (0.28 if not pair.lora else 0.51), (zero1, plain)
  assert report(pair.zero1.optimizer).per_device_bytes == zero1 - 4  # report leaves out `step`


def test_state_stays_on_the_zero1_layout(pair):
  plan = pair.zero1.optimizer.zero1_plan
  state = jax.tree.leaves(nnx.as_pure(pair.zero1.optimizer.opt_state))
  assert [x.sharding for x in state] == [row.sharding for row in plan.state_leaves]
  split = [row for row in plan.state_leaves if row.reason is None]
  assert split and all("data" in str(row.sharding.spec) or "fsdp" in str(row.sharding.spec) for row in split)
  if pair.ga:
    acc = nnx.as_pure(pair.zero1.optimizer.opt_state).acc_grads
    assert all("data" in str(x.sharding.spec) or "fsdp" in str(x.sharding.spec) for x in jax.tree.leaves(acc))


def test_compiles_once_and_parameters_keep_their_shardings(pair):
  assert cache_size(pair.zero1) == 1
  assert shardings(pair.zero1.model) == pair.param_shardings
  assert shardings(pair.zero1.model) == shardings(pair.plain.model)


def _resume(cls, pair, ckpt_dir):
  """A fresh trainer of ``cls`` built on ``ckpt_dir``: PeftTrainer restores it in __init__."""
  trainer = new_trainer(cls, pair.lora, pair.ga, ckpt_dir)
  assert trainer.train_steps == STEPS
  return trainer


def test_zero1_checkpoint_resumes_in_peft_trainer(pair):
  resumed = _resume(PeftTrainer, pair, pair.zero1_dir)
  assert type(resumed.optimizer) is nnx.Optimizer
  assert_trees_equal(resumed.model, pair.zero1.model)
  assert_trees_equal(opt_state(resumed), opt_state(pair.zero1))
  resumed.close()


def test_peft_checkpoint_resumes_in_zero1_trainer_on_the_zero1_layout(pair):
  resumed = _resume(Zero1PeftTrainer, pair, pair.plain_dir)
  assert_trees_equal(resumed.model, pair.plain.model)
  assert_trees_equal(opt_state(resumed), opt_state(pair.plain))
  assert shardings(opt_state(resumed)) == shardings(opt_state(pair.zero1))
  assert shardings(resumed.model) == pair.param_shardings
  resumed.close()


def _tree(root: str) -> set[str]:
  """Directories and item files of a checkpoint root; OCDBT data files have content-hash names."""
  found = set()
  for dirpath, _, filenames in os.walk(root):
    rel = os.path.relpath(dirpath, root)
    if "ocdbt.process" in rel or rel.endswith("/d"):
      continue
    found.add(rel)
    found.update(os.path.join(rel, f) for f in filenames if not f.startswith("ocdbt.process"))
  return found


def test_same_checkpoint_directories_and_files(pair):
  tree = _tree(pair.zero1_dir)
  assert tree == _tree(pair.plain_dir)
  assert {"2/optimizer_state/_METADATA", "3/model_params/_METADATA"} <= tree


def test_restored_trainer_keeps_layout_through_shard_optimizer_and_clear_jit_cache(pair):
  resumed = _resume(Zero1PeftTrainer, pair, pair.zero1_dir)
  expected = shardings(opt_state(pair.zero1))
  with MESH:
    step, _ = resumed.jit_train_and_eval_step()  # runs PeftTrainer._shard_optimizer
    assert shardings(opt_state(resumed)) == expected
    resumed.clear_jit_cache()
    step, _ = resumed.jit_train_and_eval_step()
    assert shardings(opt_state(resumed)) == expected
    for batch in batches(2):
      step(peft_trainer.sharding_utils.shard_input(batch, BATCH_AXES))
  assert cache_size(resumed) == 1
  assert shardings(opt_state(resumed)) == expected
  assert shardings(resumed.model) == pair.param_shardings
  resumed.close()


def test_mesh_without_data_axis_raises_before_anything_changes(tmp_path):
  mesh = jax.make_mesh((4, 2), ("fsdp", "tp"), axis_types=(AxisType.Auto,) * 2)
  model = toy_model(lora=False, mesh=mesh)
  before = pure(model)
  with mesh, pytest.raises(Zero1Error, match=r"'data'.*\('fsdp', 'tp'\)"):
    Zero1PeftTrainer(model, optax.adamw(1e-2), config(None, tmp_path / "ckpt"))
  assert_trees_equal(model, before)
  assert not (tmp_path / "ckpt").exists()




def test_zero1_training_config_chooses_the_data_axis():
  cfg = config(None, cls=Zero1TrainingConfig, zero1_data_axis="tp")
  with MESH:
    trainer = Zero1PeftTrainer(toy_model(lora=False), optax.adamw(1e-2), cfg)
  assert trainer.optimizer.data_axis == ("tp",)
  specs = {row.path: row.sharding.spec for row in trainer.optimizer.zero1_plan.state_leaves}
  assert specs["[0].mu['emb']['embedding']"] == P("tp")
  assert not any("data" in str(spec) for spec in specs.values())


def test_the_config_has_every_option_of_the_record_by_its_name():
  # Drift fails here: an option added to Zero1Options that Tunix's config cannot set.
  from nnx_zero1 import Zero1Options

  options = {f"zero1_{field.name}" for field in dataclasses.fields(Zero1Options)}
  fields = {field.name for field in dataclasses.fields(Zero1TrainingConfig)}
  assert options == {name for name in fields if name.startswith("zero1_")}


def test_example_runs_tiny():
  script = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "tunix_lora_sft.py")
  env = {**os.environ, "NNX_ZERO1_TINY": "1", "XLA_FLAGS": ""}
  out = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "step   3  loss" in out.stdout
  # Tunix's Llama3 with LoRA at data-parallel 8: the LoRA factors' moments, an eighth per device.
  assert "optimizer state per device: 45,060 B" in out.stdout and "sharded" in out.stdout
  assert "nnx.Optimizer: 360,452 B; data axis dataxfsdp = 8" in out.stdout
