"""What ``value_and_grad_accumulated`` costs in device memory, as the TPU compiler schedules it (CI lane 2).

Run as ``python -m tests.support.accumulate_memory`` in a planning process's environment (jax on CPU,
libtpu loaded for compiling only): it compiles one training step of a bfloat16 MLP decoder's blocks for
one v5e:2x4 slice (data 8) with a ``Zero1Optimizer`` three ways, the one-program step
(``nnx.value_and_grad``) and ``value_and_grad_accumulated`` with one and two micro-batches of the same
rows per replica, and prints their ``memory_analysis()`` bytes per device as one JSON line. XLA's CPU
backend schedules the same programs into the same temporaries, so only a TPU compile can tell.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import topologies
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_zero1 import Zero1Optimizer, value_and_grad_accumulated

D, F, LAYERS, SEQ, ROWS = 1024, 4096, 8, 256, 1  # 192 MiB of bf16 parameters; ROWS per replica, micro-batch


class Block(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    kw = dict(rngs=rngs, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16, use_bias=False)
    self.up, self.gate, self.down = nnx.Linear(D, F, **kw), nnx.Linear(D, F, **kw), nnx.Linear(F, D, **kw)

  def __call__(self, x):
    return x + self.down(nnx.silu(self.gate(x)) * self.up(x))


class Blocks(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.blocks = nnx.List([Block(rngs) for _ in range(LAYERS)])

  def __call__(self, x):
    for block in self.blocks:
      x = block(x)
    return x


def loss_fn(model, batch):
  return jnp.mean(model(batch["x"]).astype(jnp.float32) ** 2)


def measure() -> dict:
  """Per device: the parameters' bytes and each step's temporaries (``one``, ``ga1``, ``ga2``)."""
  devices = topologies.get_topology_desc(topology_name="v5e:2x4", platform="tpu").devices
  mesh = Mesh(np.array(devices).reshape(8), ("data",), axis_types=(AxisType.Auto,))
  with jax.set_mesh(mesh):
    model = nnx.eval_shape(lambda: Blocks(nnx.Rngs(0)))
    opt = nnx.eval_shape(lambda: Zero1Optimizer(model, optax.adamw(1e-3), mesh))
  graphdef, state = nnx.split((model, opt))
  shardings = jax.tree.map(lambda x: x.sharding or NamedSharding(mesh, P()), state)
  out = {"param_bytes": sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model, nnx.Param)))}
  for name, ga in (("one", 0), ("ga1", 1), ("ga2", 2)):
    def step(state, batch, ga=ga):
      model, opt = nnx.merge(graphdef, state)
      if ga:
        loss, grads = value_and_grad_accumulated(loss_fn, model, batch, micro_batches=ga, optimizer=opt)
      else:
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
      opt.update(model, grads)
      return nnx.state((model, opt)), loss

    rows = 8 * ROWS * max(ga, 1)
    batch = {"x": jax.ShapeDtypeStruct((rows, SEQ, D), jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))}
    jitted = jax.jit(step, out_shardings=(shardings, NamedSharding(mesh, P())), donate_argnums=0)
    with jax.set_mesh(mesh):
      out[name] = jitted.lower(state, batch).compile().memory_analysis().temp_size_in_bytes
  return out


if __name__ == "__main__":
  print(json.dumps(measure()))
