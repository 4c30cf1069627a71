"""Coverage matrix: every optax optimizer under Zero-1, on an Explicit and on an Auto mesh.

Each case trains the real ``nnx.Optimizer`` and ``Zero1Optimizer`` from the same
init on the same batches and compares parameters and optimizer state: exactly
for elementwise transformations, to 1e-5 for ones with reductions (norms, trust
ratios, factored moments, Newton-Schulz). No optimizer in the list is refused.

With ``NNX_ZERO1_COVERAGE_JSON=path`` set, the results are written to ``path``;
``scripts/coverage_table.py`` turns them into the docs' table (docs/coverage_table.md).
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_zero1 import Zero1Optimizer, report
from nnx_zero1.testing import CASES, FROZEN, OptimizerCase
from tests.support.helpers import MLP, apply_grads, batches, grads_of, loss_fn

STEPS = 3
DATA = batches(STEPS)
MESHES = {
    "Explicit": jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,)),
    "Auto": jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,)),
}
TOLERANCE = 1e-5  # for the transformations with reductions (not elementwise)


@pytest.fixture(scope="module")
def coverage():
  """Collects one record per case; written to $NNX_ZERO1_COVERAGE_JSON when that is set."""
  records: list[dict] = []
  yield records
  path = os.environ.get("NNX_ZERO1_COVERAGE_JSON")
  if path:
    with open(path, "w") as f:
      json.dump({"optax": optax.__version__, "jax": jax.__version__, "steps": STEPS, "results": records}, f,
                indent=1)


@nnx.jit
def _apply_line_search(model, opt, x, y):
  """A step the way optax's line searches are driven: the loss, its gradients and a function
  of the parameters (a pure ``nnx.State``, as ``nnx.Optimizer`` passes them)."""
  graphdef, _, rest = nnx.split(model, nnx.Param, ...)
  value, grads = nnx.value_and_grad(loss_fn)(model, x, y)
  value_fn = lambda params: loss_fn(nnx.merge(graphdef, params, rest), x, y)
  opt.update(model, grads, value=value, grad=grads, value_fn=value_fn)


_INITIAL: dict = {}


def _initial_model(mesh) -> MLP:
  """One initialisation per mesh, cloned for every case (jax arrays are shared, never copied):
  the matrix runs a few thousand fewer eager multi-device programs than one init per case."""
  if mesh not in _INITIAL:
    with jax.set_mesh(mesh):
      _INITIAL[mesh] = MLP(nnx.Rngs(0))
  return nnx.clone(_INITIAL[mesh])


def _train_both(case: OptimizerCase, mesh):
  batch = NamedSharding(mesh, P("data"))
  out = []
  for cls in (nnx.Optimizer, Zero1Optimizer):
    with jax.set_mesh(mesh):
      model = _initial_model(mesh)
      initial = nnx.clone(model)
      opt = cls(model, case.build(), wrt=nnx.Param)
      dtypes = [x.dtype for x in jax.tree.leaves(nnx.as_pure(opt.opt_state))]
      for x, y in DATA:
        x, y = jax.device_put(x, batch), jax.device_put(y, batch)
        if case.line_search:
          _apply_line_search(model, opt, x, y)
        else:
          apply_grads(model, opt, grads_of(model, x, y))
    out.append((model, opt, initial, dtypes))
  return out


def _leaves(*trees):
  return [np.asarray(x) for t in trees for x in jax.tree.leaves(nnx.as_pure(nnx.state(t)))]


def _max_abs_diff(a, b) -> float:
  diffs = [np.abs(x.astype(np.float64) - y.astype(np.float64)).max(initial=0) for x, y in zip(a, b)]
  return float(max(diffs, default=0.0))


def _check_layout(opt) -> None:
  """Every state leaf is where the plan puts it, and holds 1/8 of its bytes per device if split."""
  leaves = jax.tree.leaves(nnx.as_pure(opt.opt_state))
  for leaf, row, plan in zip(leaves, report(opt).rows, opt.zero1_plan.state_leaves, strict=True):
    assert leaf.sharding.is_equivalent_to(plan.sharding, leaf.ndim), (row.path, leaf.sharding)
    want = row.full_bytes // 8 if row.sharded else row.full_bytes
    assert row.bytes_per_device == want, row


@pytest.mark.parametrize("mesh_kind", list(MESHES))
@pytest.mark.parametrize("name", list(CASES))
def test_zero1_trains_like_nnx_optimizer(name, mesh_kind, coverage):
  case = CASES[name]
  record = {"optimizer": name, "mesh": mesh_kind, "outcome": "failed"}  # until every check passed
  coverage.append(record)
  (m0, o0, _, _), (m1, o1, init1, dtypes) = _train_both(case, MESHES[mesh_kind])
  plain, zero1 = _leaves(m0, o0), _leaves(m1, o1)
  assert [x.shape for x in plain] == [x.shape for x in zero1]
  assert [x.dtype for x in plain] == [x.dtype for x in zero1]
  for x, y in zip(plain, zero1, strict=True):
    if case.elementwise:
      np.testing.assert_array_equal(x, y)
    else:
      np.testing.assert_allclose(x, y, rtol=TOLERANCE, atol=TOLERANCE)
  assert [x.dtype for x in jax.tree.leaves(nnx.as_pure(o1.opt_state))] == dtypes
  assert int(o1.step[...]) == STEPS
  _check_layout(o1)
  if case.freezes:
    for now, before in zip(_leaves(getattr(m1, FROZEN)), _leaves(getattr(init1, FROZEN)), strict=True):
      np.testing.assert_array_equal(now, before)
    assert not all(np.array_equal(a, b) for a, b in zip(_leaves(m1.l2), _leaves(init1.l2)))
  state = report(o1)
  record.update(
      outcome="exact" if case.elementwise else "allclose",
      bit_identical=all(np.array_equal(x, y) for x, y in zip(plain, zero1)),
      max_abs_diff=_max_abs_diff(plain, zero1),
      state_bytes_per_device=state.per_device_bytes,
      state_bytes_replicated_optimizer=state.unsharded_bytes,
      replicated_leaves=[[r.path, r.reason] for r in state.rows if not r.sharded and r.shape],
  )
