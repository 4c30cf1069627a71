"""``Zero1Optimizer(params_across_dtype=...)``: the new parameters' all-gather over the slow data axes in int8
blocks with float32 scales (or a narrower float), inside each slice at full precision; the masters exact.

8 virtual CPU devices as ``replica=2 x data=4`` (``replica`` for two slices). The reference is the float32
lever (``data_axis=("replica", "data")``, no masters) given the same gradients: the masters must equal its
parameters bit for bit, the model's copy within the blocks' rounding of them, the same on every replica.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_zero1 import (
  ShardedOptimizerMixin,
  Zero1Error,
  Zero1ModelAndOptimizer,
  Zero1Optimizer,
  bytes_per_device,
  value_and_grad_accumulated,
  zero1_optimizers,
)
from nnx_zero1._src.stages import INT8_BLOCK
from nnx_zero1_plan.slow_network_bytes import across_bytes
from tests.support.accumulate import explicit_mesh
from tests.support.helpers import PlainTrainer, assert_trees_equal, assert_unchanged, snapshot

AXES = ("replica", "data")
F32 = jnp.float32
INT8 = {"master_dtype": F32, "params_across_dtype": jnp.int8}
SLICES = [0] * 4 + [1] * 4  # the devices' slices, in the mesh's order


class MLP(nnx.Module):
  """Two layers whose every dimension divides by the pod's 8 devices: each leaf is split over both axes."""

  def __init__(self, rngs: nnx.Rngs, dtype=F32):
    self.up = nnx.Linear(16, 256, param_dtype=dtype, rngs=rngs)
    self.down = nnx.Linear(256, 16, param_dtype=dtype, rngs=rngs)

  def __call__(self, x):
    return self.down(jax.nn.gelu(self.up(x)))


def loss_fn(model, batch):
  return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def build(mesh, dtype=F32, **kwargs):
  with jax.set_mesh(mesh):
    model = MLP(nnx.Rngs(0), dtype)
    nnx.update(model, jax.device_put(nnx.state(model), NamedSharding(mesh, P())))
    return model, Zero1Optimizer(model, optax.adamw(1e-2), mesh, data_axis=AXES, **kwargs)


def fixed_grads(model, step):
  """The same gradients for both optimizers, whatever their parameters: the masters can be compared."""
  rng = np.random.default_rng(step)
  return jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), nnx.state(model, nnx.Param))


@nnx.jit
def update(model, opt, grads):
  opt.update(model, grads)


def params(model):
  return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def assert_same_on_every_device(model):
  """Every device holds the same values of every parameter: the replicas never diverge."""
  for x in jax.tree.leaves(nnx.state(model, nnx.Param)):
    copies = [np.asarray(s.data) for s in x.addressable_shards]
    for copy in copies[1:]:
      np.testing.assert_array_equal(copy, copies[0])


@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
@pytest.mark.parametrize("dtype, rounding", [(jnp.int8, 1 / 254), (jnp.bfloat16, 2.0**-8)],
                         ids=["int8", "bfloat16"])
def test_the_model_gets_the_float32_levers_parameters_within_the_rounding_and_the_masters_exactly(
    kind, dtype, rounding):
  """Three steps on the same gradients: the masters are the float32 lever's parameters bit for bit; the
  model's copy is them rounded once on the way across (int8: to half a step of its block's largest
  magnitude / 127; bfloat16: half a unit in its last bit, at most 2^-8 of it), the same on every device, and
  not exact."""
  mesh = explicit_mesh((2, 4), AXES, kind)
  exact_model, exact = build(mesh)
  model, opt = build(mesh, master_dtype=F32, params_across_dtype=dtype)
  with jax.set_mesh(mesh):
    for step in range(3):
      update(exact_model, exact, fixed_grads(exact_model, step))
      update(model, opt, fixed_grads(model, step))
  assert_trees_equal(nnx.state(opt.master_params), nnx.state(exact_model, nnx.Param))
  for want, got in zip(params(exact_model), params(model), strict=True):
    assert got.dtype == want.dtype
    assert np.max(np.abs(got - want)) <= rounding * np.max(np.abs(want)), np.max(np.abs(got - want))
  assert any(np.any(got != want) for want, got in zip(params(exact_model), params(model), strict=True))
  assert_same_on_every_device(model)
  assert [x.sharding.spec for x in jax.tree.leaves(nnx.state(model, nnx.Param))] == [
      x.sharding.spec for x in jax.tree.leaves(nnx.state(exact_model, nnx.Param))]


