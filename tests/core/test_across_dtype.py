"""``value_and_grad_accumulated(across_dtype=jnp.bfloat16)`` and ``across_dtype=jnp.int8``: the stage of the
gradient reduction between slices or nodes in bfloat16, or in int8 blocks with a float32 scale each, the
stages inside at full precision; refused where it cannot apply.

8 virtual CPU devices as ``replica=2 x data=4`` (``replica`` for two slices). XLA's CPU compiler runs a
bfloat16 collective in float32 after rounding its operands, so the bytes are checked in the program as
lowered (the TPU and GPU compilers keep bfloat16: tests/planner/test_pod_plans.py counts what crosses),
and the values against the exact reduction.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_zero1 import Zero1Error, Zero1Optimizer, value_and_grad_accumulated
from nnx_zero1._src.stages import INT8_BLOCK
from nnx_zero1_plan.slow_network_bytes import across_bytes
from tests.support.accumulate import explicit_mesh
from tests.support.helpers import assert_trees_equal

AXES = ("replica", "data")
ROWS = 32
ACROSS_GROUPS = "{{0,4},{1,5},{2,6},{3,7}}"  # replica: device i of one slice with device i of the other


class MLP(nnx.Module):
  """Two layers whose every dimension divides by the pod's 8 devices: each leaf is split (a quick compile)."""

  def __init__(self, rngs: nnx.Rngs):
    self.up, self.down = nnx.Linear(16, 64, rngs=rngs), nnx.Linear(64, 16, rngs=rngs)

  def __call__(self, x):
    return self.down(jax.nn.gelu(self.up(x)))


def loss_fn(model, batch):
  return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def build(cls, mesh, **kwargs):
  with jax.set_mesh(mesh):
    model = MLP(nnx.Rngs(0))
    nnx.update(model, jax.device_put(nnx.state(model), NamedSharding(mesh, P())))
    return model, cls(model, optax.adamw(1e-2), wrt=nnx.Param, **kwargs)


def a_batch(mesh):
  rng = np.random.default_rng(0)
  batch = {k: rng.normal(size=(ROWS, 16)).astype(np.float32) for k in ("x", "y")}
  return jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P(AXES))), batch)


@nnx.jit(static_argnames=("across", "shard"))
def grads_of(model, opt, batch, across=None, shard=False):
  return value_and_grad_accumulated(loss_fn, model, batch, micro_batches=2, optimizer=opt, data_axis=AXES,
                                    across_dtype=across, shard_accumulator=shard)[1]


def leaves(state):
  return [np.asarray(x) for x in jax.tree.leaves(state)]


def pod(shape=(2, 4)):
  return explicit_mesh(shape, AXES)


LAYOUTS = pytest.mark.parametrize("cls, kwargs, shard", [
    (Zero1Optimizer, {"data_axis": AXES}, False),
    (Zero1Optimizer, {"data_axis": "data"}, False),
    (Zero1Optimizer, {"data_axis": AXES}, True),
    (nnx.Optimizer, {}, False),
], ids=["zero1-over-both", "zero1-inside", "zero2-over-both", "nnx-optimizer"])


def collective_lines(hlo):
  """The collectives over replica's groups (across the slices) and over data's (inside them), the groups
  listed (jax 0.10) or named by mesh axes (jax 0.12: ``replica_groups=mesh[...] {'replica'}``)."""
  across, inside = [], []
  for line in hlo.splitlines():
    if re.search(r" (reduce-scatter|all-reduce|all-gather|all-to-all)\(", line):
      (across if ACROSS_GROUPS in line or "] {'replica'}" in line else inside).append(line)
  return across, inside


