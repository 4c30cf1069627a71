"""SFT of Tunix's own Llama3 (or Qwen3) class with Zero1PeftTrainer at data-parallel 8, LoRA or full.

The script docs/tunix.md's migration shows, on 8 virtual CPU devices and a small
configuration of the real model class (random weights, nothing downloaded). What a
Tunix user changes to train data-parallel with Zero-1 (each marked ``# Zero-1:`` or
``# data-parallel:`` below):

- the mesh has a ``data`` axis: ``("data", "fsdp", "tp") = (8, 1, 1)``;
- the model's ``ShardingConfig`` puts its activations' batch over ``("data", "fsdp")``;
- ``data_sharding_axis=(("data", "fsdp"),)``: Tunix splits each batch over both axes,
  and Zero-1 splits the optimizer state over the same axes;
- ``PeftTrainer`` -> ``Zero1PeftTrainer`` (``Zero1TrainingConfig`` carries any
  ``zero1_*`` option; a plain ``TrainingConfig`` works too).

  python examples/tunix_lora_sft.py [--model llama3|qwen3] [--full] [--steps N] [--grad-accum K] [--tiny]

LoRA (qwix, rank 16 on the 7 projections, as Tunix does it) unless ``--full``. ``--tiny`` (or
NNX_ZERO1_TINY=1) runs 2 layers for 3 steps, for CI.
"""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import argparse  # noqa: E402
import dataclasses  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import qwix  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType  # noqa: E402
from tunix.models.llama3 import model as llama3  # noqa: E402
from tunix.models.qwen3 import model as qwen3  # noqa: E402
from tunix.sft import peft_trainer  # noqa: E402

from nnx_zero1 import report  # noqa: E402
from nnx_zero1.adapters.tunix import Zero1PeftTrainer, Zero1TrainingConfig  # noqa: E402

SEQ, BATCH = 32, 16
LORA_MODULES = ".*q_proj|.*k_proj|.*v_proj|.*o_proj|.*gate_proj|.*up_proj|.*down_proj"
BATCH_AXES = ("data", "fsdp")  # data-parallel: the batch over both axes


def model_config(family: str, num_layers: int, width: int):
  """A small configuration of Tunix's class (``ModelConfig.llama3p2_1b()`` / ``qwen3_1p7b()`` on chips)."""
  module = {"llama3": llama3, "qwen3": qwen3}[family]
  config = module.ModelConfig(
      num_layers=num_layers, vocab_size=256, embed_dim=width, hidden_dim=4 * width, num_heads=4,
      head_dim=width // 4, num_kv_heads=2, rope_theta=10_000, norm_eps=1e-6,
  )
  # data-parallel: the activations' batch entry over both axes (Tunix's default names only "fsdp").
  shd = config.shd_config
  shd = dataclasses.replace(
      shd, act_btd=(BATCH_AXES, *shd.act_btd[1:]), act_btf=(BATCH_AXES, *shd.act_btf[1:]),
      act_btnh=(BATCH_AXES, *shd.act_btnh[1:]),
  )
  return module, dataclasses.replace(config, shd_config=shd)


def build_model(family: str, num_layers: int, width: int, lora: bool, mesh) -> nnx.Module:
  """Tunix's model class with random weights, LoRA'd by qwix if asked, every array placed on ``mesh``."""
  module, config = model_config(family, num_layers, width)
  model_class = {"llama3": "Llama3", "qwen3": "Qwen3"}[family]
  # Your checkpoint's weights instead, read into this config and placed on the mesh by Tunix's loader:
  # model = params.create_model_from_safe_tensors(model_dir, config, mesh)  (tunix.models.<family>.params)
  model = getattr(module, model_class)(config, rngs=nnx.Rngs(0))
  if lora:
    provider = qwix.LoraProvider(module_path=LORA_MODULES, rank=16, alpha=2.0)
    model = qwix.apply_lora_to_model(model, provider, **model.get_model_input(), rngs=nnx.Rngs(1))
  state = nnx.state(model)
  nnx.update(model, jax.device_put(state, nnx.get_named_sharding(state, mesh)))
  return model


def counting_batches(n: int, seed: int = 0) -> list[peft_trainer.TrainingInput]:
  """Sequences that count up from a random start: next token = token + 1 (learnable, LoRA included)."""
  starts = np.random.default_rng(seed).integers(0, 256, (n, BATCH, 1))
  tokens = ((starts + np.arange(SEQ)) % 256).astype(np.int32)
  return [peft_trainer.TrainingInput(input_tokens=t, input_mask=np.ones(t.shape, bool)) for t in tokens]


def model_input(x: peft_trainer.TrainingInput) -> dict:
  """What PeftTrainer's default loss passes to the model: positions and a causal mask."""
  length = x.input_tokens.shape[1]
  causal = jnp.tril(jnp.ones((length, length), bool))
  return {
      "input_tokens": x.input_tokens,
      "input_mask": x.input_mask,
      "positions": jnp.broadcast_to(jnp.arange(length), x.input_tokens.shape),
      "attention_mask": causal[None] & x.input_mask[:, None, :],
  }


def main(family: str, lora: bool, steps: int, grad_accum: int | None, num_layers: int, width: int) -> None:
  # data-parallel: 8 replicas ("data"); fsdp and tp of size 1 name the axes Tunix's ShardingConfig uses.
  # Auto axes: Tunix's Qwen3 refuses an Explicit mesh (jax.make_mesh's default).
  mesh = jax.make_mesh((8, 1, 1), ("data", "fsdp", "tp"), axis_types=(AxisType.Auto,) * 3)
  config = Zero1TrainingConfig(  # Zero-1: or Tunix's TrainingConfig, with the same fields
      eval_every_n_steps=steps,
      max_steps=steps,
      gradient_accumulation_steps=grad_accum,
      data_sharding_axis=(BATCH_AXES,),  # data-parallel: each batch over ("data", "fsdp")
      pbar_description=None,
  )
  with mesh:  # Tunix reads its mesh from this context
    model = build_model(family, num_layers, width, lora, mesh)
    trainer = Zero1PeftTrainer(model, optax.adamw(3e-3 if lora else 1e-3), config)  # Zero-1: was PeftTrainer
    trainer = trainer.with_gen_model_input_fn(model_input)
    trainer.train(counting_batches(steps * (grad_accum or 1)))
  losses = trainer.metrics_logger.get_metric_history("", "loss", "train")
  for step, loss in enumerate(losses, 1):
    print(f"step {step:3d}  loss {float(loss):.4f}")
  print(report(trainer.optimizer))


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", choices=("llama3", "qwen3"), default="llama3")
  parser.add_argument("--full", action="store_true", help="full fine-tuning instead of LoRA")
  parser.add_argument("--steps", type=int, default=30)
  parser.add_argument("--grad-accum", type=int, default=None)
  parser.add_argument("--tiny", action="store_true", default=os.environ.get("NNX_ZERO1_TINY") == "1")
  args = parser.parse_args()
  if args.tiny:
    main(args.model, not args.full, steps=3, grad_accum=args.grad_accum, num_layers=2, width=64)
  else:
    main(args.model, not args.full, steps=args.steps, grad_accum=args.grad_accum, num_layers=4, width=256)
