"""Optimizer state that is not parameter-shaped: factored statistics, masked-out
parameters (``MaskedNode``), counters. Each gets a layout that lines up with its
parameter's slices, or stays replicated, and ``report`` says which and why."""

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_zero1 import Zero1Error, Zero1Optimizer, report
from nnx_zero1._src.layout import Reason, statistic_layout
from tests.support.helpers import MLP, assert_trees_close, assert_unchanged, batches, snapshot, train

TP = jax.make_mesh((4, 2), ("data", "tp"), axis_types=(AxisType.Explicit,) * 2)
MESH = jax.make_mesh((8,), ("data",))


def zero1(spec, mesh=TP):
  return NamedSharding(mesh, spec)


@pytest.mark.parametrize(
    "shape, param_shape, param_spec, want_spec, want_reason",
    [
        ((16,), (16, 32), P("data"), P("data"), None),  # keeps the split dimension
        ((32,), (16, 32), P("data"), P(), Reason.NOT_ALIGNED),  # dropped it
        ((16,), (16, 32), P("data", "tp"), P("data"), None),
        ((32,), (16, 32), P("data", "tp"), P("tp"), Reason.NOT_ALIGNED),  # keeps tp, not data
        ((8, 32), (8, 16, 32), P(None, "data", "tp"), P(None, "tp"), Reason.NOT_ALIGNED),
        ((16, 32), (8, 16, 32), P(None, "data", "tp"), P("data", "tp"), None),
        ((3,), (3, 5), P(), P(), Reason.PARAM_NOT_SPLIT),  # the parameter itself is not split
        ((1,), (16, 32), P("data"), P(), Reason.NOT_PARAM_SHAPED),  # adafactor's unused placeholders
        ((16,), (16, 16), P("data"), P(), Reason.AMBIGUOUS),  # square: row or column statistic?
        ((), (16, 32), P("data"), P(), "scalar"),  # NovoGrad's per-parameter second moment
    ],
)
def test_statistic_follows_the_dimensions_it_keeps(shape, param_shape, param_spec, want_spec, want_reason):
  sharding, reason = statistic_layout(shape, param_shape, zero1(param_spec), ("data",))
  assert reason == want_reason
  assert sharding.spec == want_spec
  assert sharding.mesh == TP


def test_statistic_of_a_square_parameter_with_one_layout_is_split():
  # Both readings of a (16, 16) statistic keep the data axis when the spec is symmetric.
  sharding, reason = statistic_layout((16,), (16, 16), zero1(P("data")), ("data",))
  assert (sharding.spec, reason) == (P(), Reason.AMBIGUOUS)
  sharding, reason = statistic_layout((16, 16), (16, 16), zero1(P("data")), ("data",))
  assert (sharding.spec, reason) == (P("data"), None)


def test_adafactor_factored_statistics_line_up_with_their_parameter():
  with jax.set_mesh(MESH):
    model = MLP(nnx.Rngs(0))
    opt = Zero1Optimizer(model, optax.adafactor(1e-2, min_dim_size_to_factor=8), MESH)
  rows = {row.path: row for row in report(opt).rows}
  l1_row, l1_col = rows["[0].v_row['l1']['kernel']"], rows["[0].v_col['l1']['kernel']"]
  # l1 kernel (16, 128) is split on rows: its row statistic (16,) with it, its column one whole.
  assert (l1_row.shape, l1_row.sharded, l1_row.spec) == ((16,), True, str(P("data")))
  assert (l1_col.shape, l1_col.sharded, l1_col.reason) == ((128,), False, Reason.NOT_ALIGNED)
  assert l1_row.bytes_per_device == 16 * 4 // 8 and l1_col.bytes_per_device == 128 * 4
  assert rows["[0].v_row['l2']['kernel']"].reason == Reason.AMBIGUOUS  # (128, 128)
  assert rows["[0].v['l1']['kernel']"].reason == Reason.NOT_PARAM_SHAPED  # placeholder (1,)
  assert rows["[0].v['l3']['kernel']"].sharded  # (128, 3) is not factored: parameter-shaped
  assert rows["[0].count"].reason == "scalar"
  assert "statistic over the dimension its parameter is split on" in str(report(opt))