@LAYOUTS
def test_only_the_hop_across_is_rounded_to_bfloat16(cls, kwargs, shard):
  mesh = pod()
  model, opt = build(cls, mesh, **kwargs)
  batch = a_batch(mesh)
  with jax.set_mesh(mesh):
    exact = leaves(grads_of(model, opt, batch, shard=shard))
    narrow = leaves(grads_of(model, opt, batch, across=jnp.bfloat16, shard=shard))
    lowered = grads_of.lower(model, opt, batch, across=jnp.bfloat16, shard=shard).as_text(dialect="hlo")
  assert [x.dtype for x in narrow] == [x.dtype for x in exact]
  # Each gradient is the sum of two slices' sums, each rounded to bfloat16 (8 bits of mantissa), and the
  # sum rounded again: within 2^-7 of the largest magnitude, and not the exact sum.
  for e, n in zip(exact, narrow, strict=True):
    assert np.max(np.abs(n - e)) <= 2.0**-7 * np.max(np.abs(e)) + 1e-30
  assert any(np.any(n != e) for e, n in zip(exact, narrow, strict=True))
  # In the program: every collective over replica's groups is bfloat16, none over data's is.
  across, inside = collective_lines(lowered)
  assert across and all(re.search(r"= bf16\[", line) for line in across), across
  assert inside and not [line for line in inside if re.search(r"= bf16\[", line)], inside


@LAYOUTS
def test_int8_crosses_as_int8_blocks_and_sums_in_float32(cls, kwargs, shard):
  """int8: what crosses is int8 blocks and their float32 scales (all-to-all, all-gather), nothing inside is
  narrowed, and each gradient is within the blocks' rounding of the exact sum, the same on every replica."""
  mesh = pod()
  model, opt = build(cls, mesh, **kwargs)
  batch = a_batch(mesh)
  with jax.set_mesh(mesh):
    exact = leaves(grads_of(model, opt, batch, shard=shard))
    narrow_state = grads_of(model, opt, batch, across=jnp.int8, shard=shard)
    lowered = grads_of.lower(model, opt, batch, across=jnp.int8, shard=shard).as_text(dialect="hlo")
  narrow = leaves(narrow_state)
  assert [x.dtype for x in narrow] == [x.dtype for x in exact]
  # Each value is rounded to 1/254 of its block's largest magnitude on the way across (twice where an
  # all-reduce gathers the int8 sums back): within 2^-6 of the largest gradient, and not the exact sum.
  for e, n in zip(exact, narrow, strict=True):
    assert np.max(np.abs(n - e)) <= 2.0**-6 * np.max(np.abs(e)) + 1e-30
  assert any(np.any(n != e) for e, n in zip(exact, narrow, strict=True))
  # Every replica holds the same values of what it holds in common (a gradient split over data alone is held
  # by one device per slice): the slices' optimizers stay in step.
  for x in jax.tree.leaves(narrow_state):
    by_index = {}
    for shard_ in x.addressable_shards:
      by_index.setdefault(str(shard_.index), []).append(np.asarray(shard_.data))
    for copies in by_index.values():
      for c in copies[1:]:
        np.testing.assert_array_equal(c, copies[0])
  across, inside = collective_lines(lowered)
  assert across and all(re.search(r" (all-to-all|all-gather)\(", line) for line in across), across
  payload = [line for line in across if re.search(r"= s8\[", line)]
  scales = [line for line in across if re.search(r"= f32\[", line)]
  assert payload and len(payload) == len(scales) == len(across) // 2, across
  assert inside and not [line for line in inside if re.search(r"= (s8|bf16)\[", line)], inside


@pytest.mark.parametrize("lever, op", [("data", "all-reduce"), (AXES, "reduce-scatter")],
                         ids=["all-reduced-across", "reduce-scattered-across"])