def test_the_lever_trains_with_both_hops_in_int8_as_the_float32_lever_does():
  """zero1-pod-master-accum-int8across end to end: gradients reduce-scattered across in int8
  (``across_dtype``), the parameters gathered back in int8; five steps' losses within 1% of the float32
  lever's, the replicas in step."""
  mesh = explicit_mesh((2, 4), AXES)
  rng = np.random.default_rng(0)
  batch = {k: jax.device_put(rng.normal(size=(32, 16)).astype(np.float32), NamedSharding(mesh, P(AXES)))
           for k in ("x", "y")}

  @nnx.jit(static_argnames="across")
  def step(model, opt, batch, across):
    loss, grads = value_and_grad_accumulated(loss_fn, model, batch, micro_batches=2, optimizer=opt,
                                             data_axis=AXES, across_dtype=across)
    opt.update(model, grads)
    return loss

  runs = {}
  for name, across, kwargs in (("float32", None, {}), ("int8", jnp.int8, INT8)):
    model, opt = build(mesh, **kwargs)
    with jax.set_mesh(mesh):
      runs[name] = [float(step(model, opt, batch, across)) for _ in range(5)]
    assert_same_on_every_device(model)
  assert runs["int8"][-1] < runs["int8"][0]
  np.testing.assert_allclose(runs["int8"], runs["float32"], rtol=0.01)


