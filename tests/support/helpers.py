"""Shared test fixtures: a small MLP, deterministic data, and a jitted train loop
that runs the plain ``nnx.Optimizer`` and ``Zero1Optimizer`` the same way."""

from __future__ import annotations

import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


class MLP(nnx.Module):
  """16 -> 128 -> 128 -> 3. The last bias (3) divides by no data size > 1 and stays replicated.

  Every split leaf keeps >= 16 elements per device at dp=8: on CPU, XLA contracts
  multiply-adds into FMAs in vectorised loop bodies but may round a remainder shorter
  than the SIMD width differently, which would break bit-identity for reasons that
  have nothing to do with Zero-1 (see docs/limitations.md).
  """

  def __init__(self, rngs: nnx.Rngs, kernel_sharding=None):
    init = nnx.initializers.lecun_normal()
    if kernel_sharding is not None:
      init = nnx.with_partitioning(init, kernel_sharding)
    self.l1 = nnx.Linear(16, 128, kernel_init=init, rngs=rngs)
    self.l2 = nnx.Linear(128, 128, rngs=rngs)
    self.l3 = nnx.Linear(128, 3, rngs=rngs)

  def __call__(self, x):
    return self.l3(jax.nn.gelu(self.l2(jax.nn.gelu(self.l1(x)))))


class PlainTrainer:
  """A trainer of one's own with a plain ``nnx.Optimizer``: what ``ShardedOptimizerMixin`` is mixed into."""

  def __init__(self, model, tx):
    self.optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)


def batches(n_steps: int, batch: int = 16, seed: int = 0):
  """Deterministic (x, y) batches."""
  rng = np.random.default_rng(seed)
  return [
      (rng.standard_normal((batch, 16), dtype=np.float32), rng.standard_normal((batch, 3), dtype=np.float32))
      for _ in range(n_steps)
  ]


def loss_fn(model, x, y):
  return jnp.mean((model(x) - y) ** 2)


@nnx.jit
def train_step(model, opt, x, y):
  loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
  opt.update(model, grads)
  return loss


# Gradients and updates as two jitted functions: the gradient one compiles once for a whole
# matrix of optimizers, so each case compiles only the optimizer steps it compares.
@nnx.jit
def grads_of(model, x, y):
  return nnx.grad(loss_fn)(model, x, y)


@nnx.jit
def apply_grads(model, opt, grads):
  opt.update(model, grads)


def train(model, opt, mesh, data, step=train_step, data_axis="data"):
  """Runs ``step`` over ``data`` with the batch sharded over ``data_axis``; returns the losses."""
  shard = NamedSharding(mesh, P(data_axis))
  losses = []
  for x, y in data:
    losses.append(step(model, opt, jax.device_put(x, shard), jax.device_put(y, shard)))
  return np.array(losses)


def pure(tree):
  """The arrays of an nnx state or module, as a flat list of numpy arrays."""
  if isinstance(tree, nnx.Module | nnx.Optimizer):
    tree = nnx.state(tree)
  return [np.asarray(x) for x in jax.tree.leaves(nnx.as_pure(tree))]


def assert_trees_equal(a, b):
  """Bit-identical, leaf by leaf."""
  la, lb = pure(a), pure(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb, strict=True):
    np.testing.assert_array_equal(x, y)


def assert_trees_close(a, b, atol=1e-6, rtol=1e-6):
  la, lb = pure(a), pure(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb, strict=True):
    np.testing.assert_allclose(x, y, atol=atol, rtol=rtol)


def adam_drift_bound(lr: float, steps: int, b1: float = 0.9, b2: float = 0.999) -> float:
  """How far apart, per element, two adam(w) runs can end whose gradients differ only in the
  order of their sums.

  Adam's step ``lr * m_hat / (sqrt(v_hat) + eps)`` is at most ``lr * max(1, (1 - b1) /
  sqrt(1 - b2))`` in size (Kingma & Ba, section 2.1), whatever the gradient; a gradient near
  zero whose last bit differs can change sign, so the two runs may step that far in opposite
  directions, every step.
  """
  return 2 * lr * steps * max(1.0, (1 - b1) / np.sqrt(1 - b2))


def assert_reordered_adam_close(a, b, lr: float, steps: int, typical: float = 1e-5, share: float = 0.01):
  """``a`` and ``b`` (trees of parameters or optimizer state) from adam(w) runs whose gradient sums
  were taken in another order: every element within :func:`adam_drift_bound`, and all but ``share``
  of them within ``typical``. A wrong reduction (a missed average, a dropped replica) moves nearly
  every element, so the second check still catches it; the first is all the arithmetic promises.
  """
  la, lb = pure(a), pure(b)
  assert len(la) == len(lb)
  bound = adam_drift_bound(lr, steps)
  far, total = 0, 0
  for x, y in zip(la, lb, strict=True):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    diff = np.abs(x - y)
    assert np.all(diff <= bound + typical * (1 + np.abs(y))), (float(diff.max()), bound)
    far += int(np.sum(diff > typical * (1 + np.abs(y))))
    total += diff.size
  assert far <= share * total, f"{far} of {total} elements differ by more than {typical} (relative)"


def bytes_by_kind(opt) -> dict[str, int]:
  """The most bytes any one device holds of the optimizer state, per memory kind (``addressable_shards``)."""
  held: dict[tuple, int] = {}
  for leaf in jax.tree.leaves(nnx.as_pure(opt.opt_state)):
    for shard in leaf.addressable_shards:
      key = (shard.data.sharding.memory_kind, shard.device)
      held[key] = held.get(key, 0) + shard.data.nbytes
  return {kind: max(n for (k, _), n in held.items() if k == kind) for kind in {k for k, _ in held}}


