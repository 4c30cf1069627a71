"""Tunix's real ``Qwen3`` with qwix LoRA: ``Zero1PeftTrainer`` bit-identical to ``PeftTrainer`` (issue 25).

Mesh ``("data", "fsdp", "tp") = (4, 1, 2)``, Auto axes (Tunix's ``Qwen3`` needs them), LoRA
rank 4 on the 7 projections, adamw, 3 steps, batch split over ``data``. Rank 4 over 4
replicas is the case that differed by 1 ulp before the layout rule preferred a dimension
keeping more than one row per device (``tests/core/test_degenerate_slices.py`` says why): the
``lora_b`` factors, ``(4, ...)`` with ``P(None, "tp")``, split dimension 0 into one row each.
"""

import jax
import numpy as np
import optax
import pytest
import qwix
from flax import nnx
from jax.sharding import AxisType

from nnx_zero1 import Zero1Optimizer
from nnx_zero1.adapters.tunix import Zero1PeftTrainer
from tests.support.tunix_toys import (  # Tunix imported with flax's flag put back
  data_parallel,
  model_input,
  peft_trainer,
  place,
  qwen3,
)

MESH = jax.make_mesh((4, 1, 2), ("data", "fsdp", "tp"), axis_types=(AxisType.Auto,) * 3)
CONFIG = data_parallel(qwen3.ModelConfig(
    num_layers=2, vocab_size=128, embed_dim=64, hidden_dim=128, num_heads=4, head_dim=16,
    num_kv_heads=2, rope_theta=10_000, norm_eps=1e-6,
))
PROJECTIONS = ".*q_proj|.*k_proj|.*v_proj|.*o_proj|.*gate_proj|.*up_proj|.*down_proj"
STEPS = 3


def batches(n: int, batch: int = 8, length: int = 16) -> list:
  rng = np.random.default_rng(0)
  tokens = [rng.integers(1, CONFIG.vocab_size, (batch, length)).astype(np.int32) for _ in range(n)]
  return [peft_trainer.TrainingInput(input_tokens=t, input_mask=np.ones(t.shape, bool)) for t in tokens]


def lora_qwen3() -> nnx.Module:
  with nnx.use_eager_sharding(False):
    model = qwen3.Qwen3(CONFIG, rngs=nnx.Rngs(0))
    x = model_input(batches(1)[0])
    provider = qwix.LoraProvider(module_path=PROJECTIONS, rank=4, alpha=2.0)
    model = qwix.apply_lora_to_model(
        model, provider, x["input_tokens"], x["positions"], None, x["attention_mask"]
    )
  return place(model, MESH)


@pytest.fixture(scope="module")
def trainers():
  out = {}
  for cls in (peft_trainer.PeftTrainer, Zero1PeftTrainer):
    config = peft_trainer.TrainingConfig(
        eval_every_n_steps=1000, max_steps=STEPS, data_sharding_axis=("data",)
    )
    with MESH:
      trainer = cls(lora_qwen3(), optax.adamw(1e-3), config).with_gen_model_input_fn(model_input)
      trainer.train(batches(STEPS))
    out[cls] = trainer
  return out[peft_trainer.PeftTrainer], out[Zero1PeftTrainer]


def flat(tree) -> dict:
  return {path: np.asarray(v[...]) for path, v in nnx.to_flat_state(tree)}


def test_every_lora_parameter_and_loss_is_bit_identical(trainers):
  plain, zero1 = trainers
  assert isinstance(zero1.optimizer, Zero1Optimizer) and type(plain.optimizer) is nnx.Optimizer
  assert zero1.train_steps == plain.train_steps == STEPS
  a, b = flat(nnx.state(plain.model, nnx.LoRAParam)), flat(nnx.state(zero1.model, nnx.LoRAParam))
  assert len(a) == 28 and a.keys() == b.keys()  # 2 layers x 7 projections x (lora_a, lora_b)
  for path in a:
    np.testing.assert_array_equal(b[path], a[path], err_msg=str(path))
  losses = [t.metrics_logger.get_metric_history("", "loss", "train") for t in (plain, zero1)]
  assert len(losses[0]) == STEPS
  np.testing.assert_array_equal(losses[1], losses[0])


def _bytes_on_first_device(tree) -> int:
  device = MESH.devices.flat[0]
  return sum(
      s.data.nbytes
      for x in jax.tree.leaves(nnx.as_pure(tree))
      for s in x.addressable_shards
      if s.device == device
  )


def test_moments_are_split_over_data(trainers):
  """Each moment holds a quarter of its parameter's bytes per device (the parameters keep their
  layout; nnx.Optimizer's own moments drift to other layouts on an Auto mesh, so they are no
  reference)."""
  _, zero1 = trainers
  params = _bytes_on_first_device(nnx.state(zero1.model, nnx.LoRAParam))
  for name in ("mu", "nu"):
    moments = getattr(zero1.optimizer.opt_state[0], name)
    assert _bytes_on_first_device(moments) * 4 == params, name
    lora_b = {p: x for p, x in nnx.to_flat_state(moments) if "lora_b" in str(p[-1])}
    assert len(lora_b) == 14
    for path, x in lora_b.items():  # the rank dimension stays whole: no slice of one row
      assert x[...].addressable_shards[0].data.shape[0] == 4, (path, x[...].sharding.spec)
