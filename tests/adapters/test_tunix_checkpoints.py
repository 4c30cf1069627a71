"""Checkpoints written by Tunix's own checkpointing, resumed across the Tunix and Zero-1 trainers (issue 82).

Tunix's real ``Llama3`` class (2 layers, small dims, random weights) on a Tunix-style mesh
``("data", "fsdp", "tp") = (8, 1, 1)``: data-parallel 8, the batch split over ``data``
(``data_sharding_axis=("data",)``), adamw. ``PeftTrainer`` saves through
``TrainingConfig.checkpoint_root_directory`` (its orbax ``CheckpointManager``, items
``model_params`` and ``optimizer_state``) and restores the latest step in ``__init__``;
``train`` then skips the batches already trained. Every run here trains 2 steps, stops
(the last step is saved on close), and a fresh trainer of either class resumes from a copy
of that directory and trains to step 4. An uninterrupted ``PeftTrainer`` run of 4 steps is
the reference: each resumed run must match it bit for bit (adamw is elementwise, so the
contract is bit-identity on a data-only mesh). At another data-parallel size (8 -> 4, a
mesh over the first 4 devices) the two classes must match each other bit for bit, with
Zero-1 holding a quarter of the moments per device. A LoRA run (qwix, as Tunix does it)
saves only its LoRA factors and resumes the same way. GRPO's actor (``RLCluster`` with
``GRPOLearner``, the vanilla rollout engine, Tunix's test vocabulary as the tokenizer): one step
written, resumed by the other class with the whole prompt set (Tunix's learner skips what the
checkpoint has trained), one more step, bit-identical to a run that never stopped.
"""

import dataclasses
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
import qwix
from flax import nnx
from grain import python as grain
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import grpo_learner

from nnx_zero1 import Zero1Optimizer
from nnx_zero1.adapters.tunix import Zero1PeftTrainer, Zero1RLCluster, Zero1TrainingConfig
from tests.support.helpers import shardings
from tests.support.tunix_toys import (
  data_parallel,
  grpo_cluster_config,
  llama3,
  model_input,
  opt_state,
  peft_trainer,
  place,
  qwen3,
  test_common,
  tunix_mesh,
)

PeftTrainer = peft_trainer.PeftTrainer
NAMES = ("data", "fsdp", "tp")
MESH8 = tunix_mesh((8, 1, 1), NAMES)
MESH4 = tunix_mesh((4, 1, 1), NAMES)  # the first 4 of the 8 devices
FSDP_TP = tunix_mesh((4, 2), ("fsdp", "tp"))  # Tunix's own mesh
CONFIG = data_parallel(llama3.ModelConfig(
    num_layers=2, vocab_size=128, embed_dim=64, hidden_dim=128, num_heads=4, head_dim=16,
    num_kv_heads=2, rope_theta=10_000, norm_eps=1e-6,
))
PROJECTIONS = ".*q_proj|.*k_proj|.*v_proj|.*o_proj|.*gate_proj|.*up_proj|.*down_proj"
CLASSES = {"PeftTrainer": PeftTrainer, "Zero1PeftTrainer": Zero1PeftTrainer}


def batches(n: int = 4, batch: int = 8, length: int = 16) -> list:
  rng = np.random.default_rng(0)
  tokens = [rng.integers(1, CONFIG.vocab_size, (batch, length)).astype(np.int32) for _ in range(n)]
  return [peft_trainer.TrainingInput(input_tokens=t, input_mask=np.ones(t.shape, bool)) for t in tokens]


def llama(mesh, lora: bool, config=CONFIG) -> nnx.Module:
  """The same random weights every time (seed 0), placed on ``mesh`` by their metadata."""
  with nnx.use_eager_sharding(False):
    model = llama3.Llama3(config, rngs=nnx.Rngs(0))
    if lora:
      x = model_input(batches(1)[0])
      provider = qwix.LoraProvider(module_path=PROJECTIONS, rank=4, alpha=2.0)
      model = qwix.apply_lora_to_model(
          model, provider, x["input_tokens"], x["positions"], None, x["attention_mask"], rngs=nnx.Rngs(1)
      )
  return place(model, mesh)


def tunix_llama(mesh, lora: bool) -> nnx.Module:
  """``llama`` as Tunix's own scripts build it for Tunix's fsdp mesh: Tunix's default ``ShardingConfig``."""
  tunix_default = llama3.ShardingConfig.get_default_sharding()
  return llama(mesh, lora, dataclasses.replace(CONFIG, shd_config=tunix_default))


