"""Bench arms for the MaxText-style ``Engine`` / ``Zero1Engine`` (deferred gradient reduction).

An engine step is ``ga`` calls of ``fwd_bwd`` (one compiled micro-batch
kernel) and one ``update`` (one compiled update kernel), timed together.
Per step: collectives are ``ga`` x the micro-batch kernel's plus the update
kernel's; the peak is the larger of (micro-batch kernel peak + optimizer
state, which stays resident meanwhile) and the update kernel's peak.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks import measure
from benchmarks.model import Transformer, loss_fn
from benchmarks.settings import OPTIMIZERS, Settings, new_model
from nnx_zero1 import bytes_per_device
from nnx_zero1.testing import collectives

__all__ = ["EngineArm", "token_loss"]


def token_loss(model: Transformer, batch: dict) -> jax.Array:
  """The engine's ``loss_fn(model, batch)``: next-token loss of ``batch["tokens"]``.

  Example::

    >>> import jax.numpy as jnp
    >>> from benchmarks.model import CONFIGS, Transformer
    >>> model = Transformer(CONFIGS["tiny"], rngs=nnx.Rngs(0))
    >>> float(token_loss(model, {"tokens": jnp.zeros((2, 9), jnp.int32)})) > 0
    True
  """
  return loss_fn(model, batch["tokens"])


class EngineArm:
  """``"engine"`` (``Engine``) or ``"zero1-engine"`` (``Zero1Engine``), driven like ``StepArm``.

  Example::

    arm = EngineArm("zero1-engine", settings, mesh, tokens(settings, ga, 0))
    loss = arm.step(arm.prepare(tokens(settings, ga, 1)))
  """

  def __init__(self, name: str, settings: Settings, mesh, example: np.ndarray):
    from tests.support.reference_engine import Engine, Zero1Engine

    cls = {"engine": Engine, "zero1-engine": Zero1Engine}[name]
    self.name = name
    self.mesh = mesh
    self.engine = cls(new_model(settings, mesh), OPTIMIZERS[settings.optimizer](), mesh, loss_fn=token_loss)
    micro = self.prepare(example)
    start = time.perf_counter()
    self.fwd_bwd = self.engine.lowered_fwd_bwd(micro[0]).compile()
    self.update = self.engine.lowered_update().compile()
    self.compile_s = time.perf_counter() - start
    self.ga = len(micro)

  def prepare(self, step_tokens: np.ndarray) -> list[dict]:
    """One step's micro-batches, each on the mesh with its batch over the data axis."""
    sharding = NamedSharding(self.mesh, P("data"))
    return [{"tokens": jax.device_put(t, sharding)} for t in step_tokens]

  def step(self, micro_batches: list[dict]) -> jax.Array:
    """``fwd_bwd`` on each micro-batch, then ``update``; returns the mean micro-batch loss."""
    losses = [self.engine.fwd_bwd(b) for b in micro_batches]
    self.engine.update()
    return sum(losses) / len(losses)  # type: ignore[return-value]  # an Array: losses is not empty

  def optimizer_bytes(self) -> int:
    """Optimizer-state bytes on the fullest device."""
    return bytes_per_device(nnx.state(self.engine.optimizer))

  def params(self) -> list[np.ndarray]:
    """The parameters, as host arrays."""
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(self.engine.model, nnx.Param))]

  def memory(self) -> dict[str, int]:
    """Per-device bytes: the update kernel's, with the peak over both kernels (see module doc)."""
    micro, update = measure.memory(self.fwd_bwd), measure.memory(self.update)
    peak = max(micro["peak"] + self.optimizer_bytes(), update["peak"])
    return {**update, "temp": max(micro["temp"], update["temp"]), "peak": peak}

  def collectives(self) -> dict[str, dict[str, Any]]:
    """Collectives of one step: ``ga`` micro-batch kernels and one update kernel."""
    micro = collectives(self.fwd_bwd.as_text() or "")
    update = collectives(self.update.as_text() or "")
    return {
        op: {k: self.ga * micro[op][k] + update[op][k] for k in ("count", "bytes")} for op in micro
    }
