"""A MaxText-style engine (fwd_bwd per micro-batch, update per step) with and without Zero-1,
on 4 virtual CPU devices: losses, optimizer bytes per device, the collectives of each
kernel, and a checkpoint taken in the middle of gradient accumulation.

  python examples/maxtext_style_engine.py [--steps N] [--accumulate GA]
"""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import argparse  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from nnx_zero1 import bytes_per_device  # noqa: E402
from nnx_zero1.adapters.maxtext import Engine, Zero1Engine  # noqa: E402
from nnx_zero1.testing import collectives  # noqa: E402

VOCAB, SEQ = 64, 16


class TinyLM(nnx.Module):
  """Next-token model: embedding, a causal mean of the prefix, an MLP, tied logits.

  The engine runs ``loss_fn`` per replica inside ``shard_map``, so the model
  must work on a replica's local rows: no ops that ask for an explicit
  ``out_sharding`` (the embedding lookup is a one-hot matmul).
  """

  def __init__(self, rngs: nnx.Rngs, dim: int = 64):
    self.embed = nnx.Embed(VOCAB, dim, rngs=rngs)
    self.norm = nnx.RMSNorm(dim, rngs=rngs)
    self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
    self.down = nnx.Linear(4 * dim, dim, rngs=rngs)

  def __call__(self, tokens):
    x = jax.nn.one_hot(tokens, VOCAB) @ self.embed.embedding[...]
    prefix = jnp.cumsum(x, axis=1) / jnp.arange(1, x.shape[1] + 1)[:, None]
    x = x + self.down(jax.nn.gelu(self.up(self.norm(prefix))))
    return self.embed.attend(x)


def loss_fn(model, batch):
  tokens = batch["tokens"]
  return optax.softmax_cross_entropy_with_integer_labels(model(tokens[:, :-1]), tokens[:, 1:]).mean()


def same_params(a, b) -> bool:
  pairs = zip(jax.tree.leaves(nnx.state(a.model, nnx.Param)), jax.tree.leaves(nnx.state(b.model, nnx.Param)))
  return all(np.array_equal(x, y) for x, y in pairs)


def kernel_collectives(lowered) -> str:
  counts = collectives(lowered.compile().as_text())
  return ", ".join(f"{op} x{c['count']} ({c['bytes']:,} B)" for op, c in counts.items() if c["count"])


def main(steps: int, accumulate: int) -> None:
  mesh = jax.make_mesh((4,), ("data",))
  rng = np.random.default_rng(0)
  micro_batches = [{"tokens": rng.integers(0, VOCAB, (8, SEQ + 1)).astype(np.int32)}
                   for _ in range(steps * accumulate)]
  engines = {}
  for cls in (Engine, Zero1Engine):
    engine = cls(TinyLM(nnx.Rngs(0)), optax.adamw(1e-2), mesh, loss_fn=loss_fn)
    losses = []
    for step in range(steps):
      for batch in micro_batches[step * accumulate:(step + 1) * accumulate]:
        losses.append(float(engine.fwd_bwd(batch)))
      engine.update()
    engines[cls.__name__] = engine
    print(f"{cls.__name__:11s} losses: {' '.join(f'{v:.6f}' for v in losses[accumulate - 1::accumulate])}"
          f"  grad norm {float(engine.grad_norm):.6f}")

  plain, zero1 = engines["Engine"], engines["Zero1Engine"]
  print(f"\nparameters bit-identical: {same_params(plain, zero1)}")
  moments = [bytes_per_device(nnx.as_pure(e.optimizer.opt_state)) for e in (plain, zero1)]
  print(f"optimizer bytes per device: Engine {moments[0]:,}  Zero1Engine {moments[1]:,}"
        f"  ({moments[1] / moments[0]:.3f}x, ideal 1/4 plus the replicated step counters)\n")
  for name, engine in engines.items():
    print(f"{name:11s} fwd_bwd: {kernel_collectives(engine.lowered_fwd_bwd(micro_batches[0]))}")
    print(f"{name:11s} update:  {kernel_collectives(engine.lowered_update())}")

  with tempfile.TemporaryDirectory() as directory:
    first = Zero1Engine(TinyLM(nnx.Rngs(0)), optax.adamw(1e-2), mesh, loss_fn=loss_fn,
                        checkpoint_dir=directory)
    half = max(1, accumulate // 2)
    for batch in micro_batches[:half]:
      first.fwd_bwd(batch)
    first.save_checkpoint(0)  # accumulated gradients and the micro-batch count go with it
    for batch in micro_batches[half:accumulate]:
      first.fwd_bwd(batch)
    first.update()
    first.close()
    resumed = Engine(TinyLM(nnx.Rngs(1)), optax.adamw(1e-2), mesh, loss_fn=loss_fn,
                     checkpoint_dir=directory)  # a plain Engine restores a Zero1Engine checkpoint
    resumed.restore_checkpoint()
    for batch in micro_batches[half:accumulate]:
      resumed.fwd_bwd(batch)
    resumed.update()
    resumed.close()
    print("\nresumed from a mid-accumulation checkpoint (Zero1Engine -> Engine): same parameters:",
          same_params(first, resumed))


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--accumulate", type=int, default=4)
  args = parser.parse_args()
  main(args.steps, args.accumulate)