def bf16_qwen3(mesh, lora: bool = False) -> nnx.Module:
  """Tunix's Qwen3 with bfloat16 parameters (``master_dtype`` is for those), random weights, on ``mesh``."""
  assert not lora
  config = data_parallel(qwen3.ModelConfig(
      num_layers=2, vocab_size=128, embed_dim=64, hidden_dim=128, num_heads=4, head_dim=16, num_kv_heads=2,
      rope_theta=10_000, norm_eps=1e-6, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
  ))
  with nnx.use_eager_sharding(False):
    return place(qwen3.Qwen3(config, rngs=nnx.Rngs(0)), mesh)


def run(cls, mesh, ckpt_dir, *, steps: int, lora=False, model=llama, batch=("data",), **zero1_options):
  """A trainer of ``cls`` on ``mesh``: restores ``ckpt_dir``'s latest step (if any), trains to ``steps``,
  each batch split over ``batch`` (``data_sharding_axis``).

  ``zero1_options`` (``zero1_state_dtype=``, ...) go in a ``Zero1TrainingConfig``, else Tunix's own config.
  """
  config_class = Zero1TrainingConfig if zero1_options else peft_trainer.TrainingConfig
  config = config_class(
      **zero1_options,
      eval_every_n_steps=1000,
      max_steps=steps,
      data_sharding_axis=batch,
      checkpoint_root_directory=str(ckpt_dir),
      checkpointing_options=ocp.CheckpointManagerOptions(save_interval_steps=2),
      pbar_description=None,
  )
  with mesh:
    trainer = cls(model(mesh, lora), optax.adamw(1e-2), config).with_gen_model_input_fn(model_input)
    restored = {"step": trainer.train_steps, "params": flat(trainer.model), "state": flat(opt_state(trainer))}
    trainer.train(batches())
  assert trainer.train_steps == steps
  return trainer, restored


def flat(tree) -> dict:
  return {path: np.asarray(v[...]) for path, v in nnx.to_flat_state(nnx.state(tree))}


def assert_equal(a: dict, b: dict) -> None:
  assert a.keys() == b.keys()
  for path in a:
    np.testing.assert_array_equal(a[path], b[path], err_msg=str(path))


def assert_close(a: dict, b: dict, atol: float = 1e-6) -> None:
  """Another mesh sums the gradients in another order: float32 within ``atol`` or 1e-5 (relative)."""
  assert a.keys() == b.keys()
  for path in a:
    np.testing.assert_allclose(a[path], b[path], atol=atol, rtol=1e-5, err_msg=str(path))


def bytes_on_first_device(tree, mesh) -> int:
  device = mesh.devices.flat[0]
  return sum(s.data.nbytes for x in jax.tree.leaves(nnx.as_pure(tree)) for s in x.addressable_shards
             if s.device == device)


def resume(written: str, tmp, reader: str, mesh, **kwargs):
  """``reader`` resumes a copy of the checkpoint root ``written`` and trains to step 4."""
  copy = tmp / f"{reader}-{mesh.devices.size}-{len(kwargs)}"
  shutil.copytree(written, copy)
  return run(CLASSES[reader], mesh, copy, steps=4, **kwargs)


@pytest.fixture(scope="module")
def full(tmp_path_factory):
  """The reference (4 steps uninterrupted) and each class's checkpoint at step 2, at data-parallel 8."""
  tmp = tmp_path_factory.mktemp("full")
  reference, _ = run(PeftTrainer, MESH8, tmp / "reference", steps=4)
  written = {}
  for name, cls in CLASSES.items():
    trainer, _ = run(cls, MESH8, tmp / name, steps=2)
    written[name] = (str(tmp / name), flat(trainer.model), flat(opt_state(trainer)))
  return tmp, reference, written


