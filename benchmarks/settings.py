"""What the bench runs: its arms, optimizers, settings, model and data, shared by every mode."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks.model import CONFIGS, Config, Transformer, count_params
from nnx_zero1_plan import OPTIMIZERS as MENU
from nnx_zero1_plan import Lever
from nnx_zero1_plan import make_optimizer as lever_optimizer

__all__ = [
    "ACCUMULATE_OPTIONS", "LEVER_REFERENCE", "OPTIMIZERS", "OPTIMIZER_OPTIONS", "STEP_ARMS", "TRAINING_RATES",
    "Settings", "describe", "lever", "make_optimizer", "new_model",
    "row_fields", "tokens",
]

# The arms that train with one compiled step, and how: (Zero-1?, deferred reduction?).
STEP_ARMS = {
    "baseline": (False, False),  # nnx.Optimizer; lax.scan of nnx.value_and_grad
    "zero1": (True, False),  # Zero1Optimizer; the same step
    "accum": (False, True),  # nnx.Optimizer; value_and_grad_accumulated (one all-reduce per step)
    "zero1-accum": (True, True),  # Zero1Optimizer; value_and_grad_accumulated (one reduce-scatter per step)
    "zero2-accum": (True, True),  # zero1-accum with shard_accumulator=True (a reduce-scatter per micro-batch)
    "zero1-offload": (True, True),  # zero1-accum with offload_state_to_host=True
    "zero1-offload-0.25": (True, True),  # a quarter of the state's bytes offloaded, the largest leaves
    "zero1-offload-0.5": (True, True),  # half of them
    "zero2-offload": (True, True),  # zero1-accum with both levers
}

# The memory levers beyond Zero-1: each arm is zero1-accum plus options (docs/memory_levers.md).
ACCUMULATE_OPTIONS = {"zero2-accum": {"shard_accumulator": True},
                      "zero2-offload": {"shard_accumulator": True}}
OPTIMIZER_OPTIONS: dict[str, dict[str, Any]] = {
    "zero1-offload": {"offload_state_to_host": True},
    "zero1-offload-0.25": {"offload_state_to_host": 0.25},
    "zero1-offload-0.5": {"offload_state_to_host": 0.5},
    "zero2-offload": {"offload_state_to_host": True},
}
LEVER_REFERENCE = "zero1-accum"  # the arm the levers' step-time ratio is taken against

# The bench's --optimizer: the planner's menu (nnx_zero1_plan.OPTIMIZERS, the code a plan prints), at
# training rates. The planner only compiles, where a rate changes no bytes, and prints a fine-tuning rate
# (1e-5 for adamw); the bench trains a small model from scratch for a few steps and compares its arms'
# losses, which such a rate would leave where they started.
# adamw at weight decay 0.1 (optax's default 1e-4 is the planner's): the bench's measured losses were so.
TRAINING_RATES = {"adamw": 1e-3, "adam": 1e-3, "lion": 1e-4, "sgd": 1e-2}
TRAINING_OPTIONS: dict[str, dict[str, float]] = {"adamw": {"weight_decay": 0.1}}
OPTIMIZERS: dict[str, Callable[[], optax.GradientTransformation]] = {
    name: functools.partial(MENU[name], rate, **TRAINING_OPTIONS.get(name, {}))
    for name, rate in TRAINING_RATES.items()
}


@dataclasses.dataclass(frozen=True)
class Settings:
  """What the bench runs: one model, a grid of (dp, ga), and how long to time each cell.

  ``batch`` is the global micro-batch in sequences (fixed across dp, so each
  device gets ``batch / dp``); one optimizer step sees ``ga`` micro-batches.

  Example::

    >>> Settings(model="tiny", dp=(2,), ga=(1,), steps=2, warmup=1).batch
    8
  """

  model: str = "base"
  dp: tuple[int, ...] = (2, 4, 8)
  ga: tuple[int, ...] = (1, 8)
  steps: int = 10
  warmup: int = 2
  batch: int = 8
  seq_len: int | None = None  # None: the model config's
  optimizer: str = "adamw"
  seed: int = 0
  mesh: str = "explicit"  # or "auto": the mesh's axis type
  remat: bool = False  # recompute every layer in the backward pass (Config.remat)

  @property
  def config(self) -> Config:
    """The model's shape (with ``remat`` when asked)."""
    return dataclasses.replace(CONFIGS[self.model], remat=True) if self.remat else CONFIGS[self.model]


def lever(arm: str) -> Lever:
  """The step arm as the planner's lever: its optimizer and options, how it accumulates.

  Example::

    >>> lever("zero2-accum").accumulate_options
    {'shard_accumulator': True}
  """
  zero1, deferred = STEP_ARMS[arm]
  return Lever(zero1=zero1, deferred=deferred, optimizer_options=OPTIMIZER_OPTIONS.get(arm, {}),
               accumulate_options=ACCUMULATE_OPTIONS.get(arm, {}))


def make_optimizer(arm: str, model, tx, mesh):
  """The arm's optimizer: ``nnx.Optimizer`` or ``Zero1Optimizer`` over the mesh's ``"data"`` axis."""
  return lever_optimizer(lever(arm), model, tx, mesh)


def new_model(settings: Settings, mesh) -> Transformer:
  """A fresh model from ``settings.seed``, replicated on ``mesh``: every arm starts from it.

  Example::

    >>> import jax
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> new_model(Settings(model="tiny"), mesh).cfg.vocab
    256
  """
  model = Transformer(settings.config, rngs=nnx.Rngs(settings.seed))
  nnx.update(model, jax.device_put(nnx.state(model), NamedSharding(mesh, P())))
  return model


def tokens(settings: Settings, ga: int, step: int) -> np.ndarray:
  """The token ids of one optimizer step, shaped (ga, batch, seq + 1); the same for every arm.

  Example::

    >>> tokens(Settings(model="tiny"), ga=2, step=0).shape
    (2, 8, 33)
  """
  cfg = settings.config
  rng = np.random.default_rng((settings.seed, ga, step))
  shape = (ga, settings.batch, (settings.seq_len or cfg.seq_len) + 1)
  return rng.integers(0, cfg.vocab, size=shape, dtype=np.int32)


def describe(settings: Settings) -> dict[str, Any]:
  """The settings and model shape, for the bench's outputs.

  Example::

    >>> describe(Settings(model="tiny"))["params"]
    90432
  """
  return {
      "model": settings.model,
      "params": count_params(settings.config),
      "config": dataclasses.asdict(settings.config),
      "settings": {**dataclasses.asdict(settings), "seq_len": settings.seq_len or settings.config.seq_len},
  }


def row_fields(arm: str, dp: int, ga: int, settings: Settings, opt_bytes: int, mem: dict[str, int]) -> dict:
  """The fields every bench row carries, measured (CPU) or compiled ahead of time alike.

  Example::

    >>> mem = {"argument": 3, "temp": 2, "peak": 5}
    >>> row_fields("zero1", 2, 1, Settings(model="tiny"), 7, mem)["peak_bytes_per_device"]
    5
  """
  return {
      "arm": arm, "dp": dp, "ga": ga, "model": settings.model, "optimizer": settings.optimizer,
      "opt_state_bytes_per_device": opt_bytes,
      "argument_bytes_per_device": mem["argument"],
      "temp_bytes_per_device": mem["temp"],
      "peak_bytes_per_device": mem["peak"],
  }
