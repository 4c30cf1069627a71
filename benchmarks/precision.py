"""Loss curves of the bfloat16 levers against float32, on the bench's model and virtual CPU devices.

``python -m benchmarks.precision --steps 300`` trains the bench's ``small`` transformer
(adamw 1e-3, data=8) from one initialisation on one stream of learnable token sequences
(each an arithmetic progression modulo the vocabulary) once per arm:

- ``zero1``: ``Zero1Optimizer`` with float32 state (the reference);
- ``zero1-bf16state``: ``state_dtype=jnp.bfloat16`` with stochastic rounding (the default);
- ``zero1-bf16state-nearest``: the same, rounded to nearest.

Writes ``precision.json`` (every arm's losses, its state bytes per device, and its final
loss's relative gap to the reference over the last tenth of the run) and ``precision.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
from typing import Any

ARMS: dict[str, dict[str, Any]] = {
    "zero1": {},
    "zero1-bf16state": {"state_dtype": "bfloat16"},
    "zero1-bf16state-nearest": {"state_dtype": "bfloat16", "state_rounding": "nearest"},
}


def progressions(vocab: int, batch: int, seq: int, step: int) -> Any:
  """One step's token ids (batch, seq + 1): arithmetic progressions modulo ``vocab``.

  Example::

    >>> progressions(16, 2, 4, 0).shape
    (2, 5)
  """
  import numpy as np

  rng = np.random.default_rng(step)
  start = rng.integers(0, vocab, (batch, 1))
  stride = rng.integers(1, 8, (batch, 1))
  return ((start + stride * np.arange(seq + 1)) % vocab).astype(np.int32)


def run(steps: int, dp: int, out: pathlib.Path) -> dict[str, Any]:
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from flax import nnx
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from benchmarks.model import loss_fn
  from benchmarks.settings import Settings, new_model
  from nnx_zero1 import Zero1Optimizer, bytes_per_device

  settings = Settings(model="small")
  cfg = settings.config
  mesh = jax.make_mesh((dp,), ("data",))
  batch_sharding = NamedSharding(mesh, P("data"))

  @nnx.jit
  def step(model, optimizer, tokens):
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)
    optimizer.update(model, grads)
    return loss

  result: dict[str, Any] = {"model": "small", "dp": dp, "steps": steps, "lr": 1e-3, "arms": {}}
  with jax.set_mesh(mesh):
    for arm, options in ARMS.items():
      model = new_model(settings, mesh)
      options = {k: jnp.dtype(v) if k == "state_dtype" else v for k, v in options.items()}
      optimizer = Zero1Optimizer(model, optax.adamw(1e-3), mesh, **options)
      losses = [
          float(step(model, optimizer, jax.device_put(progressions(cfg.vocab, 16, cfg.seq_len, i), batch_sharding)))
          for i in range(steps)
      ]
      result["arms"][arm] = {
          "losses": losses,
          "opt_state_bytes_per_device": bytes_per_device(nnx.as_pure(optimizer.opt_state)),
      }
      print(f"{arm}: final loss {np.mean(losses[-max(1, steps // 10):]):.4f}", file=sys.stderr)
  tail = max(1, steps // 10)
  reference = float(np.mean(result["arms"]["zero1"]["losses"][-tail:]))
  for arm, row in result["arms"].items():
    final = float(np.mean(row["losses"][-tail:]))
    row["final_loss"] = final
    row["final_gap_to_float32_state"] = (final - reference) / reference
  out.mkdir(parents=True, exist_ok=True)
  (out / "precision.json").write_text(json.dumps(result, indent=1))
  _plot(result, out / "precision.png")
  return result


def _plot(result: dict[str, Any], path: pathlib.Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(7, 4))
  for arm, row in result["arms"].items():
    ax.plot(row["losses"], label=f"{arm} (final {row['final_loss']:.3f})", linewidth=1)
  ax.set_xlabel("step")
  ax.set_ylabel("loss")
  ax.set_yscale("log")
  ax.set_title(f"bench model 'small', adamw 1e-3, data={result['dp']}: optimizer state precision")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m benchmarks.precision", description=__doc__.split("\n")[0])
  p.add_argument("--steps", type=int, default=300)
  p.add_argument("--dp", type=int, default=8)
  p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench_out"))
  args = p.parse_args(argv)
  if args.steps < 1 or args.dp < 1:
    p.error("--steps and --dp must be >= 1")
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.dp}"
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  run(args.steps, args.dp, args.out)
  return 0


if __name__ == "__main__":
  sys.exit(main())
