"""Your own MaxText-style engine (``fwd_bwd`` per micro-batch, ``update`` per step) given Zero-1 by
``Zero1EngineMixin``, on 8 virtual CPU devices: losses, optimizer bytes per device and each kernel's
collectives, with and without the mixin.

  python examples/maxtext_style_engine.py [--steps N] [--accumulate GA]
"""

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):  # 8 CPU devices
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import argparse  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from nnx_zero1 import bytes_per_device  # noqa: E402
from nnx_zero1.adapters.maxtext import Zero1EngineMixin  # noqa: E402
from nnx_zero1.testing import collectives  # noqa: E402

VOCAB, SEQ = 64, 16


class MyEngine:
  """A plain engine: gradients summed over micro-batches, the optimizer applied once per step.

  It builds its optimizer through ``_make_optimizer`` and keeps its gradient sum on
  ``_gradient_targets()``: the two hooks ``Zero1EngineMixin`` answers with Zero-1.
  """

  def __init__(self, model, tx, mesh, *, loss_fn):
    self.mesh, self.wrt, self.data_axis, self.strict = mesh, nnx.Param, "data", False
    nnx.update(model, jax.device_put(nnx.state(model), NamedSharding(mesh, P())))  # replicated
    self.model, self.optimizer = model, self._make_optimizer(model, tx)
    targets = self._gradient_targets()
    params = nnx.state(model, self.wrt)
    self._zeros = lambda: jax.tree.unflatten(jax.tree.structure(params), [
        jax.device_put(jnp.zeros(p.shape, p.dtype), t) for p, t in zip(jax.tree.leaves(params), targets)])
    self.grad_sum, self.micro_steps = self._zeros(), 0

    def fwd_bwd(model, grad_sum, batch):
      loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
      summed = [jax.sharding.reshard(s + g, t)
                for s, g, t in zip(jax.tree.leaves(grad_sum), jax.tree.leaves(grads), targets)]
      return loss, jax.tree.unflatten(jax.tree.structure(grad_sum), summed)

    def update(model, optimizer, grad_sum, micro_steps):
      optimizer.update(model, jax.tree.map(lambda s: s / micro_steps, grad_sum))

    self._fwd_bwd, self._update = nnx.jit(fwd_bwd), nnx.jit(update)

  def _make_optimizer(self, model, tx):
    return nnx.Optimizer(model, tx, wrt=self.wrt)

  def _gradient_targets(self):
    return tuple(p.sharding for p in jax.tree.leaves(nnx.state(self.model, self.wrt)))

  def fwd_bwd(self, batch):
    batch = jax.device_put(batch, NamedSharding(self.mesh, P(self.data_axis)))
    loss, self.grad_sum = self._fwd_bwd(self.model, self.grad_sum, batch)
    self.micro_steps += 1
    return loss

  def update(self):
    self._update(self.model, self.optimizer, self.grad_sum, jnp.float32(self.micro_steps))
    self.grad_sum, self.micro_steps = self._zeros(), 0

  def kernel_collectives(self, batch):
    batch = jax.device_put(batch, NamedSharding(self.mesh, P(self.data_axis)))
    lowered = (self._fwd_bwd.lower(self.model, self.grad_sum, batch),
               self._update.lower(self.model, self.optimizer, self.grad_sum, jnp.float32(1)))
    texts = [kernel.compile().as_text() for kernel in lowered]
    return [", ".join(f"{op} x{c['count']}" for op, c in collectives(t).items() if c["count"]) or "none"
            for t in texts]


class MyZero1Engine(Zero1EngineMixin, MyEngine):  # the mixin goes first; nothing else changes
  pass


def loss_fn(model, batch):
  logits = model(jax.nn.one_hot(batch[:, :-1], VOCAB)).reshape(-1, SEQ, VOCAB)
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def main(steps: int, accumulate: int) -> None:
  mesh = jax.make_mesh((8,), ("data",))
  rng = np.random.default_rng(0)
  batches = [rng.integers(0, VOCAB, (16, SEQ + 1)).astype(np.int32) for _ in range(steps * accumulate)]
  engines = {}
  for cls in (MyEngine, MyZero1Engine):
    model = nnx.Sequential(nnx.Linear(VOCAB, 128, rngs=nnx.Rngs(0)), nnx.gelu,
                           nnx.Linear(128, VOCAB, rngs=nnx.Rngs(1)))
    engine = engines[cls.__name__] = cls(model, optax.adamw(1e-2), mesh, loss_fn=loss_fn)
    for step in range(steps):
      losses = [float(engine.fwd_bwd(b)) for b in batches[step * accumulate:(step + 1) * accumulate]]
      engine.update()
    fwd_bwd, update = engine.kernel_collectives(batches[0])
    print(f"{cls.__name__:13s} last loss {losses[-1]:.6f}  optimizer bytes per device "
          f"{bytes_per_device(nnx.state(engine.optimizer)):,}  fwd_bwd: {fwd_bwd}  update: {update}")
  plain, zero1 = (jax.tree.leaves(nnx.state(e.model, nnx.Param)) for e in engines.values())
  print("parameters bit-identical:", all(np.array_equal(a, b) for a, b in zip(plain, zero1)))


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--accumulate", type=int, default=4)
  args = parser.parse_args()
  main(args.steps, args.accumulate)
