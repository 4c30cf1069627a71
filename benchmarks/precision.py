"""Loss curves of the bfloat16 levers against float32, on the bench's model and virtual CPU devices.

``python -m benchmarks.precision --steps 400`` trains the bench's ``small`` transformer
(adamw 1e-3, data=8) from one initialisation on one stream of learnable token sequences
(each an arithmetic progression modulo the vocabulary) once per arm. Two comparisons:

- the state's precision, float32 parameters and compute: ``zero1`` (float32 state, the
  reference), ``zero1-bf16state`` (``state_dtype=jnp.bfloat16``, stochastic rounding, the
  default) and ``zero1-bf16state-nearest`` (rounded to nearest);
- master weights, bfloat16 compute: ``zero1-f32params`` (float32 parameters cast to bfloat16
  inside the loss: the reference), ``zero1-master`` (bfloat16 parameters,
  ``master_dtype=jnp.float32``) and ``zero1-bf16`` (pure bfloat16: parameters and moments).

Writes ``precision.json`` (every arm's losses, optimizer bytes per device and the relative gap
of its final loss, the mean of the last tenth of the run, to its reference) and ``precision.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
from typing import Any

# arm: (its reference, the parameters' dtype, whether the loss computes in bfloat16, options).
ARMS: dict[str, tuple[str, str, bool, dict[str, Any]]] = {
    "zero1": ("zero1", "float32", False, {}),
    "zero1-bf16state": ("zero1", "float32", False, {"state_dtype": "bfloat16"}),
    "zero1-bf16state-nearest": (
        "zero1", "float32", False, {"state_dtype": "bfloat16", "state_rounding": "nearest"}),
    "zero1-f32params": ("zero1-f32params", "float32", True, {}),
    "zero1-master": ("zero1-f32params", "bfloat16", True, {"master_dtype": "float32"}),
    "zero1-bf16": ("zero1-f32params", "bfloat16", True, {}),
}
_DTYPE_OPTIONS = ("state_dtype", "master_dtype")


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
  import optax
  from flax import nnx
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from benchmarks.model import loss_fn
  from benchmarks.settings import Settings, new_model
  from nnx_zero1 import Zero1Optimizer, report

  settings = Settings(model="small")
  cfg = settings.config
  mesh = jax.make_mesh((dp,), ("data",))
  batch_sharding = NamedSharding(mesh, P("data"))

  def bf16_loss(model, tokens):
    graphdef, params, *rest = nnx.split(model, nnx.Param, ...)
    return loss_fn(nnx.merge(graphdef, jax.tree.map(lambda x: x.astype(jnp.bfloat16), params), *rest), tokens)

  @nnx.jit(static_argnums=3)
  def step(model, optimizer, tokens, bf16_compute):
    loss, grads = nnx.value_and_grad(bf16_loss if bf16_compute else loss_fn)(model, tokens)
    optimizer.update(model, grads)
    return loss

  result: dict[str, Any] = {"model": "small", "dp": dp, "steps": steps, "lr": 1e-3, "arms": {}}
  with jax.set_mesh(mesh):
    for arm, (_, param_dtype, bf16_compute, options) in ARMS.items():
      model = new_model(settings, mesh)
      params = nnx.state(model, nnx.Param)
      nnx.update(model, jax.tree.map(lambda x, dtype=param_dtype: x.astype(dtype), params))
      options = {k: jnp.dtype(v) if k in _DTYPE_OPTIONS else v for k, v in options.items()}
      optimizer = Zero1Optimizer(model, optax.adamw(1e-3), mesh, **options)
      losses = []
      for i in range(steps):
        batch = jax.device_put(progressions(cfg.vocab, 16, cfg.seq_len, i), batch_sharding)
        losses.append(float(step(model, optimizer, batch, bf16_compute)))
      result["arms"][arm] = {
          "reference": ARMS[arm][0], "param_dtype": param_dtype, "bf16_compute": bf16_compute,
          "options": {k: str(v) for k, v in options.items()}, "losses": losses,
          "optimizer_bytes_per_device": report(optimizer).per_device_bytes,
      }
      print(f"{arm}: final loss {final_loss(losses):.4f}", file=sys.stderr)
  for row in result["arms"].values():
    final = final_loss(row["losses"])
    reference = final_loss(result["arms"][row["reference"]]["losses"])
    row["final_loss"] = final
    row["final_gap_to_reference"] = (final - reference) / reference
  out.mkdir(parents=True, exist_ok=True)
  (out / "precision.json").write_text(json.dumps(result, indent=1))
  _plot(result, out / "precision.png")
  return result


def final_loss(losses: list[float]) -> float:
  """A run's final loss: the mean of its last tenth (at least one step).

  Example::

    >>> final_loss([4.0, 3.0] + [1.0] * 18)
    1.0
  """
  import numpy as np

  return float(np.mean(losses[-max(1, len(losses) // 10):]))


def _plot(result: dict[str, Any], path: pathlib.Path) -> None:
  titles = {"zero1": "state precision (float32 compute)",
            "zero1-f32params": "master weights (bfloat16 compute)"}
  panels = [(f"{title}, data={result['dp']}",
             [(f"{arm} (final {row['final_loss']:.4f}, {row['final_gap_to_reference']:+.2%})", row["losses"])
              for arm, row in result["arms"].items() if row["reference"] == reference])
            for reference, title in titles.items()]
  plot_losses(panels, path)


def plot_losses(panels: list[tuple[str, list[tuple[str, list[float]]]]], path: pathlib.Path) -> None:
  """Loss curves side by side, one panel per ``(title, [(label, losses), ...])``, log scale, saved to
  ``path``."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), sharey=True, squeeze=False)
  for ax, (title, curves) in zip(axes[0], panels, strict=True):
    for label, losses in curves:
      ax.plot(losses, label=label, linewidth=1)
    ax.set_xlabel("step")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.legend()
  axes[0][0].set_ylabel("loss")
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
  flags = os.environ.get("XLA_FLAGS", "")
  os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.dp}"
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  run(args.steps, args.dp, args.out)
  return 0


if __name__ == "__main__":
  sys.exit(main())