def test_int8_sends_a_quarter_of_the_bytes_across_and_its_scales(lever, op):
  """Compiled for two slices of four: what crosses (the planner's accounting, by replica group) is a quarter
  of the exact reduction's float32 bytes and one float32 scale per block, nothing more."""
  mesh = pod()
  with jax.set_mesh(mesh):
    model = nnx.Linear(256, 256, use_bias=False, rngs=nnx.Rngs(0))
    nnx.update(model, jax.device_put(nnx.state(model), NamedSharding(mesh, P())))
    opt = Zero1Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param, data_axis=lever)
  rng = np.random.default_rng(0)
  batch = {k: jax.device_put(rng.normal(size=(ROWS, 256)).astype(np.float32), NamedSharding(mesh, P(AXES)))
           for k in ("x", "y")}
  slices = [0] * 4 + [1] * 4

  def crossing(across):
    with jax.set_mesh(mesh):
      hlo = grads_of.lower(model, opt, batch, across=across).compile().as_text()
    return {k: c["across_bytes"] for k, c in across_bytes(hlo, slices).items() if c["across_bytes"]}

  exact, narrow = crossing(None), crossing(jnp.int8)
  assert set(exact) == {op}
  assert sum(narrow.values()) <= exact[op] / 4 * (1 + 4 / INT8_BLOCK)
  assert sum(narrow.values()) > exact[op] / 4  # the scales are counted
  assert set(narrow) == ({"all-to-all", "all-gather"} if op == "all-reduce" else {"all-to-all"})


@pytest.mark.parametrize("across", [jnp.bfloat16, jnp.int8], ids=["bfloat16", "int8"])
def test_one_slice_rounds_nothing(across):
  """On one slice (replica=1) nothing crosses, and the gradients are the exact reduction's, bit for bit."""
  mesh = pod((1, 8))
  model, opt = build(Zero1Optimizer, mesh, data_axis=AXES)
  batch = a_batch(mesh)
  with jax.set_mesh(mesh):
    assert_trees_equal(grads_of(model, opt, batch), grads_of(model, opt, batch, across=across))


NOT_A_DTYPE = r"must be a floating dtype or jnp.int8 \(block-scaled\); pass e.g. across_dtype=jnp.bfloat16"


@pytest.mark.parametrize("call, match", [
    (dict(data_axis="data"), "summed over \\('data',\\) only"),
    (dict(data_axis="data", across_dtype=jnp.int8), "summed over \\('data',\\) only"),
    (dict(across_dtype=jnp.int16), NOT_A_DTYPE),
    (dict(across_dtype=jnp.uint8), NOT_A_DTYPE),
    (dict(across_dtype="not a dtype"), "must be a floating dtype"),
    (dict(defer_reduction=False), "defer_reduction=False"),
    (dict(defer_reduction=False, across_dtype=jnp.int8), "across_dtype=int8 .* defer_reduction=False"),
], ids=["one-data-axis", "int8-one-data-axis", "int16", "uint8", "not-a-dtype", "not-deferred",
        "int8-not-deferred"])
def test_where_it_cannot_apply_it_is_refused_and_nothing_changes(call, match):
  mesh = pod()
  model, opt = build(Zero1Optimizer, mesh, data_axis="data")
  batch = a_batch(mesh)
  before = leaves((nnx.state(model), nnx.state(opt)))
  kwargs = {"data_axis": AXES, "across_dtype": jnp.bfloat16, **call}
  with jax.set_mesh(mesh), pytest.raises(Zero1Error, match=match):
    value_and_grad_accumulated(loss_fn, model, batch, micro_batches=2, optimizer=opt, **kwargs)
  for b, a in zip(before, leaves((nnx.state(model), nnx.state(opt))), strict=True):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("param_dtype, across", [(jnp.bfloat16, jnp.bfloat16), (jnp.float32, jnp.float32)],
                         ids=["bfloat16-params", "float32-across"])
