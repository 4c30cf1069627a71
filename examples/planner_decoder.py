"""A user's own decoders for the planner: ``--model examples.planner_decoder:build`` from the repository root.

``build``: twelve pre-norm layers (causal attention, 16 heads, a SwiGLU MLP), d_model 1024, vocabulary
32,000, an untied head, float32: 266.9M parameters. ``build_1b``: the same blocks at 1.21B parameters in
bfloat16 (24 layers, d_model 2048, grouped-query attention with 16 query and 4 key/value heads, SwiGLU
5632). ``build_7b``: the same blocks at 7.24B parameters in bfloat16, Llama-style (32 layers, d_model 4096,
grouped-query attention 32/8, SwiGLU 14336). ``build_llama2_7b``: Llama 2 7B's shape, 6.74B parameters in
bfloat16 (32 layers, d_model 4096, 32 heads, SwiGLU 11008). The planner calls them under ``nnx.eval_shape``
(no weights are made), at their default depth (and at reduced depths for ``--estimate``), and scores the
logits against the next tokens::

  python -m nnx_zero1.plan --model examples.planner_decoder:build --topology h100:4 --steps one --search
  python -m nnx_zero1.plan --model examples.planner_decoder:build_1b --topology h200:8 --steps one \
      --seq-len 2048 --search
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx


class SwiGLU(nnx.Module):
  """A SwiGLU MLP: ``down(silu(gate) * up)``, with ``gate`` and ``up`` from one projection."""

  def __init__(self, width: int, hidden: int, *, dtype: jnp.dtype, rngs: nnx.Rngs):
    linear = lambda n_in, n_out: nnx.Linear(n_in, n_out, use_bias=False, dtype=dtype, param_dtype=dtype,
                                            rngs=rngs)
    self.gate_up = linear(width, 2 * hidden)
    self.down = linear(hidden, width)

  def __call__(self, x: jax.Array) -> jax.Array:
    gate, up = jnp.split(self.gate_up(x), 2, axis=-1)
    return self.down(jax.nn.silu(gate) * up)


class Block(nnx.Module):
  """One pre-norm decoder layer: causal self-attention, then ``mlp`` (a SwiGLU of width ``hidden`` unless
  given), each added to its input."""

  def __init__(self, width: int, heads: int, kv_heads: int, hidden: int, *, dtype: jnp.dtype,
               rngs: nnx.Rngs, mlp: nnx.Module | None = None):
    self.heads, self.kv_heads = heads, kv_heads
    kv_width = width // heads * kv_heads
    linear = lambda n_in, n_out: nnx.Linear(n_in, n_out, use_bias=False, dtype=dtype, param_dtype=dtype,
                                            rngs=rngs)
    norm = lambda: nnx.RMSNorm(width, dtype=dtype, param_dtype=dtype, rngs=rngs)
    self.attn_norm, self.mlp_norm = norm(), norm()
    self.qkv = linear(width, width + 2 * kv_width)
    self.out = linear(width, width)
    self.mlp = SwiGLU(width, hidden, dtype=dtype, rngs=rngs) if mlp is None else mlp

  def __call__(self, x: jax.Array) -> jax.Array:
    batch, length, width = x.shape
    head_dim = width // self.heads
    q, k, v = jnp.split(self.qkv(self.attn_norm(x)), [width, width + self.kv_heads * head_dim], axis=-1)
    heads = lambda t, n: t.reshape(batch, length, n, head_dim)
    attended = jax.nn.dot_product_attention(heads(q, self.heads), heads(k, self.kv_heads),
                                            heads(v, self.kv_heads), is_causal=True)
    x = x + self.out(attended.reshape(batch, length, width))
    return x + self.mlp(self.mlp_norm(x))


class Decoder(nnx.Module):
  """Token embedding, ``num_layers`` blocks, a final norm and an untied head to the vocabulary; each block's
  MLP from ``mlp()`` where given (a Mixture-of-Experts: ``examples/planner_moe.py``)."""

  def __init__(self, num_layers: int, *, vocab: int = 32_000, width: int = 1024, heads: int = 16,
               kv_heads: int = 16, hidden: int = 4096, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs,
               mlp: Callable[[], nnx.Module] | None = None):
    self.embed = nnx.Embed(vocab, width, dtype=dtype, param_dtype=dtype, rngs=rngs)
    self.blocks = nnx.List([Block(width, heads, kv_heads, hidden, dtype=dtype, rngs=rngs,
                                  mlp=None if mlp is None else mlp())
                            for _ in range(num_layers)])
    self.norm = nnx.RMSNorm(width, dtype=dtype, param_dtype=dtype, rngs=rngs)
    self.head = nnx.Linear(width, vocab, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x)
    return self.head(self.norm(x))


def build(num_layers: int = 12) -> Decoder:
  """The 266.9M float32 decoder at ``num_layers`` (its default is the full depth)."""
  return Decoder(num_layers, rngs=nnx.Rngs(0))


def build_1b(num_layers: int = 24) -> Decoder:
  """The 1.21B bfloat16 decoder with grouped-query attention at ``num_layers`` (default: the full depth)."""
  return Decoder(num_layers, width=2048, heads=16, kv_heads=4, hidden=5632, dtype=jnp.bfloat16,
                 rngs=nnx.Rngs(0))


def build_7b(num_layers: int = 32) -> Decoder:
  """The 7.24B bfloat16 Llama-style decoder at ``num_layers`` (default: the full depth)."""
  return Decoder(num_layers, width=4096, heads=32, kv_heads=8, hidden=14336, dtype=jnp.bfloat16,
                 rngs=nnx.Rngs(0))


def build_llama2_7b(num_layers: int = 32) -> Decoder:
  """Llama 2 7B's shape, 6.74B bfloat16 parameters, at ``num_layers`` (default: the full depth)."""
  return Decoder(num_layers, width=4096, heads=32, kv_heads=32, hidden=11008, dtype=jnp.bfloat16,
                 rngs=nnx.Rngs(0))