@pytest.mark.parametrize("writer,reader", [
    ("PeftTrainer", "Zero1PeftTrainer"),
    ("Zero1PeftTrainer", "PeftTrainer"),
    ("Zero1PeftTrainer", "Zero1PeftTrainer"),
])
def test_resumed_at_data_parallel_8_continues_bit_identically(full, writer, reader):
  tmp, reference, written = full
  root, params, state = written[writer]
  trainer, restored = resume(root, tmp / writer, reader, MESH8)
  assert restored["step"] == 2
  assert_equal(restored["params"], params)  # the checkpoint, exactly
  assert_equal(restored["state"], state)
  assert_equal(flat(trainer.model), flat(reference.model))  # then 2 more steps, as if never stopped
  assert_equal(flat(opt_state(trainer)), flat(opt_state(reference)))
  expected = Zero1Optimizer if reader == "Zero1PeftTrainer" else nnx.Optimizer
  assert type(trainer.optimizer) is expected
  params_bytes = bytes_on_first_device(nnx.state(trainer.model, nnx.Param), MESH8)
  split = 8 if reader == "Zero1PeftTrainer" else 1  # Zero-1's moments: an eighth per device
  for name in ("mu", "nu"):
    assert bytes_on_first_device(getattr(trainer.optimizer.opt_state[0], name), MESH8) * split == params_bytes


def test_resumed_at_data_parallel_4_from_a_data_parallel_8_peft_trainer_checkpoint(full):
  tmp, reference, written = full
  root, params, state = written["PeftTrainer"]
  plain, restored_plain = resume(root, tmp / "dp4", "PeftTrainer", MESH4)
  zero1, restored_zero1 = resume(root, tmp / "dp4", "Zero1PeftTrainer", MESH4)
  for restored in (restored_plain, restored_zero1):
    assert restored["step"] == 2
    assert_equal(restored["params"], params)
    assert_equal(restored["state"], state)
  assert_equal(flat(zero1.model), flat(plain.model))
  assert_equal(flat(opt_state(zero1)), flat(opt_state(plain)))
  # A reduction over 4 replicas rounds differently from one over 8: close to the reference, not equal.
  assert_close(flat(zero1.model), flat(reference.model))
  # Every array on the new mesh's 4 devices; Zero-1's moments on its layout over them: a quarter per device.
  assert {d for x in jax.tree.leaves(nnx.state(zero1.model)) for d in x[...].sharding.device_set} == set(
      MESH4.devices.flat)
  params_bytes = bytes_on_first_device(nnx.state(zero1.model, nnx.Param), MESH4)
  for name in ("mu", "nu"):
    moments = getattr(zero1.optimizer.opt_state[0], name)
    assert bytes_on_first_device(getattr(plain.optimizer.opt_state[0], name), MESH4) == params_bytes
    assert bytes_on_first_device(moments, MESH4) * 4 == params_bytes, name
  assert shardings(zero1.model) == shardings(plain.model)


def test_a_peft_trainer_checkpoint_from_tunixs_fsdp_tp_mesh_resumes_at_data_parallel_4(full, tmp_path):
  """What a Tunix user has: ``PeftTrainer`` with Tunix's defaults (batch over ``fsdp``, Tunix's
  ``ShardingConfig``) on Tunix's own mesh ``("fsdp", "tp") = (4, 2)``, step 2 saved. ``Zero1PeftTrainer`` on
  ``("data", "fsdp", "tp") = (4, 1, 1)`` restores it exactly and trains 2 more steps, with a quarter of the
  moments per device, within 1e-4 of the data-parallel 8 reference: 2 steps on ``tp`` and 2 on data 4 sum in
  other orders, and adamw's normalisation magnifies that in the embedding's rarely-seen rows (measured: at
  most 2.3e-5, every other leaf under 1.8e-5)."""
  _, reference, _ = full
  written, _ = run(PeftTrainer, FSDP_TP, tmp_path / "fsdp", steps=2, model=tunix_llama, batch=("fsdp",))
  trainer, restored = resume(str(tmp_path / "fsdp"), tmp_path, "Zero1PeftTrainer", MESH4)
  assert restored["step"] == 2
  assert_equal(restored["params"], flat(written.model))
  assert_equal(restored["state"], flat(opt_state(written)))
  assert_close(flat(trainer.model), flat(reference.model), atol=1e-4)
  assert_close(flat(opt_state(trainer)), flat(opt_state(reference)), atol=1e-4)
  params_bytes = bytes_on_first_device(nnx.state(trainer.model, nnx.Param), MESH4)
  assert bytes_on_first_device(trainer.optimizer.opt_state[0].mu, MESH4) * 4 == params_bytes


