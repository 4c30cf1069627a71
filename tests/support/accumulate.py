"""Accumulation fixtures shared by the core tests: a decoder on a 4-device mesh, token batches, and the
jitted steps of ``value_and_grad_accumulated`` (deferred, and ZeRO-2's ``shard_accumulator``)."""

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_zero1 import value_and_grad_accumulated
from tests.support.helpers import Decoder, lm_loss

N, M = 4, 2
ROWS, SEQ, VOCAB = 16, 16, 64


def explicit_mesh(shape=(N,), names=("data",), kind=AxisType.Explicit):
  return jax.make_mesh(shape, names, devices=jax.devices()[:np.prod(shape)], axis_types=(kind,) * len(names))


MESH = explicit_mesh()


def token_batches(n, rows=ROWS, seed=0):
  rng = np.random.default_rng(seed)
  return [{"tokens": rng.integers(0, VOCAB, (rows, SEQ + 1)).astype(np.int32)} for _ in range(n)]


def batch_on_mesh(batch, mesh=MESH):
  return jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P("data"))), batch)


def build(cls, tx, mesh=MESH, **kwargs):
  with jax.set_mesh(mesh):
    model = Decoder(nnx.Rngs(0), vocab=VOCAB)
    nnx.update(model, jax.device_put(nnx.state(model), NamedSharding(mesh, P())))
    return model, cls(model, tx, wrt=nnx.Param, **kwargs)


@nnx.jit(static_argnames=("micro_batches", "defer", "strict"))
def accumulated(model, opt, batch, micro_batches=M, defer=True, strict=None):
  return value_and_grad_accumulated(
      lm_loss, model, batch, micro_batches=micro_batches, optimizer=opt, defer_reduction=defer, strict=strict
  )


@nnx.jit(static_argnames=("micro_batches", "defer", "strict"))
def accum_step(model, opt, batch, micro_batches=M, defer=True, strict=None):
  loss, grads = accumulated(model, opt, batch, micro_batches, defer, strict)
  opt.update(model, grads)
  return loss


@nnx.jit
def full_batch_step(model, opt, batch):
  loss, grads = nnx.value_and_grad(lm_loss)(model, batch)
  opt.update(model, grads)
  return loss


def train(step, model, opt, batches, mesh=MESH, **kwargs):
  with jax.set_mesh(mesh):
    return [float(step(model, opt, batch_on_mesh(b, mesh), **kwargs)) for b in batches]


def params(model):
  return nnx.state(model, nnx.Param)


def tensor_parallel(cls, mesh, split=True):
  with jax.set_mesh(mesh):
    model = Decoder(nnx.Rngs(0), vocab=VOCAB)
    nnx.update(model, jax.device_put(nnx.state(model), NamedSharding(mesh, P())))
    for layer, spec in ((model.up, P(None, "model")), (model.down, P("model", None))) if split else ():
      layer.kernel.value = jax.device_put(layer.kernel[...], NamedSharding(mesh, spec))
    return model, cls(model, optax.adamw(1e-3), wrt=nnx.Param)


MICRO = 4


@nnx.jit(static_argnames=("shard", "defer"))
def zero2_accumulated(model, opt, batch, shard=True, defer=True):
  return value_and_grad_accumulated(
      lm_loss, model, batch, micro_batches=MICRO, optimizer=opt,
      shard_accumulator=shard, defer_reduction=defer,
  )


@nnx.jit(static_argnames=("shard",))
def zero2_step(model, opt, batch, shard=True):
  loss, grads = zero2_accumulated(model, opt, batch, shard)
  opt.update(model, grads)
  return loss
