"""Leaves that cannot be split: ``report`` lists them with their bytes, ``strict=True``
refuses parameter-shaped ones by name, and on real LLM shapes almost nothing is left."""

import jax
import optax
import pytest
from flax import nnx

from nnx_zero1 import Zero1Error, Zero1Optimizer, report
from nnx_zero1._src.layout import Reason
from tests.support.helpers import MLP, assert_unchanged, snapshot

MESH = jax.make_mesh((8,), ("data",))


class Divisible(nnx.Module):
  """Every parameter has a dimension divisible by 8."""

  def __init__(self, rngs):
    self.l1 = nnx.Linear(16, 32, rngs=rngs)
    self.l2 = nnx.Linear(32, 8, rngs=rngs)


def test_report_lists_the_leaves_no_dimension_of_which_divides_with_their_bytes():
  with jax.set_mesh(MESH):
    opt = Zero1Optimizer(MLP(nnx.Rngs(0)), optax.adam(1e-2), MESH)
  left = [r for r in report(opt).rows if not r.sharded and r.shape]
  assert [(r.path, r.reason) for r in left] == [
      ("[0].mu['l3']['bias']", Reason.NOT_DIVISIBLE),
      ("[0].nu['l3']['bias']", Reason.NOT_DIVISIBLE),
  ]
  assert all(r.bytes_per_device == r.full_bytes == 3 * 4 for r in left)
  assert report(opt).replicated_bytes == 2 * 12 + 4  # and the step count
  text = str(report(opt))
  assert "[0].mu['l3']['bias']" in text and f"replicated: {Reason.NOT_DIVISIBLE}" in text


def test_strict_refuses_by_name_and_changes_nothing():
  with jax.set_mesh(MESH):
    model = MLP(nnx.Rngs(0))
  before = snapshot(model)
  with pytest.raises(Zero1Error) as err:
    Zero1Optimizer(model, optax.adam(1e-2), MESH, strict=True)
  message = str(err.value)
  for path in ("[0].mu['l3']['bias'] float32[3]", "[0].nu['l3']['bias'] float32[3]"):
    assert path in message
  assert "kernel" not in message and "count" not in message
  assert Reason.NOT_DIVISIBLE in message and "('data',)" in message
  assert_unchanged(before, model)


@pytest.mark.parametrize(
    "make_tx",
    [
        lambda: optax.adamw(1e-2),
        lambda: optax.contrib.muon(1e-2),  # Newton-Schulz coefficients (3,) are not per-parameter
        lambda: optax.adafactor(1e-2, min_dim_size_to_factor=8),  # (1,) placeholders, statistics
        lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
    ],
    ids=["adamw", "muon", "adafactor", "inject_hyperparams"],
)
def test_strict_accepts_every_parameter_shaped_leaf_split(make_tx):
  with jax.set_mesh(MESH):
    opt = Zero1Optimizer(Divisible(nnx.Rngs(0)), make_tx(), MESH, strict=True)
  assert not [r for r in report(opt).rows if r.reason == Reason.NOT_DIVISIBLE]


def test_real_llm_shapes_leave_at_most_half_a_percent_replicated_at_every_dp():
  shapes = pytest.importorskip("benchmarks.shapes")
  rows = shapes.shape_rows(shapes.REAL_SHAPES, dps=(2, 4, 8, 16))
  assert {r["model"] for r in rows} >= {"qwen3-0.6b", "llama-3.1-8b", "gemma-2-2b"}
  assert len(rows) == len(shapes.REAL_SHAPES) * 4
  for row in rows:
    assert row["replicated_fraction"] <= 0.005, row
    assert row["per_device_vs_ideal"] <= 1.005, row