def test_what_crosses_is_int8_blocks_and_their_scales_and_inside_is_unchanged():
  """Compiled for two slices of four (the planner's accounting, by replica group): what the parameters'
  gather sends across is each device's block of every leaf in int8 (m values in ceil(m/256) equal blocks)
  and one float32 scale per block, nothing else in float32: about a quarter of the float32 lever's bytes
  (25.6% here, the tiny biases' scales included); inside the slices what it sends without the option."""
  mesh = explicit_mesh((2, 4), AXES)

  def sent(**kwargs):
    model, opt = build(mesh, **kwargs)
    with jax.set_mesh(mesh):
      hlo = update.lower(model, opt, fixed_grads(model, 0)).compile().as_text()
    gathers = across_bytes(hlo, SLICES)["all-gather"]
    return gathers["across_bytes"], gathers["bytes"] - gathers["across_bytes"], hlo, model

  exact_across, exact_inside, _, _ = sent()
  across, inside, hlo, model = sent(**INT8)
  blocks = lambda m: -(-m // INT8_BLOCK)
  local = [x.size // 8 for x in jax.tree.leaves(nnx.state(model, nnx.Param))]
  assert across == sum(blocks(m) * -(-m // blocks(m)) + 4 * blocks(m) for m in local)
  assert exact_across == sum(4 * m for m in local)
  assert across <= 0.26 * exact_across
  assert inside == exact_inside
  # Over replica's groups, listed (jax 0.10) or named by mesh axes (jax 0.12: ``mesh[...] {'replica'}``).
  crossing = [line for line in hlo.splitlines()
              if " all-gather(" in line and ("{{0,4}" in line or "] {'replica'}" in line)]
  assert sorted(line.split(" = ")[1][:3] for line in crossing) == ["f32"] * len(local) + ["s8["] * len(local)


@pytest.mark.parametrize("dtype", [F32, jnp.bfloat16], ids=["float32-model", "bfloat16-model"])
def test_one_slice_rounds_nothing(dtype):
  """On one slice (replica=1) nothing crosses: the parameters are the lever's without the option, bit for
  bit (a float32 model's: the float32 lever's, no masters; a bfloat16 model's: with float32 masters)."""
  mesh = explicit_mesh((1, 8), AXES)
  plain_model, plain = build(mesh, dtype, **({} if dtype == F32 else {"master_dtype": F32}))
  model, opt = build(mesh, dtype, **INT8)
  assert opt.zero1_plan.params_across_dtype is None
  with jax.set_mesh(mesh):
    for step in range(2):
      update(plain_model, plain, fixed_grads(plain_model, step))
      update(model, opt, fixed_grads(model, step))
  assert_trees_equal(nnx.state(model, nnx.Param), nnx.state(plain_model, nnx.Param))


def test_float32_masters_of_a_float32_model_are_kept_only_for_a_rounded_gather():
  """Without ``params_across_dtype`` float32 masters of a float32 model change nothing (refused); with it
  they hold the exact values, 1/8 of each parameter per device."""
  mesh = explicit_mesh((2, 4), AXES)
  with pytest.raises(Zero1Error, match="every parameter is float32 already"):
    build(mesh, master_dtype=F32)
  _, opt = build(mesh, **INT8)
  kernel = opt.master_params["up"]["kernel"][...]
  assert kernel.dtype == F32 and bytes_per_device(kernel) == 16 * 256 * 4 // 8
  assert opt.zero1_plan.params_across_dtype == "int8"


@pytest.mark.parametrize("model_dtype, kwargs, match", [
    (F32, {"master_dtype": F32, "params_across_dtype": jnp.int32}, "params_across_dtype=int32 is neither"),
    (F32, {"master_dtype": F32, "params_across_dtype": jnp.uint8}, "params_across_dtype=uint8 is neither"),
    (F32, {"master_dtype": F32, "params_across_dtype": "not a dtype"}, "is not a dtype"),
    (F32, {"params_across_dtype": jnp.int8}, "set master_dtype"),
    (F32, {**INT8, "data_axis": "data"}, r"split over \('data',\) only"),
    (F32, {"master_dtype": F32, "params_across_dtype": F32}, "these are float32 already"),
    (jnp.bfloat16, {"master_dtype": F32, "params_across_dtype": jnp.bfloat16}, "these are bfloat16 already"),
    (jnp.bfloat16, {"master_dtype": F32, "params_across_dtype": jnp.float16}, "these are bfloat16 already"),
], ids=["int32", "uint8", "not-a-dtype", "no-masters", "one-data-axis", "float32-model-float32",
        "bfloat16-model-bfloat16", "bfloat16-model-float16"])
def test_where_it_cannot_apply_it_is_refused_and_nothing_changes(model_dtype, kwargs, match):
  mesh = explicit_mesh((2, 4), AXES)
  with jax.set_mesh(mesh):
    model = MLP(nnx.Rngs(0), model_dtype)
  before = snapshot(model)
  with pytest.raises(Zero1Error, match=match):
    Zero1Optimizer(model, optax.adamw(1e-2), mesh, **{"data_axis": AXES, **kwargs})
  assert_unchanged(before, model)


class _Zero1Trainer(ShardedOptimizerMixin, PlainTrainer):
  zero1_data_axis = AXES
  zero1_master_dtype = F32
  zero1_params_across_dtype = jnp.int8


@pytest.mark.parametrize("entry", ["model_and_optimizer", "scope", "mixin"])
def test_every_entry_point_passes_it_on(entry):
  mesh = explicit_mesh((2, 4), AXES)
  with jax.set_mesh(mesh):
    model = MLP(nnx.Rngs(0))
    if entry == "model_and_optimizer":
      opt = Zero1ModelAndOptimizer(model, optax.sgd(0.1), mesh, data_axis=AXES, **INT8)
    elif entry == "scope":
      with zero1_optimizers(mesh, AXES, **INT8):
        opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    else:
      opt = _Zero1Trainer(model, optax.sgd(0.1)).optimizer
  assert isinstance(opt, Zero1Optimizer) and opt.zero1_plan.params_across_dtype == "int8"
