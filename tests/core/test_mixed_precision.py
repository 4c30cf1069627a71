"""bfloat16 parameters, with float32 or bfloat16 moments: Zero-1 trains like
``nnx.Optimizer`` and every optimizer leaf keeps its dtype across steps.

XLA keeps bfloat16 intermediates in float32 where fusion allows
(``--xla_allow_excess_precision``, on by default), and the Zero-1 program fuses
differently from the plain one, so by default the two agree to bfloat16 rounding.
With excess precision off they are bit-identical: a child process checks that.
"""

import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_zero1 import Zero1Optimizer, report
from tests.support.helpers import MLP, batches, loss_fn, pure, train

STEPS = 3
MESHES = {
    "Explicit": jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,)),
    "Auto": jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,)),
}
TXS = {
    "adamw(mu_dtype=float32)": lambda: optax.adamw(1e-2, weight_decay=0.1, mu_dtype=jnp.float32),
    "adam": lambda: optax.adam(1e-2),
}
BF16_DRIFT = 2e-2  # |plain - zero1| / |plain| per leaf after 3 steps with excess precision on


def bf16_mlp():
  """``MLP`` with bfloat16 parameters (it computes in float32, so its gradients are bfloat16)."""
  model = MLP(nnx.Rngs(0))
  nnx.update(model, jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(model, nnx.Param)))
  return model


def dtypes(tree):
  flat = jax.tree_util.tree_flatten_with_path(nnx.as_pure(nnx.state(tree)))[0]
  return [(jax.tree_util.keystr(path), x.dtype) for path, x in flat]


def train_pair(name, mesh_kind):
  """Trains the plain and the Zero-1 optimizer on the same batches; checks no dtype ever changes."""
  mesh = MESHES[mesh_kind]
  runs = []
  for cls in (nnx.Optimizer, Zero1Optimizer):
    with jax.set_mesh(mesh):
      model = bf16_mlp()
      opt = cls(model, TXS[name](), wrt=nnx.Param)
      before = (dtypes(model), dtypes(opt))
      losses = train(model, opt, mesh, batches(STEPS))
    assert (dtypes(model), dtypes(opt)) == before
    runs.append((model, opt, losses, before))
  assert runs[0][3] == runs[1][3]
  return runs


@pytest.mark.parametrize("mesh_kind", list(MESHES))
@pytest.mark.parametrize("name", list(TXS))
def test_bf16_params_train_like_nnx_optimizer_and_keep_every_dtype(name, mesh_kind):
  (m0, o0, l0, _), (m1, o1, l1, (params, kinds)) = train_pair(name, mesh_kind)
  assert params and all(dtype == jnp.bfloat16 for _, dtype in params)
  moments = {dtype for path, dtype in kinds if "['mu']" in path}
  assert moments == {jnp.dtype(jnp.float32 if "mu_dtype" in name else jnp.bfloat16)}
  assert {dtype for path, dtype in kinds if "['nu']" in path} == {jnp.dtype(jnp.bfloat16)}
  np.testing.assert_allclose(l0, l1, rtol=BF16_DRIFT)
  for x, y in zip(pure(m0) + pure(o0), pure(m1) + pure(o1), strict=True):
    x, y = x.astype(np.float32), y.astype(np.float32)
    assert np.linalg.norm(x - y) <= BF16_DRIFT * np.linalg.norm(x)
  assert not all(np.array_equal(a, b) for a, b in zip(pure(m1), pure(bf16_mlp())))  # it trained
  split = [r for r in report(o1).rows if r.sharded]
  assert split and all(r.bytes_per_device * 8 == r.full_bytes for r in split)


@nnx.jit
def bf16_grads(model, x, y):
  return jax.tree.map(lambda g: g.astype(jnp.bfloat16), nnx.grad(loss_fn)(model, x, y))


@nnx.jit
def apply(model, opt, grads):
  opt.update(model, grads)


def bf16_grads_pair(mesh_kind):
  """Float32 parameters trained on bfloat16 gradients (cast by another jit) by both optimizers."""
  mesh = MESHES[mesh_kind]
  shard = NamedSharding(mesh, P("data"))
  runs = []
  for cls in (nnx.Optimizer, Zero1Optimizer):
    with jax.set_mesh(mesh):
      model = MLP(nnx.Rngs(0))
      opt = cls(model, TXS["adam"](), wrt=nnx.Param)
      for x, y in batches(STEPS):
        grads = bf16_grads(model, jax.device_put(x, shard), jax.device_put(y, shard))
        assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(jnp.bfloat16)}
        apply(model, opt, grads)
    runs.append(pure(model) + pure(opt))
  assert {x.dtype for x in runs[1] if x.dtype.kind == "f"} == {np.dtype(np.float32)}
  return runs


@pytest.mark.parametrize("mesh_kind", list(MESHES))
def test_bf16_gradients_of_f32_params_train_like_nnx_optimizer(mesh_kind):
  """optax promotes bfloat16 gradients against float32 moments, as under nnx.Optimizer
  (bit-identical with excess precision off: the child process below)."""
  plain, zero1 = bf16_grads_pair(mesh_kind)
  for x, y in zip(plain, zero1, strict=True):
    assert np.linalg.norm(x.astype(np.float64) - y) <= BF16_DRIFT * np.linalg.norm(x)


def test_bf16_is_bit_identical_without_excess_precision():
  flags = "--xla_force_host_platform_device_count=8 --xla_allow_excess_precision=false"
  env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
  root = pathlib.Path(__file__).resolve().parents[2]  # the child imports tests.support from the repository
  done = subprocess.run([sys.executable, "-m", "tests.core.test_mixed_precision"], env=env, cwd=root,
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
  assert done.stdout.count("bit-identical") == (len(TXS) + 1) * len(MESHES), done.stdout


if __name__ == "__main__":  # the child process of the test above
  assert "--xla_allow_excess_precision=false" in os.environ.get("XLA_FLAGS", "")
  for name in TXS:
    for mesh_kind in MESHES:
      (m0, o0, l0, _), (m1, o1, l1, _) = train_pair(name, mesh_kind)
      np.testing.assert_array_equal(l0, l1)
      for x, y in zip(pure(m0) + pure(o0), pure(m1) + pure(o1), strict=True):
        np.testing.assert_array_equal(x, y)
      print(name, mesh_kind, "bit-identical", flush=True)
  for mesh_kind in MESHES:
    for x, y in zip(*bf16_grads_pair(mesh_kind), strict=True):
      np.testing.assert_array_equal(x, y)
    print("bfloat16 gradients", mesh_kind, "bit-identical", flush=True)
