"""A small decoder-only transformer with a modern LLM's shape, built in code.

RMSNorm, rotary attention with grouped-query heads (optional q/k norm, as in
Qwen3 and Gemma 3), a SwiGLU MLP, optional sandwich norms (Gemma 2/3), and
tied or untied embeddings. ``CONFIGS`` names sizes from ``tiny`` (CI smoke)
through ``base`` (a few million parameters, the CPU default) up to real
model shapes for an accelerator.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from nnx_zero1._src.specs import padded_entries

__all__ = ["Config", "CONFIGS", "Transformer", "loss_fn", "count_params", "register_config"]


@dataclasses.dataclass(frozen=True)
class Config:
  """The shape of a decoder-only transformer.

  Example::

    >>> Config(vocab=256, dim=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffn=128).tied
    True
  """

  vocab: int
  dim: int
  layers: int
  heads: int
  kv_heads: int
  head_dim: int
  ffn: int
  tied: bool = True
  qk_norm: bool = False
  sandwich_norms: bool = False  # Gemma 2/3: a norm after attention and after the MLP too
  rope_theta: float = 10_000.0
  seq_len: int = 64  # the bench's sequence length for this size
  # One Block traced and compiled once, its parameters stacked on a leading layer axis (MaxText's
  # scan_layers): the real shapes compile in minutes instead of tens. The CPU sizes keep a list
  # of blocks, so their numbers stay comparable across releases.
  scan_layers: bool = False
  # Every layer recomputed in the backward pass instead of storing its activations (nnx.remat;
  # MaxText's remat_policy=full): only each layer's input stays live between the passes.
  remat: bool = False


CONFIGS: dict[str, Config] = {
    # CPU sizes: every dimension divides by 16, so Zero-1 splits every moment.
    "tiny": Config(vocab=256, dim=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffn=128, seq_len=32),
    "small": Config(vocab=1024, dim=128, layers=4, heads=4, kv_heads=2, head_dim=32, ffn=384, seq_len=64),
    # A byte-level language model of 1.0M parameters (benchmarks.across --corpus stdlib).
    "byte-1m": Config(vocab=256, dim=128, layers=4, heads=4, kv_heads=2, head_dim=32, ffn=512, seq_len=64),
    "base": Config(vocab=4096, dim=256, layers=4, heads=8, kv_heads=4, head_dim=32, ffn=512, seq_len=64),
    # The CI's ahead-of-time compile for 4 TPU chips: each Zero-1 slice at dp=4 fills whole TPU
    # tiles (8 x 128 float32), so the compiler's bytes are the layout rule's, with no padding.
    "tiny-aot": Config(vocab=512, dim=512, layers=2, heads=4, kv_heads=2, head_dim=64, ffn=512, seq_len=16),
    # Accelerator sizes: the published shapes of real models (weights not needed).
    "qwen3-0.6b": Config(vocab=151936, dim=1024, layers=28, heads=16, kv_heads=8, head_dim=128,
                         ffn=3072, qk_norm=True, rope_theta=1e6, seq_len=2048, scan_layers=True),
    "qwen3-8b": Config(vocab=151936, dim=4096, layers=36, heads=32, kv_heads=8, head_dim=128,
                       ffn=12288, tied=False, qk_norm=True, rope_theta=1e6, seq_len=4096, scan_layers=True),
    "llama-3.2-1b": Config(vocab=128256, dim=2048, layers=16, heads=32, kv_heads=8, head_dim=64,
                           ffn=8192, rope_theta=5e5, seq_len=2048, scan_layers=True),
    "llama-3.1-8b": Config(vocab=128256, dim=4096, layers=32, heads=32, kv_heads=8, head_dim=128,
                           ffn=14336, tied=False, rope_theta=5e5, seq_len=4096, scan_layers=True),
    "gemma-2-2b": Config(vocab=256000, dim=2304, layers=26, heads=8, kv_heads=4, head_dim=256,
                         ffn=9216, sandwich_norms=True, seq_len=2048, scan_layers=True),
    "gemma-3-1b": Config(vocab=262144, dim=1152, layers=26, heads=4, kv_heads=1, head_dim=256,
                         ffn=6912, qk_norm=True, sandwich_norms=True, rope_theta=1e6, seq_len=2048,
                         scan_layers=True),
}


def register_config(path: str) -> str:
  """Adds the model shape in a JSON file of :class:`Config` fields to ``CONFIGS``; returns its name.

  The name is the file's, without ``.json``: ``my-model.json`` -> ``"my-model"``.

  Example::

    name = register_config("my-model.json")  # {"vocab": 32000, "dim": 2048, "layers": 24, ...}
    CONFIGS[name].scan_layers

  Raises:
    ValueError: the file names a field ``Config`` does not have, or misses a required one.
  """
  import json
  import os

  with open(path) as f:
    fields = json.load(f)
  known = {f.name for f in dataclasses.fields(Config)}
  unknown = sorted(set(fields) - known)
  if unknown:
    raise ValueError(f"{path}: unknown Config fields {unknown}; known: {sorted(known)}")
  try:
    cfg = Config(**fields)
  except TypeError as e:
    raise ValueError(f"{path}: {e}") from None
  name = os.path.splitext(os.path.basename(path))[0]
  CONFIGS[name] = cfg
  return name


class RMSNorm(nnx.Module):
  """Root-mean-square normalisation with a learned scale, computed in float32.

  Example::

    >>> RMSNorm(8)(jnp.ones((2, 8))).shape
    (2, 8)
  """

  def __init__(self, dim: int, eps: float = 1e-6):
    self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (normed * self.scale[...]).astype(x.dtype)


def rotate(x: jax.Array, theta: float) -> jax.Array:
  """Rotary position embedding of ``x`` shaped (batch, seq, heads, head_dim).

  Example::

    >>> rotate(jnp.ones((1, 3, 2, 4)), 10_000.0).shape
    (1, 3, 2, 4)
  """
  half = x.shape[-1] // 2
  freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angles = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * freqs  # (seq, half)
  sin, cos = jnp.sin(angles)[None, :, None], jnp.cos(angles)[None, :, None]
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _linear(n_in: int, n_out: int, rngs: nnx.Rngs) -> nnx.Linear:
  return nnx.Linear(n_in, n_out, use_bias=False, rngs=rngs)


class Attention(nnx.Module):
  """Causal grouped-query self-attention with rotary positions (and q/k norms if configured).

  Example::

    >>> attn = Attention(CONFIGS["tiny"], nnx.Rngs(0))
    >>> attn(jnp.ones((2, 8, 64))).shape
    (2, 8, 64)
  """

  def __init__(self, cfg: Config, rngs: nnx.Rngs):
    self.cfg = cfg
    self.q = _linear(cfg.dim, cfg.heads * cfg.head_dim, rngs)
    self.k = _linear(cfg.dim, cfg.kv_heads * cfg.head_dim, rngs)
    self.v = _linear(cfg.dim, cfg.kv_heads * cfg.head_dim, rngs)
    self.o = _linear(cfg.heads * cfg.head_dim, cfg.dim, rngs)
    self.q_norm = RMSNorm(cfg.head_dim) if cfg.qk_norm else None
    self.k_norm = RMSNorm(cfg.head_dim) if cfg.qk_norm else None

  def __call__(self, x: jax.Array) -> jax.Array:
    cfg, (b, t, _) = self.cfg, x.shape
    q = self.q(x).reshape(b, t, cfg.heads, cfg.head_dim)
    k = self.k(x).reshape(b, t, cfg.kv_heads, cfg.head_dim)
    v = self.v(x).reshape(b, t, cfg.kv_heads, cfg.head_dim)
    if self.q_norm is not None and self.k_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    q, k = rotate(q, cfg.rope_theta), rotate(k, cfg.rope_theta)
    out = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    return self.o(out.reshape(b, t, cfg.heads * cfg.head_dim))


class SwiGLU(nnx.Module):
  """The gated MLP of Llama-family models: ``down(silu(gate(x)) * up(x))``.

  Example::

    >>> SwiGLU(CONFIGS["tiny"], nnx.Rngs(0))(jnp.ones((2, 64))).shape
    (2, 64)
  """

  def __init__(self, cfg: Config, rngs: nnx.Rngs):
    self.gate = _linear(cfg.dim, cfg.ffn, rngs)
    self.up = _linear(cfg.dim, cfg.ffn, rngs)
    self.down = _linear(cfg.ffn, cfg.dim, rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
  """One pre-norm decoder layer (with Gemma-style sandwich norms when configured).

  Example::

    >>> Block(CONFIGS["tiny"], nnx.Rngs(0))(jnp.ones((1, 4, 64))).shape
    (1, 4, 64)
  """

  def __init__(self, cfg: Config, rngs: nnx.Rngs):
    self.attn_norm = RMSNorm(cfg.dim)
    self.attn = Attention(cfg, rngs)
    self.mlp_norm = RMSNorm(cfg.dim)
    self.mlp = SwiGLU(cfg, rngs)
    self.post_attn_norm = RMSNorm(cfg.dim) if cfg.sandwich_norms else None
    self.post_mlp_norm = RMSNorm(cfg.dim) if cfg.sandwich_norms else None

  def __call__(self, x: jax.Array) -> jax.Array:
    h = self.attn(self.attn_norm(x))
    x = x + (self.post_attn_norm(h) if self.post_attn_norm is not None else h)
    h = self.mlp(self.mlp_norm(x))
    return x + (self.post_mlp_norm(h) if self.post_mlp_norm is not None else h)


def _stacked_blocks(cfg: Config, rngs: nnx.Rngs) -> Block:
  """``cfg.layers`` blocks as one ``Block`` whose parameters have a leading layer axis."""
  @nnx.split_rngs(splits=cfg.layers)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def make(rngs: nnx.Rngs) -> Block:
    return Block(cfg, rngs)

  return make(rngs)


def _apply(block: Block, x: jax.Array) -> jax.Array:
  return block(x)


def _layer_fn(remat: bool):
  """``(block, x) -> block(x)``, recomputed in the backward pass when ``remat``."""
  return nnx.remat(_apply) if remat else _apply


def _scan_blocks(blocks: Block, x: jax.Array, remat: bool = False) -> jax.Array:
  """Applies stacked blocks in order, one ``lax.scan`` step per layer (each rematerialised with ``remat``)."""
  apply = _layer_fn(remat)

  @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
  def layer(block: Block, x: jax.Array) -> jax.Array:
    return apply(block, x)

  return layer(blocks, x)


class Transformer(nnx.Module):
  """Token ids (batch, seq) -> logits (batch, seq, vocab).

  Example::

    >>> model = Transformer(CONFIGS["tiny"], rngs=nnx.Rngs(0))
    >>> model(jnp.zeros((2, 8), jnp.int32)).shape
    (2, 8, 256)
  """

  def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = nnx.Embed(cfg.vocab, cfg.dim, rngs=rngs)
    self.blocks = _stacked_blocks(cfg, rngs) if cfg.scan_layers else nnx.List(
        [Block(cfg, rngs) for _ in range(cfg.layers)])
    self.final_norm = RMSNorm(cfg.dim)
    self.lm_head = None if cfg.tied else _linear(cfg.dim, cfg.vocab, rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    # With ids sharded on an Explicit mesh the lookup must be told its output layout (the ids'
    # plus features); on Auto meshes and inside shard_map the ids' type carries no axes.
    entries = padded_entries(jax.typeof(tokens).sharding.spec, tokens.ndim)
    x = self.embed(tokens, out_sharding=P(*entries, None)) if any(entries) else self.embed(tokens)
    if isinstance(self.blocks, Block):  # stacked: cfg.scan_layers
      x = _scan_blocks(self.blocks, x, self.cfg.remat)
    else:
      apply = _layer_fn(self.cfg.remat)
      for block in self.blocks:
        x = apply(block, x)
    x = self.final_norm(x)
    return self.embed.attend(x) if self.lm_head is None else self.lm_head(x)


def loss_fn(model: Transformer, tokens: jax.Array) -> jax.Array:
  """Mean next-token cross-entropy of ``tokens`` shaped (batch, seq + 1).

  Example::

    >>> model = Transformer(CONFIGS["tiny"], rngs=nnx.Rngs(0))
    >>> float(loss_fn(model, jnp.zeros((2, 9), jnp.int32))) > 0
    True
  """
  logits = model(tokens[:, :-1]).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def count_params(cfg: Config) -> int:
  """How many parameters a model of this shape has (computed abstractly, no memory).

  Example::

    >>> count_params(CONFIGS["tiny"])
    90432
  """
  abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  return sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
