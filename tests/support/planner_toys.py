"""A tiny decoder-shaped NNX model for the planner's tests: ``package.module:function`` models."""

import jax
import jax.numpy as jnp
from flax import nnx


class TinyLM(nnx.Module):
  """Embedding, ``num_layers`` residual MLP blocks, a head: the shape the planner extrapolates."""

  # Every slice of the Zero-1 layout keeps a multiple of 128 elements per device at data=4: the TPU
  # lays 1-D arrays out in 128-element tiles, so a 64-element slice of a bias occupies 128 and the
  # arguments would fall by less than the layout rule's bytes.
  def __init__(self, num_layers: int, vocab: int = 512, width: int = 512, *, rngs: nnx.Rngs,
               dtype=jnp.float32):
    kw = {"param_dtype": dtype, "dtype": dtype, "rngs": rngs}
    self.embed = nnx.Embed(vocab, width, **kw)
    self.layers = nnx.List([nnx.Linear(width, width, **kw) for _ in range(num_layers)])
    self.head = nnx.Linear(width, vocab, **kw)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = self.embed(tokens)
    for layer in self.layers:
      x = x + jax.nn.gelu(layer(x))
    return self.head(x)


def tiny_lm(num_layers: int = 6) -> TinyLM:
  """The planner's ``tests.support.planner_toys:tiny_lm``: default loss (next-token on its logits)."""
  return TinyLM(num_layers, rngs=nnx.Rngs(0))


def tiny_lm_bf16(num_layers: int = 6) -> TinyLM:
  """The same model with bfloat16 parameters and compute (the master-weights lever's case)."""
  return TinyLM(num_layers, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)


def tiny_lm_that_raises(num_layers: int = 6) -> TinyLM:
  """A builder with a mistake in it, as a user's can have: the planner names it in one line."""
  raise ValueError(f"vocab must be even, got 511 (num_layers={num_layers})")


def tiny_lm_naming_its_environment(num_layers: int = 6) -> TinyLM:
  """A builder that raises with the compilers' settings of the process building it, as JSON: what a
  planning process was started with."""
  import json
  import os

  from nnx_zero1_plan.compilers import ENV

  raise ValueError("environment " + json.dumps({key: os.environ.get(key) for key in sorted(ENV)}))


def tiny_lm_with_loss(num_layers: int = 6):
  """The same model with its own loss: ``(model, loss_fn)``."""
  loss = lambda model, tokens: jnp.mean(model(tokens[:, :-1]).astype(jnp.float32) ** 2)
  return TinyLM(num_layers, rngs=nnx.Rngs(0)), loss