def assert_fraction_kept_on_device(opt, fraction, total):
  """``offload_state_to_host=fraction``: device memory holds at most (1 - fraction) of the state's
  ``total`` bytes per device, and less than that by under one leaf."""
  held = bytes_by_kind(opt)
  leaves = jax.tree.leaves(nnx.as_pure(opt.opt_state))
  largest = max(max(s.data.nbytes for s in x.addressable_shards) for x in leaves)
  assert held.get("device", 0) + held.get("pinned_host", 0) == total
  assert total * (1 - fraction) - largest <= held.get("device", 0) <= total * (1 - fraction)


def shardings(tree):
  """The sharding of every array leaf of an nnx state or module."""
  if isinstance(tree, nnx.Module | nnx.Optimizer):
    tree = nnx.state(tree)
  return [x.sharding for x in jax.tree.leaves(nnx.as_pure(tree))]


def placed(model, mesh):
  """``model`` with every parameter on ``mesh`` by its named sharding, as Zero-1 asks of a model built
  outside ``jax.set_mesh``."""
  nnx.update(model, jax.device_put(nnx.state(model), nnx.get_named_sharding(nnx.state(model), mesh)))
  return model


def snapshot(*objs):
  """Values and shardings of every array of some modules / optimizers, to check nothing changed."""
  return [(np.asarray(x), x.sharding) for obj in objs for x in jax.tree.leaves(nnx.as_pure(nnx.state(obj)))]


def assert_unchanged(before, *objs):
  """Every array equals its ``snapshot`` value (NaN-equal) and has the same sharding."""
  after = snapshot(*objs)
  assert len(after) == len(before)
  for (a, sa), (b, sb) in zip(before, after, strict=True):
    np.testing.assert_array_equal(a, b)
    assert sa == sb, (sa, sb)


class Decoder(nnx.Module):
  """A one-layer decoder-only transformer over token ids: (batch, seq) -> (batch, seq, vocab).

  Written to run both on global arrays of an Explicit mesh and per replica inside
  ``shard_map``: the embedding lookup is a one-hot matmul (a gather would need an
  ``out_sharding`` in Explicit mode, and ``auto_axes`` cannot run in Manual mode).
  Every dimension is a multiple of 16 so split leaves keep >= 16 elements per
  device at dp=4 (see ``MLP``).
  """

  def __init__(self, rngs: nnx.Rngs, vocab: int = 64, dim: int = 64, heads: int = 4, ffn: int = 128):
    linear = lambda n_in, n_out: nnx.Linear(n_in, n_out, use_bias=False, rngs=rngs)
    self.heads = heads
    self.embed = nnx.Embed(vocab, dim, rngs=rngs)
    self.attn_norm, self.mlp_norm, self.final_norm = (nnx.RMSNorm(dim, rngs=rngs) for _ in range(3))
    self.qkv, self.out = linear(dim, 3 * dim), linear(dim, dim)
    self.up, self.down = linear(dim, ffn), linear(ffn, dim)

  def __call__(self, tokens):
    x = jax.nn.one_hot(tokens, self.embed.num_embeddings) @ self.embed.embedding[...]
    b, t, d = x.shape
    q, k, v = jnp.split(self.qkv(self.attn_norm(x)).reshape(b, t, 3 * self.heads, d // self.heads), 3, axis=2)
    x = x + self.out(jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, t, d))
    x = x + self.down(jax.nn.gelu(self.up(self.mlp_norm(x))))
    return self.embed.attend(self.final_norm(x))


def lm_loss(model, batch):
  """Mean next-token cross-entropy of ``batch["tokens"]`` shaped (batch, seq + 1)."""
  tokens = batch["tokens"]
  logits = model(tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def _process_settings() -> tuple:
  import flax

  return flax.config.flax_always_shard_variable, jax.lax.with_sharding_constraint, jax.lax.top_k


def _apply_process_settings(settings: tuple) -> None:
  import flax

  flax.config.update("flax_always_shard_variable", settings[0])
  jax.lax.with_sharding_constraint, jax.lax.top_k = settings[1:]


_MAXTEXT_SETTINGS: list[tuple] = []  # what importing maxtext set, for the next module that runs it


def maxtext_process_settings_put_back():
  """Importing maxtext turns flax's eager variable sharding off and wraps two jax.lax functions
  for the whole process, once. Used as a module-scoped autouse fixture: the module runs with
  maxtext's settings (also when an earlier module imported it and put them back), and the
  tests collected after it get the process's own settings back."""
  saved = _process_settings()
  if _MAXTEXT_SETTINGS:
    _apply_process_settings(_MAXTEXT_SETTINGS[0])
  yield
  if "maxtext" in sys.modules:
    _MAXTEXT_SETTINGS[:] = [_process_settings()]
  _apply_process_settings(saved)


# A refusal's fix: a clause that starts with what to do (what to pass, what to use instead, where the
# docs say it), after the problem is named.
_FIX = re.compile(
    r"(?:^|[;:.(,]\s*|\bor\s+|\bthen\s+)(?:e\.g\.\s+)?(?:pass|use|set|leave|drop|call|place|build|restore|"
    r"put|give|declare|compute|keep|list|install|see|choose|report it)\b", re.IGNORECASE)


def names_a_fix(message: str) -> bool:
  """Whether a ``Zero1Error`` message says what to do: a clause that starts with a fix's verb."""
  return _FIX.search(message) is not None
