"""``update(model, grads, value=, grad=, value_fn=)``: optax's line searches under Zero-1.

``tx.update`` runs on parameter slices (on an Explicit mesh inside ``auto_axes``);
callables cross that boundary as they are and ``value_fn`` is called with the
parameters on their own layout, as under ``nnx.Optimizer``. lbfgs's memories (a
parameter's shape behind a leading axis) are split like their parameter.
"""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_zero1 import Zero1Optimizer, report
from tests.support.helpers import MLP, assert_trees_close, batches, loss_fn

MESHES = {
    "Explicit": jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,)),
    "Auto": jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,)),
}


def backtracking():
  search = optax.scale_by_backtracking_linesearch(max_backtracking_steps=4)
  return optax.chain(optax.sgd(0.5, momentum=0.5), search)


def line_search_step(model, opt, x, y, seen=None):
  graphdef, _, rest = nnx.split(model, nnx.Param, ...)

  def value_fn(params):
    if seen is not None:
      seen.append([jax.typeof(p).sharding.spec for p in jax.tree.leaves(params)])
    return loss_fn(nnx.merge(graphdef, params, rest), x, y)

  value, grads = nnx.value_and_grad(loss_fn)(model, x, y)
  return opt.update(model, grads, value=value, grad=grads, value_fn=value_fn)


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_backtracking_line_search_on_an_explicit_mesh_matches_nnx_optimizer(jitted):
  mesh = MESHES["Explicit"]
  shard = NamedSharding(mesh, P("data"))
  step = nnx.jit(line_search_step) if jitted else line_search_step
  runs = []
  for cls in (nnx.Optimizer, Zero1Optimizer):
    with jax.set_mesh(mesh):
      model = MLP(nnx.Rngs(0))
      opt = cls(model, backtracking(), wrt=nnx.Param)
      for x, y in batches(2):
        updates = step(model, opt, jax.device_put(x, shard), jax.device_put(y, shard))
    runs.append((model, opt, updates))
  (m0, o0, u0), (m1, o1, u1) = runs
  assert_trees_close(m0, m1)
  assert_trees_close(o0, o1)
  assert_trees_close(u0, u1)
  # the returned updates are on the parameters' layout, as the contract says
  assert [u.sharding for u in jax.tree.leaves(u1)] == [u.sharding for u in jax.tree.leaves(u0)]


def test_value_fn_sees_the_parameters_on_their_own_layout():
  mesh = MESHES["Explicit"]
  shard = NamedSharding(mesh, P("data"))
  seen = []
  with jax.set_mesh(mesh):
    model = MLP(nnx.Rngs(0))
    opt = Zero1Optimizer(model, backtracking())
    x, y = batches(1)[0]
    nnx.jit(lambda m, o, x, y: line_search_step(m, o, x, y, seen))(
        model, opt, jax.device_put(x, shard), jax.device_put(y, shard)
    )
  homes = [p.sharding.spec for p in jax.tree.leaves(nnx.as_pure(nnx.state(model, nnx.Param)))]
  assert seen and all([P(*s) for s in specs] == [P(*h) for h in homes] for specs in seen)
  # while the optimizer itself works on slices
  assert [r.spec for r in report(opt).rows if "['l1']['kernel']" in r.path] == ["P('data', None)"]


@pytest.mark.parametrize("mesh_kind", list(MESHES))
def test_lbfgs_memories_are_split_like_their_parameters(mesh_kind):
  with jax.set_mesh(MESHES[mesh_kind]):
    model = MLP(nnx.Rngs(0))
    opt = Zero1Optimizer(model, optax.lbfgs())
  rows = {row.path: row for row in report(opt).rows}
  memory = rows["[0].diff_params_memory['l1']['kernel']"]
  assert memory.shape == (10, 16, 128) and memory.sharded
  assert memory.bytes_per_device * 8 == memory.full_bytes
  assert opt.opt_state[0].diff_updates_memory["l2"]["kernel"][...].sharding.spec[:2] == (None, "data")
  assert rows["[2].grad['l1']['kernel']"].sharded  # the zoom line search's gradient
  assert not rows["[0].weights_memory"].sharded  # (memory,) scalars per step: not parameter-shaped
  assert not rows["[0].diff_params_memory['l3']['bias']"].sharded  # its parameter (3,) is not split


def test_lbfgs_trains_like_nnx_optimizer_eagerly():
  mesh = MESHES["Explicit"]
  shard = NamedSharding(mesh, P("data"))
  runs = []
  for cls in (nnx.Optimizer, Zero1Optimizer):
    with jax.set_mesh(mesh):
      model = MLP(nnx.Rngs(0))
      opt = cls(model, optax.lbfgs(), wrt=nnx.Param)
      x, y = batches(1)[0]
      line_search_step(model, opt, jax.device_put(x, shard), jax.device_put(y, shard))
    runs.append((model, opt))
  assert_trees_close(runs[0][0], runs[1][0])
  assert_trees_close(runs[0][1], runs[1][1])
  initial = MLP(nnx.Rngs(0)).l1.kernel[...]
  assert not np.array_equal(np.asarray(runs[1][0].l1.kernel[...]), np.asarray(initial))
