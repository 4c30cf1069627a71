"""Loss curves with the gradients crossing between slices in bfloat16, against the exact reduction.

``python -m benchmarks.across --steps 1000 --seeds 0,1`` trains the bench's ``small`` transformer
(adamw 1e-3) on 8 virtual CPU devices as two slices of four (``replica=2 x data=4``), Zero-1 over
both axes, with the gradients from ``value_and_grad_accumulated`` (2 micro-batches of 16 sequences),
once per arm and seed, on the learnable sequences of :mod:`benchmarks.precision`:

- ``exact``: the reduction in float32 on both networks (the reference);
- ``bf16across``: ``across_dtype=jnp.bfloat16``, the stage across the slices (``replica``) in bfloat16.

A seed picks the initialisation and the data stream. Writes ``across.json`` (each arm's and seed's
losses and the relative gap of its final loss, the mean of the last tenth of the run, to the exact
arm's of the same seed) and ``across.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
from typing import Any

ARMS: dict[str, Any] = {"exact": None, "bf16across": "bfloat16"}
_SEED_STRIDE = 10**6  # seed s trains on the streams' steps s * 10**6, s * 10**6 + 1, ...


def run(steps: int, seeds: list[int], out: pathlib.Path) -> dict[str, Any]:
  import jax
  import optax
  from flax import nnx
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from benchmarks.model import loss_fn
  from benchmarks.precision import final_loss, progressions
  from benchmarks.settings import Settings, new_model
  from nnx_zero1 import Zero1Optimizer, value_and_grad_accumulated

  mesh = jax.make_mesh((2, 4), ("replica", "data"))
  rows = NamedSharding(mesh, P(("replica", "data")))

  @nnx.jit(static_argnums=3)
  def step(model, optimizer, tokens, across):
    loss, grads = value_and_grad_accumulated(loss_fn, model, tokens, micro_batches=2, optimizer=optimizer,
                                             across_dtype=across)
    optimizer.update(model, grads)
    return loss

  result: dict[str, Any] = {"model": "small", "mesh": dict(mesh.shape), "steps": steps, "lr": 1e-3,
                            "batch": 32, "micro_batches": 2, "runs": []}
  with jax.set_mesh(mesh):
    for seed in seeds:
      settings = Settings(model="small", seed=seed)
      for arm, across in ARMS.items():
        model = new_model(settings, mesh)
        optimizer = Zero1Optimizer(model, optax.adamw(1e-3), mesh, data_axis=("replica", "data"))
        losses = []
        for i in range(steps):
          batch = progressions(settings.config.vocab, 32, settings.config.seq_len, seed * _SEED_STRIDE + i)
          losses.append(float(step(model, optimizer, jax.device_put(batch, rows), across)))
        result["runs"].append({"arm": arm, "seed": seed, "across_dtype": across, "losses": losses})
        print(f"seed {seed} {arm}: final loss {final_loss(losses):.5f}", file=sys.stderr)
  final = {(r["seed"], r["arm"]): final_loss(r["losses"]) for r in result["runs"]}
  for r in result["runs"]:
    r["final_loss"] = final[r["seed"], r["arm"]]
    exact = final[r["seed"], "exact"]
    r["final_gap_to_exact"] = (r["final_loss"] - exact) / exact
  out.mkdir(parents=True, exist_ok=True)
  (out / "across.json").write_text(json.dumps(result, indent=1))
  _plot(result, out / "across.png")
  return result


def _plot(result: dict[str, Any], path: pathlib.Path) -> None:
  from benchmarks.precision import plot_losses

  seeds = sorted({r["seed"] for r in result["runs"]})
  panels = [(f"seed {seed}, replica=2 x data=4, Zero-1 over both",
             [(f"{r['arm']} (final {r['final_loss']:.4f}, {r['final_gap_to_exact']:+.2%})", r["losses"])
              for r in result["runs"] if r["seed"] == seed])
            for seed in seeds]
  plot_losses(panels, path)


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m benchmarks.across", description=__doc__.split("\n")[0])
  p.add_argument("--steps", type=int, default=1000)
  p.add_argument("--seeds", default="0,1", help="comma-separated seeds (initialisation and data stream)")
  p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench_out"))
  args = p.parse_args(argv)
  seeds = [int(s) for s in args.seeds.split(",")]
  if args.steps < 1 or not seeds:
    p.error("--steps must be >= 1 and --seeds name at least one seed")
  flags = os.environ.get("XLA_FLAGS", "")
  os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8"
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  run(args.steps, seeds, args.out)
  return 0


if __name__ == "__main__":
  sys.exit(main())
