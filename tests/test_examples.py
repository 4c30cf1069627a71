"""The user's own models the docs plan (``examples/planner_decoder.py``, ``examples/planner_moe.py``): their
shapes as the docs state them, and the Mixture-of-Experts routing, each token to its experts' queues."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from examples.planner_decoder import Decoder, build, build_1b, build_1b_scanned, build_7b
from examples.planner_moe import Experts, route
from examples.planner_moe import build as build_moe


def _params(builder) -> int:
  return sum(x.size for x in jax.tree.leaves(nnx.state(nnx.eval_shape(builder), nnx.Param)))


def test_the_models_have_the_sizes_the_docs_say():
  sizes = [round(_params(b) / 1e9, 2) for b in (build, build_1b, build_7b, build_moe)]
  assert sizes == [0.27, 1.21, 7.24, 4.73]
  assert _params(build_1b_scanned) == _params(build_1b)  # the same decoder, its layers stacked
  block = nnx.state(nnx.eval_shape(build_moe).blocks[0], nnx.Param)
  assert block["mlp"]["gate_up"].shape == (8, 2048, 11264) and block["mlp"]["down"].shape == (8, 5632, 2048)


def test_route_gives_each_token_its_k_likeliest_experts_up_to_their_capacity():
  probs = jax.nn.softmax(jax.random.normal(jax.random.key(0), (2, 64, 8)), axis=-1)
  dispatch, combine = (np.asarray(x) for x in route(probs, k=2, capacity=20))
  assert dispatch.sum(axis=1).max() == 1  # a slot holds one token at most
  assert (dispatch.sum(axis=(2, 3)) <= 2).all() and (dispatch.sum(axis=3) <= 1).all()
  top2 = np.argsort(-np.asarray(probs), axis=-1)[..., :2]
  taken = dispatch.sum(axis=3) > 0  # (batch, length, experts)
  for b, s, e in zip(*np.nonzero(taken), strict=True):
    assert e in top2[b, s]
  # A token with both choices kept gets its two weights renormalised to one.
  whole = dispatch.sum(axis=(2, 3)) == 2
  np.testing.assert_allclose(combine.sum(axis=(2, 3))[whole], 1.0, rtol=1e-6)
  # Every first choice is queued before any second: with room for every first choice, none is dropped.
  first = route(probs, k=2, capacity=64)[0].sum(axis=(2, 3))
  assert (np.asarray(first) == 2).all()


def test_a_small_moe_decoder_trains():
  rngs = nnx.Rngs(0)
  model = Decoder(2, vocab=64, width=32, heads=4, kv_heads=2, rngs=rngs,
                  mlp=lambda: Experts(32, 48, 4, dtype=jnp.float32, rngs=rngs))
  tokens = jax.random.randint(jax.random.key(1), (4, 17), 0, 64)
  log_probs = lambda m: jax.nn.log_softmax(m(tokens[:, :-1]))
  loss = lambda m: -jnp.mean(jnp.take_along_axis(log_probs(m), tokens[:, 1:, None], -1))
  grads = nnx.jit(nnx.grad(loss))(model)
  gate_up = grads["blocks"][0]["mlp"]["gate_up"][...]
  assert gate_up.shape == (4, 32, 96) and bool(jnp.all(jnp.isfinite(gate_up)))
  assert float(jnp.abs(gate_up).sum()) > 0
