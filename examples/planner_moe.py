"""A user's own Mixture-of-Experts decoder for the planner: ``--model examples.planner_moe:build``.

``build``: the decoder of :mod:`examples.planner_decoder` (pre-norm, causal grouped-query attention with 16
query and 4 key/value heads, d_model 2048, vocabulary 32,000, an untied head, bfloat16) with 16 layers whose
MLP is top-2 routing over 8 SwiGLU experts of width 5632, each expert's weights stored stacked: the gate and
up projections one ``(8, 2048, 11264)`` parameter, the down projection ``(8, 5632, 2048)``. 4.73B parameters,
0.68B of them active per token. Routing is GShard's: each sequence routes its own tokens, every expert takes
at most ``1.25 x 2 x length / 8`` of them (first choices before second choices, in order; the rest pass the
layer unchanged), and the two experts' outputs are summed by the router's renormalised weights::

  python -m nnx_zero1.plan --model examples.planner_moe:build --topology v5e:2x4 --slices 2 --steps one \
      --batch 16 --levers zero1,zero1-pod,zero1-accum,zero1-pod-accum
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx

from examples.planner_decoder import Decoder


class Experts(nnx.Module):
  """Top-``k`` routing over ``experts`` SwiGLU MLPs whose weights are stored stacked, one leading axis."""

  def __init__(self, width: int, hidden: int, experts: int, *, k: int = 2, capacity_factor: float = 1.25,
               dtype: jnp.dtype, rngs: nnx.Rngs):
    self.k, self.capacity_factor = k, capacity_factor
    init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
    self.router = nnx.Linear(width, experts, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)
    self.gate_up = nnx.Param(init(rngs.params(), (experts, width, 2 * hidden), dtype))
    self.down = nnx.Param(init(rngs.params(), (experts, hidden, width), dtype))

  def __call__(self, x: jax.Array) -> jax.Array:
    experts = self.gate_up.shape[0]
    capacity = math.ceil(self.capacity_factor * self.k * x.shape[1] / experts)
    dispatch, combine = route(jax.nn.softmax(self.router(x).astype(jnp.float32)), self.k, capacity)
    inputs = jnp.einsum("bsec,bsd->becd", dispatch.astype(x.dtype), x)
    gate, up = jnp.split(jnp.einsum("becd,edf->becf", inputs, self.gate_up[...]), 2, axis=-1)
    outputs = jnp.einsum("becf,efd->becd", jax.nn.silu(gate) * up, self.down[...])
    return jnp.einsum("bsec,becd->bsd", combine.astype(x.dtype), outputs)


def route(probs: jax.Array, k: int, capacity: int) -> tuple[jax.Array, jax.Array]:
  """Each token's ``k`` likeliest experts, as slots in those experts' queues.

  Args:
    probs: the router's probabilities, ``(batch, length, experts)``; each sequence routes its own tokens.
    k: experts per token.
    capacity: slots per expert and sequence; a choice past them is dropped.

  Returns:
    ``dispatch``, ``(batch, length, experts, capacity)``, one where a token takes a slot, and ``combine``,
    the same with the token's renormalised weight for that expert in place of the one.

  Example::

    >>> probs = jnp.array([[[0.7, 0.2, 0.1], [0.6, 0.3, 0.1]]])
    >>> dispatch, _ = route(probs, k=1, capacity=1)  # the second token finds expert 0 full
    >>> dispatch.sum(axis=(2, 3)).tolist()
    [[1.0, 0.0]]
  """
  batch, length, experts = probs.shape
  weights, chosen = jax.lax.top_k(probs, k)
  weights = weights / weights.sum(axis=-1, keepdims=True)
  choice = jax.nn.one_hot(chosen, experts, dtype=jnp.int32)  # (batch, length, k, experts)
  # Queue order: every token's first choice before any second choice, each in token order.
  queued = choice.transpose(0, 2, 1, 3).reshape(batch, k * length, experts)
  place = (jnp.cumsum(queued, axis=1) - 1).reshape(batch, k, length, experts).transpose(0, 2, 1, 3)
  slot = jax.nn.one_hot((place * choice).sum(axis=-1), capacity)  # past the capacity: all zeros
  dispatch = jnp.einsum("bske,bskc->bsec", choice.astype(slot.dtype), slot)
  combine = jnp.einsum("bsk,bske,bskc->bsec", weights, choice.astype(slot.dtype), slot)
  return dispatch, combine


def build(num_layers: int = 16) -> Decoder:
  """The 4.73B bfloat16 Mixture-of-Experts decoder at ``num_layers`` (default: the full depth)."""
  rngs = nnx.Rngs(0)
  return Decoder(num_layers, width=2048, heads=16, kv_heads=4, dtype=jnp.bfloat16, rngs=rngs,
                 mlp=lambda: Experts(2048, 5632, 8, dtype=jnp.bfloat16, rngs=rngs))
