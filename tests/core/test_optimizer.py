"""Zero1Optimizer against the real nnx.Optimizer on the same data, value by value."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_zero1 import Zero1Error, Zero1Optimizer, bytes_per_device, report
from nnx_zero1._src.compat import jit_cache_size
from nnx_zero1.testing import CASES, ELEMENTWISE_CONTRACT
from tests.support.helpers import (
  MLP,
  assert_trees_close,
  assert_trees_equal,
  batches,
  loss_fn,
  shardings,
  train,
  train_step,
)

MESH = jax.make_mesh((8,), ("data",))
AUTO = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
AUTO_TP = jax.make_mesh((4, 2), ("data", "tp"), axis_types=(AxisType.Auto, AxisType.Auto))
STEPS = 5

ELEMENTWISE = {name: CASES[name].build for name in ELEMENTWISE_CONTRACT}


def run_pair(make_tx, mesh=MESH, kernel_sharding=None, steps=STEPS):
  """Trains the plain and the Zero-1 optimizer from the same init on the same data."""
  data = batches(steps)
  out = []
  for cls in (nnx.Optimizer, Zero1Optimizer):
    with jax.set_mesh(mesh):
      model = MLP(nnx.Rngs(0), kernel_sharding)
      opt = cls(model, make_tx(), wrt=nnx.Param)
      losses = train(model, opt, mesh, data)
    out.append((model, opt, losses))
  return out


@pytest.mark.parametrize("name", sorted(ELEMENTWISE))
def test_elementwise_optimizers_are_bit_identical(name):
  (m0, o0, l0), (m1, o1, l1) = run_pair(ELEMENTWISE[name])
  np.testing.assert_array_equal(l0, l1)
  assert_trees_equal(m0, m1)
  assert_trees_equal(o0, o1)
  assert int(o1.step[...]) == STEPS


def test_global_norm_clipping_matches_to_float_precision():
  make = lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(1e-2))
  (m0, o0, l0), (m1, o1, l1) = run_pair(make)
  np.testing.assert_allclose(l0, l1, rtol=1e-6, atol=1e-6)
  assert_trees_close(m0, m1)
  assert_trees_close(o0, o1)


def test_moments_take_one_nth_of_the_bytes_per_device():
  (_, o0, _), (_, o1, _) = run_pair(ELEMENTWISE["adam"], steps=1)
  rep = report(o1)
  split = [row for row in rep.rows if row.sharded]
  kept = [row for row in rep.rows if not row.sharded]
  assert {row.path for row in kept} == {"[0].count", "[0].mu['l3']['bias']", "[0].nu['l3']['bias']"}
  plain_leaves = jax.tree.leaves(nnx.as_pure(o0.opt_state))
  zero1_leaves = jax.tree.leaves(nnx.as_pure(o1.opt_state))
  for row, p, z in zip(rep.rows, plain_leaves, zero1_leaves, strict=True):
    assert bytes_per_device(p) == p.nbytes  # the plain optimizer holds it all everywhere
    expected = p.nbytes // 8 if row.sharded else p.nbytes
    assert bytes_per_device(z) == expected == row.bytes_per_device, row.path
  assert rep.per_device_bytes == bytes_per_device(nnx.as_pure(o1.opt_state))
  assert rep.replicated_bytes == sum(r.bytes_per_device for r in kept)
  assert rep.sharded_bytes * 8 == sum(r.full_bytes for r in split)
  assert rep.unsharded_bytes == bytes_per_device(nnx.as_pure(o0.opt_state))


def test_auto_mesh_is_bit_identical_too():
  (m0, o0, l0), (m1, o1, l1) = run_pair(ELEMENTWISE["adamw"], mesh=AUTO)
  np.testing.assert_array_equal(l0, l1)
  assert_trees_equal(m0, m1)
  assert_trees_equal(o0, o1)
  assert shardings(m1) == shardings(m0)


def test_tensor_parallel_kernel_on_an_auto_mesh_keeps_its_layout():
  (m0, o0, l0), (m1, o1, l1) = run_pair(ELEMENTWISE["adamw"], mesh=AUTO_TP, kernel_sharding=(None, "tp"))
  # nnx.Optimizer's parameters drift on an Auto mesh (below: a bias ends up split over tp),
  # so its later steps run a differently partitioned forward pass: float precision only.
  np.testing.assert_allclose(l0, l1, rtol=1e-6)
  assert_trees_close(m0, m1)
  with jax.set_mesh(AUTO_TP):
    placed = shardings(MLP(nnx.Rngs(0), (None, "tp")))
  # Exactly as they came in (the plain optimizer's jit is free to let them drift).
  assert shardings(m1) == placed
  kernel = m1.l1.kernel[...]
  assert kernel.sharding.spec == P(None, "tp")
  mu = o1.opt_state[0].mu["l1"]["kernel"][...]
  # Moments carry both axes: 1/(4*2) of the bytes on each device.
  assert mu.sharding.spec == P("data", "tp")
  assert bytes_per_device(mu) == mu.nbytes // 8
  assert bytes_per_device(o0.opt_state[0].mu["l1"]["kernel"][...]) == mu.nbytes // 2


def test_report_baseline_is_what_nnx_optimizer_holds_with_tensor_parallel_params():
  with jax.set_mesh(AUTO_TP):
    model = MLP(nnx.Rngs(0), (None, "tp"))
    plain = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    zero1 = Zero1Optimizer(model, optax.adam(1e-3))
  rep = report(zero1)
  assert rep.unsharded_bytes == bytes_per_device(nnx.as_pure(plain.opt_state))
  assert rep.unsharded_bytes < sum(r.full_bytes for r in rep.rows)  # the tp split is not Zero-1's


def test_parameters_keep_their_sharding_on_an_explicit_mesh():
  (m0, _, _), (m1, _, _) = run_pair(ELEMENTWISE["adam"], steps=2)
  assert shardings(m1) == shardings(m0)
  assert all(not any(s.spec) for s in shardings(m1))


def test_eager_update_equals_the_jitted_one():
  x, y = batches(1)[0]
  results = {}
  for cls in (nnx.Optimizer, Zero1Optimizer):
    for jitted in (False, True):
      with jax.set_mesh(MESH):
        model = MLP(nnx.Rngs(0))
        opt = cls(model, optax.adamw(1e-2), wrt=nnx.Param)
        grad_fn = nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))
        update = lambda m, o, g: o.update(m, g)
        for _ in range(2):
          (nnx.jit(update) if jitted else update)(model, opt, grad_fn(model))
      results[cls, jitted] = (model, opt)
  # Zero-1 matches nnx.Optimizer exactly in each mode. Eager vs jitted is float precision for
  # both alike: XLA contracts multiply-adds under jit (1.2e-6 after two adamw steps on jax 0.12).
  for mode in (False, True):
    assert_trees_equal(results[nnx.Optimizer, mode][0], results[Zero1Optimizer, mode][0])
    assert_trees_equal(results[nnx.Optimizer, mode][1], results[Zero1Optimizer, mode][1])
  for cls in (nnx.Optimizer, Zero1Optimizer):
    eager, jitted = results[cls, False], results[cls, True]
    assert_trees_close(eager[0], jitted[0], atol=1e-5, rtol=1e-5)
    assert_trees_close(eager[1], jitted[1], atol=1e-5, rtol=1e-5)
    assert shardings(eager[0]) == shardings(jitted[0])
    assert shardings(eager[1]) == shardings(jitted[1])


def test_the_mesh_comes_from_set_mesh_and_the_state_tree_is_nnx_optimizers():
  with jax.set_mesh(MESH):
    model = MLP(nnx.Rngs(0))
    opt = Zero1Optimizer(model, optax.adam(1e-3))
    plain = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  assert opt.mesh == MESH and opt.data_axis == ("data",)
  assert isinstance(opt, nnx.Optimizer)

  def leaves(o):
    flat = jax.tree_util.tree_flatten_with_path(nnx.as_pure(nnx.state(o)))[0]
    return [(jax.tree_util.keystr(p), x.shape, x.dtype) for p, x in flat]

  assert leaves(opt) == leaves(plain)
  # The layout is recorded in the variables' metadata, where nnx.get_named_sharding reads it.
  mu = opt.opt_state[0].mu["l1"]["kernel"]
  assert mu.get_metadata()["out_sharding"] == ("data", None)
  named = nnx.get_named_sharding(nnx.state(opt.opt_state), MESH)
  assert named[0].mu["l1"]["kernel"].get_value().spec == P("data", None)


def test_data_axis_of_size_one_saves_nothing_and_changes_nothing():
  mesh = jax.make_mesh((1, 8), ("data", "tp"))
  with jax.set_mesh(mesh):
    model = MLP(nnx.Rngs(0))
    opt = Zero1Optimizer(model, optax.adam(1e-3))
  rep = report(opt)
  assert rep.per_device_bytes == rep.unsharded_bytes
  assert NamedSharding(mesh, P()).is_equivalent_to(opt.opt_state[0].mu["l1"]["kernel"][...].sharding, 2)


def test_a_jitted_step_dispatches_from_one_cache_entry():
  # State born with the specs a jitted step hands back: no second entry on step 2.
  with jax.set_mesh(MESH):
    model = MLP(nnx.Rngs(0))
    opt = Zero1Optimizer(model, optax.adamw(1e-3))
    graphdef, state = nnx.split((model, opt))

    @jax.jit
    def step(state, x, y):
      model, opt = nnx.merge(graphdef, state)
      opt.update(model, nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model))
      return nnx.state((model, opt))

    shard = NamedSharding(MESH, P("data"))
    for x, y in batches(3):
      state = step(state, jax.device_put(x, shard), jax.device_put(y, shard))
  assert jit_cache_size(step) == 1


def test_state_optax_cannot_tie_to_parameters_is_refused_not_replicated():
  def init(params):
    return {"flat": jnp.zeros(sum(x.size for x in jax.tree.leaves(params)))}

  def update(grads, state, params=None):
    return grads, state

  with jax.set_mesh(MESH):
    model = MLP(nnx.Rngs(0))
    with pytest.raises(Zero1Error, match="split nothing|parameter-shaped"):
      Zero1Optimizer(model, optax.GradientTransformation(init, update))


def test_built_under_a_trace_the_state_has_the_zero1_layout():
  with jax.set_mesh(MESH):
    model = MLP(nnx.Rngs(0))
    abstract = nnx.eval_shape(lambda: Zero1Optimizer(model, optax.adam(1e-3), MESH))
  assert abstract.opt_state[0].mu["l1"]["kernel"].get_value().sharding.spec == P("data", None)



def test_built_under_a_trace_keeps_the_parameters_tensor_axis():
  """Traced parameters' shardings come from their abstract values (MaxText's AOT engine builds the
  optimizer under jax.eval_shape on sharded avals); before, they read as replicated."""
  mesh = jax.make_mesh((4, 2), ("data", "tp"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  with jax.set_mesh(mesh):
    model = nnx.Linear(8, 16, rngs=nnx.Rngs(0))
    model.kernel.set_value(jax.device_put(model.kernel.get_value(), NamedSharding(mesh, P(None, "tp"))))
    state = jax.eval_shape(lambda m: nnx.state(Zero1Optimizer(nnx.merge(*m), optax.adam(1e-3), mesh)),
                           nnx.split(model))
  mu = state["opt_state"][0]["mu"]["kernel"].get_value()
  assert mu.sharding.spec == P("data", "tp")


@pytest.mark.parametrize(
    "names, rules", [((None, "tp"), ()), (("embed", "mlp"), (("embed", None), ("mlp", "tp")))],
    ids=["mesh-axes", "logical-names"],
)
def test_built_under_nnx_eval_shape_on_an_auto_mesh_plans_from_sharding_metadata(names, rules):
  """On Auto axes a traced parameter's type carries no layout (MaxText's ahead-of-time engine builds
  the optimizer under nnx.eval_shape): the plan reads each Variable's declared ``out_sharding``, as
  ``nnx.get_named_sharding`` does (logical names through the rules in force), and is the plan of the
  optimizer built on the model placed that way."""
  from flax.core.spmd import logical_axis_rules

  make = lambda: nnx.Linear(8, 16, rngs=nnx.Rngs(0), kernel_metadata={"out_sharding": names})
  with jax.set_mesh(AUTO_TP), logical_axis_rules(rules):
    abstract = nnx.eval_shape(lambda: Zero1Optimizer(make(), optax.adam(1e-3), AUTO_TP))
    model = make()
    state = nnx.state(model)
    nnx.update(model, jax.device_put(state, nnx.get_named_sharding(state, AUTO_TP)))
    placed = Zero1Optimizer(model, optax.adam(1e-3), AUTO_TP)
  plans = abstract.zero1_plan, placed.zero1_plan
  assert [plan.param_shardings[1].spec for plan in plans] == [P(None, "tp")] * 2  # [bias, kernel]
  assert plans[0].zero1_param_shardings == plans[1].zero1_param_shardings
  assert plans[0].state_leaves == plans[1].state_leaves
  assert P("data", "tp") in {row.sharding.spec for row in plans[0].state_leaves}


def test_zero1_plan_is_read_only():
  with jax.set_mesh(MESH):
    opt = Zero1Optimizer(MLP(nnx.Rngs(0)), optax.adam(1e-3))
  with pytest.raises(AttributeError):
    opt.zero1_plan = opt.zero1_plan  # type: ignore[misc]


@pytest.mark.parametrize("mesh", [MESH, AUTO], ids=["Explicit", "Auto"])
def test_built_under_a_trace_without_mesh_takes_set_meshs(mesh):
  """``jax.sharding.get_mesh()`` refuses to answer while tracing; the optimizer still finds it."""
  with jax.set_mesh(mesh):
    model = MLP(nnx.Rngs(0))
    abstract = nnx.eval_shape(lambda: Zero1Optimizer(model, optax.adam(1e-3)))
    state = nnx.jit(lambda m: nnx.state(Zero1Optimizer(m, optax.adam(1e-3))))(model)
  assert abstract.mesh == mesh
  mu = state["opt_state"][0]["mu"]["l1"]["kernel"].get_value()
  assert mu.sharding.is_equivalent_to(NamedSharding(mesh, P("data")), 2)
  assert bytes_per_device(mu) * 8 == mu.nbytes


MIXED = {
    f"data-{a.name}-tp-{b.name}": jax.make_mesh((4, 2), ("data", "tp"), axis_types=(a, b))
    for a, b in [(AxisType.Auto, AxisType.Explicit), (AxisType.Explicit, AxisType.Auto)]
}


@pytest.mark.parametrize("jitted", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("kind", list(MIXED))
def test_mixed_axis_types_place_each_axis_its_own_way(kind, jitted):
  """reshard moves Explicit axes, a sharding constraint (device_put eagerly) the Auto ones."""
  mesh = MIXED[kind]
  runs = []
  for cls in (nnx.Optimizer, Zero1Optimizer):
    with jax.set_mesh(mesh):
      model = MLP(nnx.Rngs(0))
      placed = shardings(model)
      opt = cls(model, optax.adamw(1e-2), wrt=nnx.Param)
      if jitted:
        train(model, opt, mesh, batches(2))
      else:
        for x, y in batches(2):
          x, y = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, y))
          opt.update(model, nnx.grad(loss_fn)(model, x, y))
    runs.append((model, opt, placed))
  (m0, o0, _), (m1, o1, placed) = runs
  assert_trees_equal(m0, m1)
  assert_trees_equal(o0, o1)
  assert shardings(m1) == placed
  mu = o1.opt_state[0].mu["l1"]["kernel"][...]
  assert mu.sharding.is_equivalent_to(NamedSharding(mesh, P("data")), 2)
  assert bytes_per_device(mu) * 4 == mu.nbytes


def test_tuple_data_axis_adds_the_data_axes_a_parameter_does_not_use_yet():
  """FSDP over ``data`` with ``data_axis=("replica", "data")``: moments add ``replica``."""
  mesh = jax.make_mesh((2, 4), ("replica", "data"), axis_types=(AxisType.Auto, AxisType.Auto))
  data = batches(2)
  runs = []
  both = ((nnx.Optimizer, {"wrt": nnx.Param}), (Zero1Optimizer, {"data_axis": ("replica", "data")}))
  for cls, kwargs in both:
    with jax.set_mesh(mesh):
      model = MLP(nnx.Rngs(0), kernel_sharding=("data", None))
      opt = cls(model, optax.adamw(1e-2), **kwargs)
      train(model, opt, mesh, data, data_axis=("replica", "data"))
    runs.append((model, opt))
  (m0, o0), (m1, o1) = runs
  assert_trees_equal(m0, m1)
  assert_trees_equal(o0, o1)
  mu = o1.opt_state[0].mu["l1"]["kernel"][...]
  assert mu.sharding.spec == P(("data", "replica"))
  assert bytes_per_device(mu) * 8 == mu.nbytes
  assert m1.l1.kernel[...].sharding.is_equivalent_to(NamedSharding(mesh, P("data")), 2)


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_a_model_built_outside_the_mesh_and_placed_trains_as_under_nnx_optimizer(jitted):
  """Left on one device it is refused (``test_mesh_resolution``); placed by its named sharding, as
  the refusal says, it trains bit-identically to nnx.Optimizer on the same placement."""
  runs = []
  for cls in (nnx.Optimizer, Zero1Optimizer):
    model = MLP(nnx.Rngs(0))  # outside any mesh: one device
    nnx.update(model, jax.device_put(nnx.state(model), nnx.get_named_sharding(nnx.state(model), MESH)))
    with jax.set_mesh(MESH):
      opt = cls(model, optax.adamw(1e-2), wrt=nnx.Param)
      for x, y in batches(2):
        if jitted:
          train_step(model, opt, x, y)
        else:
          opt.update(model, nnx.grad(loss_fn)(model, x, y))
    runs.append((model, opt))
  (m0, o0), (m1, o1) = runs
  assert_trees_equal(m0, m1)
  assert_trees_equal(o0, o1)
  assert all(s.is_equivalent_to(NamedSharding(MESH, P()), 2) for s in shardings(m1))
  mu = o1.opt_state[0].mu["l1"]["kernel"][...]
  assert bytes_per_device(mu) * 8 == mu.nbytes


def test_state_traced_under_an_explicit_stand_in_of_its_auto_mesh():
  # MaxText's ahead-of-time engine traces the optimizer state with jax.eval_shape under an
  # all-Explicit copy of the real (Auto) mesh: the moments land on the Zero-1 layout of that copy,
  # which the engine then re-homes onto the real mesh (it used to raise: a sharding constraint
  # naming the Auto mesh inside the Explicit trace).
  auto = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])
  stand_in = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:4])
  model = nnx.Linear(8, 16, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  replicated = NamedSharding(stand_in, P())
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), params)

  def build(params):
    opt = Zero1Optimizer(nnx.merge(graphdef, params), optax.adam(1e-3), auto)
    return nnx.state(opt, nnx.OptState)

  with jax.set_mesh(stand_in):
    state = jax.eval_shape(build, params)
  specs = {x.shape: x.sharding.spec for x in jax.tree.leaves(state) if x.ndim}
  assert specs == {(8, 16): P("data", None), (16,): P("data")}
