"""LoRA SFT of Tunix's toy transformer with Zero1PeftTrainer on 8 virtual CPU devices.

Mesh ("data", "fsdp", "tp") = (2, 2, 2); the batch is split over ("data", "fsdp")
(``data_sharding_axis``), the LoRA weights over fsdp/tp as their metadata says, and
the Adam moments over the batch axes too: Zero-1 splits what FSDP leaves whole (the
report marks what FSDP already split). The only change from a plain Tunix script is
the trainer's class name.

  python examples/tunix_lora_sft.py [--steps N] [--grad-accum K] [--tiny]

``--tiny`` (or NNX_ZERO1_TINY=1) runs one layer for a few steps, for CI.
"""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import argparse  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from tunix.sft import peft_trainer  # noqa: E402
from tunix.tests import test_common  # noqa: E402  (sets flax_always_shard_variable=False, as Tunix does)

from nnx_zero1 import report  # noqa: E402
from nnx_zero1.adapters.tunix import Zero1PeftTrainer  # noqa: E402

VOCAB, SEQ, BATCH = 256, 16, 8


def lora_model(num_layers: int, mesh: jax.sharding.Mesh) -> nnx.Module:
  """ToyTransformer with LoRA on its MLPs, every array placed on ``mesh`` as its metadata says."""
  model = test_common.ToyTransformer(test_common.ModelConfig(num_layers=num_layers), rngs=nnx.Rngs(0))
  model = test_common.get_lora_model(model)
  state = nnx.state(model)
  specs = nnx.get_partition_spec(state)
  targets = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)
  nnx.update(model, jax.device_put(state, targets))
  return model


def counting_batches(n: int, seed: int = 0) -> list[peft_trainer.TrainingInput]:
  """Sequences that count up from a random start: next token = token + 1 (learnable by LoRA)."""
  starts = np.random.default_rng(seed).integers(0, VOCAB, (n, BATCH, 1))
  tokens = ((starts + np.arange(SEQ)) % VOCAB).astype(np.int32)
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


def main(steps: int, grad_accum: int | None, num_layers: int) -> None:
  mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tp"), axis_types=(AxisType.Auto,) * 3)
  config = peft_trainer.TrainingConfig(
      eval_every_n_steps=steps,
      max_steps=steps,
      gradient_accumulation_steps=grad_accum,
      data_sharding_axis=(("data", "fsdp"),),
      pbar_description=None,
  )
  with jax.set_mesh(mesh):
    trainer = Zero1PeftTrainer(lora_model(num_layers, mesh), optax.adamw(3e-2), config)
    trainer = trainer.with_gen_model_input_fn(model_input)
    trainer.train(counting_batches(steps * (grad_accum or 1)))
  losses = trainer.metrics_logger.get_metric_history("", "loss", "train")
  for step, loss in enumerate(losses, 1):
    print(f"step {step:3d}  loss {float(loss):.4f}")
  print(report(trainer.optimizer))


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--steps", type=int, default=30)
  parser.add_argument("--grad-accum", type=int, default=None)
  parser.add_argument("--tiny", action="store_true", default=os.environ.get("NNX_ZERO1_TINY") == "1")
  args = parser.parse_args()
  if args.tiny:
    main(steps=3, grad_accum=args.grad_accum, num_layers=1)
  else:
    main(steps=args.steps, grad_accum=args.grad_accum, num_layers=4)