def test_a_lora_checkpoint_crosses_both_ways_and_continues_bit_identically(tmp_path):
  reference, _ = run(PeftTrainer, MESH8, tmp_path / "reference", steps=4, lora=True)
  expected = flat(nnx.state(reference.model, nnx.LoRAParam)), flat(opt_state(reference))
  saved = {}
  for writer, reader in (("PeftTrainer", "Zero1PeftTrainer"), ("Zero1PeftTrainer", "PeftTrainer")):
    written, _ = run(CLASSES[writer], MESH8, tmp_path / writer, steps=2, lora=True)
    lora_params = flat(nnx.state(written.model, nnx.LoRAParam))
    assert len(lora_params) == 28  # 2 layers x 7 projections x (lora_a, lora_b): all Tunix saves of the model
    trainer, restored = resume(str(tmp_path / writer), tmp_path / writer, reader, MESH8, lora=True)
    assert restored["step"] == 2
    assert_equal({p: x for p, x in restored["params"].items() if p in lora_params}, lora_params)
    assert_equal(restored["state"], flat(opt_state(written)))
    assert_equal(flat(nnx.state(trainer.model, nnx.LoRAParam)), expected[0])
    assert_equal(flat(opt_state(trainer)), expected[1])
    saved[writer] = lora_params, flat(opt_state(written))
  # The PeftTrainer's LoRA checkpoint at data-parallel 4: restored exactly, then within assert_close.
  lora_params, state = saved["PeftTrainer"]
  trainer, restored = resume(str(tmp_path / "PeftTrainer"), tmp_path / "dp4", "Zero1PeftTrainer", MESH4,
                             lora=True)
  assert_equal({p: x for p, x in restored["params"].items() if p in lora_params}, lora_params)
  assert_equal(restored["state"], state)
  assert_close(flat(nnx.state(trainer.model, nnx.LoRAParam)), expected[0])
  assert_close(flat(opt_state(trainer)), expected[1])
  assert bytes_on_first_device(trainer.optimizer.opt_state[0].mu, MESH4) * 4 == bytes_on_first_device(
      nnx.state(trainer.model, nnx.LoRAParam), MESH4)


def test_bfloat16_state_checkpoints_cross_both_ways_cast_by_orbax(full, tmp_path):
  """``zero1_state_dtype=jnp.bfloat16`` saves bfloat16 moments; Tunix's restore casts to the reader's dtype:
  float32 -> bfloat16 rounded to nearest, bfloat16 -> float32 exactly. Both continue training."""
  _, _, written = full
  root, _, f32_state = written["PeftTrainer"]
  narrow, restored = resume(root, tmp_path, "Zero1PeftTrainer", MESH8, zero1_state_dtype=jnp.bfloat16)
  narrowed = {p: x if x.ndim == 0 else x.astype(jnp.bfloat16) for p, x in f32_state.items()}
  assert_equal(restored["state"], narrowed)
  assert {str(x.dtype) for p, x in flat(opt_state(narrow)).items() if "mu" in str(p) or "nu" in str(p)} == {
      "bfloat16"}
  bf16_root = tmp_path / "bf16-writer"
  writer, _ = run(Zero1PeftTrainer, MESH8, bf16_root, steps=2, zero1_state_dtype=jnp.bfloat16)
  bf16_state = flat(opt_state(writer))
  wide, restored = resume(str(bf16_root), tmp_path, "PeftTrainer", MESH8)
  widened = {p: x if x.ndim == 0 else x.astype(np.float32) for p, x in bf16_state.items()}
  assert_equal(restored["state"], widened)
  assert type(wide.optimizer) is nnx.Optimizer


def test_master_weights_checkpoints_resume_into_master_weights_and_are_refused_elsewhere(tmp_path):
  """``zero1_master_dtype=jnp.float32`` adds ``master_params`` to the saved optimizer state: a Zero-1 trainer
  with the option resumes it exactly; Tunix's restore into a trainer without it (or the reverse) is refused by
  orbax, the trees differ."""
  masters = {"model": bf16_qwen3, "zero1_master_dtype": jnp.float32}
  writer, _ = run(Zero1PeftTrainer, MESH8, tmp_path / "master", steps=2, **masters)
  saved = flat(opt_state(writer))
  assert any("master_params" in str(p) for p in saved)
  trainer, restored = resume(str(tmp_path / "master"), tmp_path, "Zero1PeftTrainer", MESH8, **masters)
  assert restored["step"] == 2
  assert_equal(restored["state"], saved)
  assert_equal(restored["params"], flat(writer.model))
  reference, _ = run(Zero1PeftTrainer, MESH8, tmp_path / "reference", steps=4, **masters)
  assert_equal(flat(trainer.model), flat(reference.model))  # continued as if never stopped
  assert_equal(flat(opt_state(trainer)), flat(opt_state(reference)))
  mismatch = "tree structures do not match(.|\n)*master_params"
  config = peft_trainer.TrainingConfig(
      eval_every_n_steps=1000,
      data_sharding_axis=("data",),
      checkpoint_root_directory=str(tmp_path / "master"),
  )
  with pytest.raises(ValueError, match=mismatch), MESH8:
    PeftTrainer(bf16_qwen3(MESH8), optax.adamw(1e-2), config)
  run(PeftTrainer, MESH8, tmp_path / "plain", steps=0, model=bf16_qwen3)  # saves its step 0, compiles nothing
  with pytest.raises(ValueError, match=mismatch):
    resume(str(tmp_path / "plain"), tmp_path / "from-plain", "Zero1PeftTrainer", MESH8, **masters)


