"""A Variable's own ``optimizer_sharding`` (flax >= 0.12.7, which ``nnx.Optimizer`` places its state
by): ``Zero1Optimizer`` honours it where it is a Zero-1 layout, bit-identical to ``nnx.Optimizer``
with the state where the user put it, and refuses it by name before any state exists where it
would keep the state whole over the data axis or does not divide (issue 52)."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_zero1 import Zero1Error, Zero1Optimizer, bytes_per_device, report
from nnx_zero1._src.layout import Reason
from nnx_zero1._src.layout_plan import declared_specs
from tests.support.helpers import (
  assert_trees_close,
  assert_trees_equal,
  assert_unchanged,
  batches,
  snapshot,
  train,
)

EXPLICIT = jax.make_mesh((8,), ("data",))
AUTO = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
STEPS = 3


class Declared(nnx.Module):
  """The MLP of ``helpers`` (16 -> 128 -> 128 -> 3) whose first kernel declares its optimizer layout."""

  def __init__(self, rngs, declared=(None, "data")):
    metadata = {"optimizer_sharding": declared} if declared is not None else {}
    self.l1 = nnx.Linear(16, 128, kernel_metadata=metadata, rngs=rngs)
    self.l2 = nnx.Linear(128, 128, rngs=rngs)
    self.l3 = nnx.Linear(128, 3, rngs=rngs)

  def __call__(self, x):
    return self.l3(jax.nn.gelu(self.l2(jax.nn.gelu(self.l1(x)))))


def run(cls, mesh, declared=(None, "data")):
  with jax.set_mesh(mesh):
    model = Declared(nnx.Rngs(0), declared)
    opt = cls(model, optax.adamw(1e-2), wrt=nnx.Param)
    losses = train(model, opt, mesh, batches(STEPS))
  return model, opt, losses


@pytest.mark.parametrize("mesh", [EXPLICIT, AUTO], ids=["explicit", "auto"])
def test_a_declared_zero1_layout_is_honoured_bit_identically(mesh):
  # The reference is nnx.Optimizer without the declaration: with it, nnx.Optimizer only places the
  # state and leaves the rest to the compiler. On an Explicit mesh the updated kernel then stays on
  # the state's layout (the next step's matmul with the batch fails); on an Auto one XLA computes
  # the update in another order (see the next test).
  (m0, o0, l0), (m1, o1, l1) = run(nnx.Optimizer, mesh, None), run(Zero1Optimizer, mesh)
  np.testing.assert_array_equal(l0, l1)
  assert_trees_equal(m0, m1)
  assert_trees_equal(o0, o1)
  assert m1.l1.kernel[...].sharding.is_fully_replicated  # back on its own layout after update
  for moment in (o1.opt_state[0].mu["l1"]["kernel"], o1.opt_state[0].nu["l1"]["kernel"]):
    # where the user put it (the layout rule would say P('data')), 1/8 of it per device
    assert moment[...].sharding.is_equivalent_to(NamedSharding(mesh, P(None, "data")), 2)
    assert bytes_per_device(moment[...]) * 8 == moment[...].nbytes
    assert moment.get_metadata("out_sharding") == (None, "data")
  assert o1.opt_state[0].mu["l2"]["kernel"][...].sharding.spec[0] == "data"  # the rule, elsewhere


def test_nnx_optimizer_places_the_declared_state_alike_and_trains_close():
  with jax.set_mesh(AUTO):
    model = Declared(nnx.Rngs(0))
    plain = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    zero1 = Zero1Optimizer(model, optax.adamw(1e-2))
  ours, theirs = zero1.opt_state[0].mu["l1"]["kernel"][...], plain.opt_state[0].mu["l1"]["kernel"][...]
  assert ours.sharding.is_equivalent_to(theirs.sharding, 2) and bytes_per_device(theirs) * 8 == theirs.nbytes
  (m0, o0, _), (m1, o1, _) = run(nnx.Optimizer, AUTO), run(Zero1Optimizer, AUTO)
  assert_trees_close(m0, m1, atol=1e-7, rtol=1e-4)
  assert_trees_close(o0, o1, atol=1e-7, rtol=1e-4)


def test_report_says_the_layout_is_the_declared_one():
  with jax.set_mesh(AUTO):
    model = Declared(nnx.Rngs(0))
    plain = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    opt = Zero1Optimizer(model, optax.adamw(1e-2))
  rows = {r.path: r for r in report(opt).rows}
  row = rows["[0].mu['l1']['kernel']"]
  assert (row.sharded, row.note, row.data_axes) == (True, Reason.DECLARED, ("data",))
  assert row.replicated_optimizer_bytes == row.bytes_per_device  # nnx.Optimizer places it there too
  assert f"sharded over data, {Reason.DECLARED}" in str(report(opt))
  assert not rows["[0].mu['l2']['kernel']"].note
  assert report(opt).unsharded_bytes == bytes_per_device(nnx.as_pure(plain.opt_state))
  leaf = {leaf.path: leaf for leaf in opt.zero1_plan.state_leaves}["[0].mu['l1']['kernel']"]
  assert (leaf.reason, leaf.note) == (None, Reason.DECLARED)


@pytest.mark.parametrize(
    "declared, why",
    [
        ((None, None), "names no data axis, so every replica would hold the whole state"),
        (("data", "data"), "names a mesh axis twice"),
        ((None, "fsdp"), "'fsdp', which is not a mesh axis"),
        ((None, None, "data"), "more entries than"),
    ],
    ids=["no-data-axis", "twice", "unknown-axis", "rank"],
)
def test_a_declared_layout_zero1_cannot_honour_is_refused_by_name_and_changes_nothing(declared, why):
  with jax.set_mesh(EXPLICIT):
    model = Declared(nnx.Rngs(0), declared)
  before = snapshot(model)
  with pytest.raises(Zero1Error) as err:
    Zero1Optimizer(model, optax.adamw(1e-2), EXPLICIT)
  message = str(err.value)
  assert "parameter ['l1']['kernel'] declares optimizer_sharding" in message
  assert str(P(*declared)) in message and why in message and "('data',)" in message
  assert_unchanged(before, model)


def test_a_declared_layout_that_does_not_divide_is_refused():
  with jax.set_mesh(EXPLICIT):
    model = nnx.Linear(16, 12, kernel_metadata={"optimizer_sharding": (None, "data")}, rngs=nnx.Rngs(0))
  before = snapshot(model)
  with pytest.raises(Zero1Error, match=r"\['kernel'\].*dimension 1 of shape \(16, 12\) does not divide by"):
    Zero1Optimizer(model, optax.adam(1e-2), EXPLICIT)
  assert_unchanged(before, model)


def test_declared_specs_read_logical_names_as_flax_places_them():
  rules = (("embed", None), ("mlp", "data"))
  variables = {
      "w": nnx.Param(np.ones((4, 8), np.float32), optimizer_sharding=("embed", "mlp"), sharding_rules=rules),
      "b": nnx.Param(np.ones(8, np.float32)),
  }
  assert declared_specs(variables) == (None, P(None, "data"))