class ScannedDecoder(nnx.Module):
  """``Decoder``'s layers stored stacked (one leading axis of ``num_layers``) and run by ``nnx.scan``, each
  layer under ``nnx.remat``: the program holds one layer's body in a loop, and its backward pass recomputes
  each layer's activations from the layer's input rather than keeping them."""

  def __init__(self, num_layers: int, *, vocab: int = 32_000, width: int = 1024, heads: int = 16,
               kv_heads: int = 16, hidden: int = 4096, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs):
    self.embed = nnx.Embed(vocab, width, dtype=dtype, param_dtype=dtype, rngs=rngs)

    @nnx.split_rngs(splits=num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def stacked(rngs: nnx.Rngs) -> Block:
      return Block(width, heads, kv_heads, hidden, dtype=dtype, rngs=rngs)

    self.blocks = stacked(rngs)
    self.norm = nnx.RMSNorm(width, dtype=dtype, param_dtype=dtype, rngs=rngs)
    self.head = nnx.Linear(width, vocab, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    @nnx.remat
    def layer(x: jax.Array, block: Block) -> jax.Array:
      return block(x)

    return self.head(self.norm(layer(self.embed(tokens), self.blocks)))


def build_scanned(num_layers: int = 12) -> ScannedDecoder:
  """``build``'s 266.9M float32 decoder, its layers scanned and rematerialised (default: the full depth)."""
  return ScannedDecoder(num_layers, rngs=nnx.Rngs(0))


def build_1b_scanned(num_layers: int = 24) -> ScannedDecoder:
  """``build_1b``'s 1.21B bfloat16 decoder, its layers scanned and rematerialised (default: full depth)."""
  return ScannedDecoder(num_layers, width=2048, heads=16, kv_heads=4, hidden=5632, dtype=jnp.bfloat16,
                        rngs=nnx.Rngs(0))