PROMPTS = ["hello world", "My name", "hello there", "input string"] * 2  # 2 steps of 4 prompts


def grpo(cls, ckpt_dir, *, steps: int, mesh=MESH8):
  """GRPO's actor trained to ``steps`` by ``cls`` (RLCluster or its swap) on ``mesh``, restoring ``ckpt_dir``
  first."""
  vocab = test_common.MockVocab()
  config = dataclasses.replace(CONFIG, vocab_size=vocab.GetPieceSize())
  roles = (rl_cluster_lib.Role.ACTOR, rl_cluster_lib.Role.REFERENCE, rl_cluster_lib.Role.ROLLOUT)
  cluster_config = grpo_cluster_config(mesh, roles, max_steps=steps, data_sharding_axis=("data",),
                                       checkpoint_root_directory=str(ckpt_dir), pbar_description=None)
  with nnx.use_eager_sharding(False):
    actor, reference = (place(llama3.Llama3(config, rngs=nnx.Rngs(0)), mesh) for _ in range(2))
  cluster = cls(actor=actor, reference=reference, tokenizer=vocab, cluster_config=cluster_config)
  restored = cluster.actor_trainer.train_steps
  reward = lambda prompts, completions, **kwargs: np.array([-len(c.split()) for c in completions], np.float32)
  algo = grpo_learner.GRPOConfig(num_generations=2, num_iterations=1)
  data = grain.MapDataset.source(PROMPTS).batch(4).map(lambda x: {"prompts": x, "answer": x})
  grpo_learner.GRPOLearner(rl_cluster=cluster, reward_fns=reward, algo_config=algo).train(data, None)
  assert cluster.actor_trainer.train_steps == steps
  return cluster.actor_trainer, restored


def test_grpo_actor_checkpoints_cross_both_ways_and_continue_bit_identically(tmp_path):
  reference, _ = grpo(rl_cluster_lib.RLCluster, tmp_path / "reference", steps=2)
  classes = {"RLCluster": rl_cluster_lib.RLCluster, "Zero1RLCluster": Zero1RLCluster}
  for writer, reader in (("RLCluster", "Zero1RLCluster"), ("Zero1RLCluster", "RLCluster")):
    written, _ = grpo(classes[writer], tmp_path / writer, steps=1)
    assert not np.array_equal(*(np.asarray(t.model.lm_head.w[...]) for t in (written, reference)))
    shutil.copytree(tmp_path / writer, tmp_path / f"{writer}-step1")  # for the data-parallel 4 resume
    resumed, restored = grpo(classes[reader], tmp_path / writer, steps=2)
    assert restored == 1
    assert_equal(flat(resumed.model), flat(reference.model))
    assert_equal(flat(opt_state(resumed)), flat(opt_state(reference)))
    split = 8 if reader == "Zero1RLCluster" else 1  # the Zero-1 actor's moments: an eighth per device
    params_bytes = bytes_on_first_device(nnx.state(resumed.model, nnx.Param), MESH8)
    assert bytes_on_first_device(resumed.optimizer.opt_state[0].mu, MESH8) * split == params_bytes
  # The Zero1RLCluster's step-1 checkpoint at data-parallel 4: the same step 2, within assert_close.
  resumed, restored = grpo(Zero1RLCluster, tmp_path / "Zero1RLCluster-step1", steps=2, mesh=MESH4)
  assert restored == 1
  assert_close(flat(resumed.model), flat(reference.model))
  assert_close(flat(opt_state(resumed)), flat(opt_state(reference)))
  params_bytes = bytes_on_first_device(nnx.state(resumed.model, nnx.Param), MESH4)
  assert bytes_on_first_device(resumed.optimizer.opt_state[0].mu, MESH4) * 4 == params_bytes