def test_a_dtype_that_narrows_nothing_is_refused_and_nothing_changes(param_dtype, across):
  """bfloat16 parameters' gradients cross in bfloat16 already: the lever would send the same bytes."""
  mesh = pod()
  with jax.set_mesh(mesh):
    model = nnx.Linear(16, 16, param_dtype=param_dtype, rngs=nnx.Rngs(0))
    nnx.update(model, jax.device_put(nnx.state(model), NamedSharding(mesh, P())))
    opt = Zero1Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param, data_axis=AXES)
  batch = a_batch(mesh)
  before = leaves((nnx.state(model), nnx.state(opt)))
  name = jnp.dtype(param_dtype).name
  refused = pytest.raises(Zero1Error, match=f"narrows wider gradients .* these are {name} already")
  with jax.set_mesh(mesh), refused:
    value_and_grad_accumulated(loss_fn, model, batch, micro_batches=2, optimizer=opt, data_axis=AXES,
                               across_dtype=across)
  for b, a in zip(before, leaves((nnx.state(model), nnx.state(opt))), strict=True):
    np.testing.assert_array_equal(a, b)


class WithCounter(nnx.Module):
  """A float layer and an integer parameter (a step count someone put in ``nnx.Param``)."""

  def __init__(self, rngs: nnx.Rngs):
    self.dense = nnx.Linear(16, 16, rngs=rngs)
    self.count = nnx.Param(jnp.zeros((8,), jnp.int32))

  def __call__(self, x):
    return self.dense(x)


@pytest.mark.parametrize("across", [jnp.bfloat16, jnp.int8], ids=["bfloat16", "int8"])
def test_an_integer_parameter_is_refused_and_nothing_changes(across):
  mesh = pod()
  with jax.set_mesh(mesh):
    model = WithCounter(nnx.Rngs(0))
    nnx.update(model, jax.device_put(nnx.state(model), NamedSharding(mesh, P())))
    opt = nnx.Optimizer(model, optax.sgd(1e-2), wrt=nnx.Param)
  batch = a_batch(mesh)
  before = leaves((nnx.state(model), nnx.state(opt)))
  name = jnp.dtype(across).name
  refused = pytest.raises(Zero1Error,
                          match=f"across_dtype={name} rounds .* parameters of int32 have no gradient")
  with jax.set_mesh(mesh), refused:
    value_and_grad_accumulated(loss_fn, model, batch, micro_batches=2, optimizer=opt, data_axis=AXES,
                               across_dtype=across)
  for b, a in zip(before, leaves((nnx.state(model), nnx.state(opt))), strict=True):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("cls, kwargs", [
    (Zero1Optimizer, {"data_axis": "data"}),
    (Zero1Optimizer, {"data_axis": ("pod", "replica", "data")}),
    (nnx.Optimizer, {}),
], ids=["zero1-inside", "zero1-over-all", "nnx-optimizer"])
def test_int8_over_two_slow_axes_is_the_sum_within_its_rounding(cls, kwargs):
  """Pods of pods (``("pod", "replica", "data")``: both slow): the stages over the slow axes together, an
  all-to-all and an all-gather over a tuple of axes, within the blocks' rounding of the exact sum."""
  axes = ("pod", "replica", "data")
  mesh = explicit_mesh((2, 2, 2), axes)
  model, opt = build(cls, mesh, **kwargs)
  rng = np.random.default_rng(0)
  batch = {k: jax.device_put(rng.normal(size=(ROWS, 16)).astype(np.float32), NamedSharding(mesh, P(axes)))
           for k in ("x", "y")}
  grads = nnx.jit(lambda m, o, b, a: value_and_grad_accumulated(
      loss_fn, m, b, micro_batches=2, optimizer=o, data_axis=axes, across_dtype=a)[1], static_argnums=3)
  with jax.set_mesh(mesh):
    exact, narrow = leaves(grads(model, opt, batch, None)), leaves(grads(model, opt, batch, jnp.int8))
  for e, n in zip(exact, narrow, strict=True):
    assert np.max(np.abs(n - e)) <= 2.0**-6 * np.max(np.abs(e)) + 1e-30
  assert any(np.any(n != e) for e, n in zip(exact, narrow, strict=True))
