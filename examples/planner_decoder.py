"""A user's own decoder for the planner: ``--model examples.planner_decoder:build`` from the repository root.

Twelve pre-norm layers (causal attention, 16 heads, a SwiGLU MLP), d_model 1024, vocabulary 32,000,
an untied head, float32: 266.9M parameters. The planner calls ``build`` under ``nnx.eval_shape`` (no
weights are made) at 2 and 4 layers and at its default depth, and scores the logits against the next
tokens::

  python -m nnx_zero1.plan --model examples.planner_decoder:build --topology h100:4 --steps one --search
"""

import jax
import jax.numpy as jnp
from flax import nnx


class Block(nnx.Module):
  """One pre-norm decoder layer: causal self-attention, then a SwiGLU MLP, each added to its input."""

  def __init__(self, width: int, heads: int, hidden: int, *, rngs: nnx.Rngs):
    self.heads = heads
    self.attn_norm, self.mlp_norm = nnx.RMSNorm(width, rngs=rngs), nnx.RMSNorm(width, rngs=rngs)
    self.qkv = nnx.Linear(width, 3 * width, use_bias=False, rngs=rngs)
    self.out = nnx.Linear(width, width, use_bias=False, rngs=rngs)
    self.gate_up = nnx.Linear(width, 2 * hidden, use_bias=False, rngs=rngs)
    self.down = nnx.Linear(hidden, width, use_bias=False, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    batch, length, width = x.shape
    q, k, v = jnp.split(self.qkv(self.attn_norm(x)), 3, axis=-1)
    heads = lambda t: t.reshape(batch, length, self.heads, width // self.heads)
    attended = jax.nn.dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
    x = x + self.out(attended.reshape(batch, length, width))
    gate, up = jnp.split(self.gate_up(self.mlp_norm(x)), 2, axis=-1)
    return x + self.down(jax.nn.silu(gate) * up)


class Decoder(nnx.Module):
  """Token embedding, ``num_layers`` blocks, a final norm and an untied head to the vocabulary."""

  def __init__(self, num_layers: int, *, vocab: int = 32_000, width: int = 1024, heads: int = 16,
               hidden: int = 4096, rngs: nnx.Rngs):
    self.embed = nnx.Embed(vocab, width, rngs=rngs)
    self.blocks = nnx.List([Block(width, heads, hidden, rngs=rngs) for _ in range(num_layers)])
    self.norm = nnx.RMSNorm(width, rngs=rngs)
    self.head = nnx.Linear(width, vocab, use_bias=False, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x)
    return self.head(self.norm(x))


def build(num_layers: int = 12) -> Decoder:
  """The planner's entry point: the decoder at ``num_layers`` (its default is the full depth)."""
  return Decoder(num_layers, rngs=nnx.Rngs(0))