@pytest.mark.parametrize(
    "make_tx",
    [
        lambda: optax.contrib.muon(1e-2),
        lambda: optax.masked(optax.adam(1e-2), lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
        lambda: optax.multi_transform(
            {"a": optax.adam(1e-2), "z": optax.set_to_zero()},
            lambda p: jax.tree.map(lambda x: "a" if x.ndim > 1 else "z", p),
        ),
    ],
    ids=["muon", "masked", "multi_transform"],
)
def test_masked_out_parameters_have_no_leaves_and_the_tree_matches_nnx_optimizer(make_tx):
  with jax.set_mesh(MESH):
    model = MLP(nnx.Rngs(0))
    plain = nnx.Optimizer(model, make_tx(), wrt=nnx.Param)
    opt = Zero1Optimizer(model, make_tx(), MESH)
  want = jax.tree.map(lambda x: (x.shape, x.dtype), nnx.as_pure(nnx.state(plain)))
  got = jax.tree.map(lambda x: (x.shape, x.dtype), nnx.as_pure(nnx.state(opt)))
  assert jax.tree.structure(got) == jax.tree.structure(want)
  assert jax.tree.leaves(got) == jax.tree.leaves(want)
  assert len(report(opt).rows) == len(jax.tree.leaves(nnx.as_pure(opt.opt_state)))


def test_muon_ns_coefficients_stay_replicated_and_moments_split():
  with jax.set_mesh(MESH):
    model = MLP(nnx.Rngs(0))
    opt = Zero1Optimizer(model, optax.contrib.muon(1e-2), MESH)
  rows = {row.path: row for row in report(opt).rows}
  assert rows[".inner_states['muon'].inner_state[0].ns_coeffs"].reason == Reason.NOT_PARAM_SHAPED
  assert rows[".inner_states['muon'].inner_state[0].mu['l2']['kernel']"].sharded
  assert rows[".inner_states['adam'].inner_state[0].mu['l2']['bias']"].sharded


def init_per_key(params):
  return {key: jax.tree.map(jnp.zeros_like, value) for key, value in params.items()}  # not on a placeholder


def init_flat(params):
  return {"flat": jnp.concatenate([jnp.ravel(x) for x in jax.tree.leaves(params)])}  # not on a placeholder


def test_state_optax_cannot_map_is_matched_against_the_parameters():
  """tree_map_params fails on placeholders; state subtrees shaped like the parameters are split."""
  tx = optax.GradientTransformation(lambda p: {"acc": init_per_key(p)}, lambda g, s, p=None: (g, s))
  with jax.set_mesh(MESH):
    opt = Zero1Optimizer(MLP(nnx.Rngs(0)), tx, MESH)
  rows = {row.path: row for row in report(opt).rows}
  assert rows["['acc']['l1']['kernel']"].sharded and rows["['acc']['l2']['bias']"].sharded
  assert not rows["['acc']['l3']['bias']"].sharded  # 3 divides by no data size > 1


def test_a_transformation_whose_state_matches_no_parameter_is_refused_by_name():
  tx = optax.GradientTransformation(init_flat, lambda g, s, p=None: (g, s))
  with jax.set_mesh(MESH):
    model = MLP(nnx.Rngs(0))
  before = snapshot(model)
  with pytest.raises(Zero1Error, match="init_flat.*tree position and shape"):
    Zero1Optimizer(model, tx, MESH)
  assert_unchanged(before, model)


def test_muon_runs_on_an_explicit_mesh_and_matches_nnx_optimizer():
  # Newton-Schulz's X @ X.T on a row-split X is an illegal Explicit sharding; update()
  # runs tx with the data axis Auto, so it works and lands on the plan's layout.
  x, y = batches(1)[0]
  out = []
  for cls in (nnx.Optimizer, Zero1Optimizer):
    with jax.set_mesh(MESH):
      model = MLP(nnx.Rngs(0))
      opt = cls(model, optax.contrib.muon(1e-2), wrt=nnx.Param)
      train(model, opt, MESH, [(x, y)])
    out.append((model, opt))
  (m0, o0), (m1, o1) = out
  assert_trees_close(m0, m1, atol=1e-5, rtol=1e-5)
  assert_trees_close(o0, o1, atol=1e-5, rtol=1e-5)
  leaves = jax.tree.leaves(nnx.as_pure(o1.opt_state))
  for leaf, row in zip(leaves, o1.zero1_plan.state_leaves, strict=True):
    assert leaf.sharding.is_equivalent_to(row.sharding, leaf.ndim), (row.path, leaf.sharding)
