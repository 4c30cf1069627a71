"""Quickstart: train a small NNX model with nnx.Optimizer and with Zero1Optimizer
on 8 virtual CPU devices and compare losses and optimizer bytes per device.

  python examples/quickstart.py [--steps N]
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
from jax.sharding import PartitionSpec as P  # noqa: E402

from nnx_zero1 import Zero1Optimizer, bytes_per_device, report  # noqa: E402


class MLP(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.up = nnx.Linear(64, 256, rngs=rngs)
    self.down = nnx.Linear(256, 64, rngs=rngs)
    self.head = nnx.Linear(64, 10, rngs=rngs)

  def __call__(self, x):
    return self.head(x + self.down(jax.nn.gelu(self.up(x))))


@nnx.jit
def train_step(model, optimizer, x, y):
  def loss_fn(model):
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


def main(steps: int) -> None:
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))  # Auto: an nnx.Embed model trains too
  rng = np.random.default_rng(0)
  data = [(rng.standard_normal((64, 64), np.float32), rng.integers(0, 10, 64)) for _ in range(steps)]
  batch = NamedSharding(mesh, P("data"))
  results = {}
  for name, make in [
      ("nnx.Optimizer", lambda m: nnx.Optimizer(m, optax.adamw(1e-3), wrt=nnx.Param)),
      ("Zero1Optimizer", lambda m: Zero1Optimizer(m, optax.adamw(1e-3))),
  ]:
    with jax.set_mesh(mesh):
      model = MLP(nnx.Rngs(0))
      optimizer = make(model)
      losses = [float(train_step(model, optimizer, *jax.device_put((x, jnp.asarray(y)), batch)))
                for x, y in data]
    results[name] = (losses, optimizer)
    print(f"{name:15s} losses: {' '.join(f'{v:.6f}' for v in losses)}")

  plain_losses, plain = results["nnx.Optimizer"]
  zero1_losses, zero1 = results["Zero1Optimizer"]
  print(f"\nlosses bit-identical: {plain_losses == zero1_losses}\n")
  print(report(zero1))
  plain_bytes = bytes_per_device(nnx.as_pure(plain.opt_state))
  zero1_bytes = bytes_per_device(nnx.as_pure(zero1.opt_state))
  print(f"\noptimizer bytes per device: nnx.Optimizer {plain_bytes:,}  Zero1Optimizer {zero1_bytes:,}"
        f"  ({zero1_bytes / plain_bytes:.3f}x, ideal 1/8 = 0.125)")


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--steps", type=int, default=5)
  main(parser.parse_args().steps)
