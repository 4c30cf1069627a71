"""Loss curves with the gradients crossing between slices in bfloat16 or int8, against the exact reduction.

``python -m benchmarks.across --steps 1000 --seeds 0,1`` trains the bench's ``small`` transformer
(adamw 1e-3) on 8 virtual CPU devices as two slices of four (``replica=2 x data=4``), Zero-1 over
both axes, with the gradients from ``value_and_grad_accumulated`` (2 micro-batches of 16 sequences),
once per arm and seed, on the learnable sequences of :mod:`benchmarks.precision`:

- ``exact``: the reduction in float32 on both networks (the reference);
- ``bf16across``: ``across_dtype=jnp.bfloat16``, the stage across the slices (``replica``) in bfloat16;
- ``int8across``: ``across_dtype=jnp.int8``, that stage in int8 blocks with a float32 scale each.

``--corpus stdlib --model byte-1m --slices 2,4`` trains a byte-level language model on real text instead:
the Python standard library's own source files (``sysconfig.get_paths()["stdlib"]``, every ``*.py`` under
it, offline on every machine), random windows of its bytes, on two slices of four and four of two.

A seed picks the initialisation and the data stream. Writes ``across.json`` (each arm's, slice count's and
seed's losses and the relative gap of its final loss, the mean of the last hundred steps (the last fifth
of a shorter run), to the exact arm's of the same seed) and ``across.png`` (the loss curves) or, for
several slice counts, the relative gap to exact per step.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
from typing import Any

ARMS: dict[str, Any] = {"exact": None, "bf16across": "bfloat16", "int8across": "int8"}
_SEED_STRIDE = 10**6  # seed s trains on the streams' steps s * 10**6, s * 10**6 + 1, ...


def stdlib_bytes() -> Any:
  """The Python standard library's ``*.py`` files (not site-packages), sorted by path, as one uint8 array."""
  import sysconfig

  import numpy as np

  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
  return np.frombuffer(b"".join(p.read_bytes() for p in files), np.uint8)


def windows(text: Any, batch: int, seq: int, step: int) -> Any:
  """One step's token ids (batch, seq + 1): random windows of ``text``'s bytes, drawn from ``step``."""
  import numpy as np

  starts = np.random.default_rng(step).integers(0, text.size - seq - 1, size=batch)
  return np.stack([text[s:s + seq + 1] for s in starts]).astype(np.int32)


def final_loss(losses: list[float]) -> float:
  """The mean of the last hundred steps (the last fifth of a run shorter than 500)."""
  import numpy as np

  return float(np.mean(losses[-min(100, max(1, len(losses) // 5)):]))


def run(steps: int, seeds: list[int], out: pathlib.Path, *, corpus: str = "progressions",
        model: str = "small", slices: tuple[int, ...] = (2,), batch: int = 32,
        arms: tuple[str, ...] = tuple(ARMS)) -> dict[str, Any]:
  import jax
  import optax
  from flax import nnx
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from benchmarks.model import loss_fn
  from benchmarks.precision import progressions
  from benchmarks.settings import Settings, new_model
  from nnx_zero1 import Zero1Optimizer, value_and_grad_accumulated

  text = stdlib_bytes() if corpus == "stdlib" else None

  @nnx.jit(static_argnums=3)
  def step(model, optimizer, tokens, across):
    loss, grads = value_and_grad_accumulated(loss_fn, model, tokens, micro_batches=2, optimizer=optimizer,
                                             across_dtype=across)
    optimizer.update(model, grads)
    return loss

  result: dict[str, Any] = {"model": model, "corpus": corpus, "steps": steps, "lr": 1e-3, "batch": batch,
                            "micro_batches": 2, "meshes": [], "runs": []}
  if text is not None:
    result["corpus_bytes"] = int(text.size)
  for k in slices:
    mesh = jax.make_mesh((k, 8 // k), ("replica", "data"))
    result["meshes"].append(dict(mesh.shape))
    rows = NamedSharding(mesh, P(("replica", "data")))
    with jax.set_mesh(mesh):
      for seed in seeds:
        settings = Settings(model=model, seed=seed)
        cfg = settings.config
        fresh = new_model(settings, mesh)
        result["params"] = sum(x.size for x in jax.tree.leaves(nnx.state(fresh, nnx.Param)))
        for arm in arms:
          across = ARMS[arm]
          net = new_model(settings, mesh)
          optimizer = Zero1Optimizer(net, optax.adamw(1e-3), mesh, data_axis=("replica", "data"))
          losses = []
          for i in range(steps):
            key = seed * _SEED_STRIDE + i
            tokens = (windows(text, batch, cfg.seq_len, key) if text is not None
                      else progressions(cfg.vocab, batch, cfg.seq_len, key))
            losses.append(float(step(net, optimizer, jax.device_put(tokens, rows), across)))
          result["runs"].append({"arm": arm, "slices": k, "seed": seed, "across_dtype": across,
                                 "losses": losses})
          print(f"slices {k} seed {seed} {arm}: final loss {final_loss(losses):.5f}", file=sys.stderr,
                flush=True)
          out.mkdir(parents=True, exist_ok=True)
          (out / "across.json").write_text(json.dumps(result, indent=1))  # what has run so far
  final = {(r["slices"], r["seed"], r["arm"]): final_loss(r["losses"]) for r in result["runs"]}
  for r in result["runs"]:
    r["final_loss"] = final[r["slices"], r["seed"], r["arm"]]
    exact = final.get((r["slices"], r["seed"], "exact"))
    r["final_gap_to_exact"] = None if exact is None else (r["final_loss"] - exact) / exact
  out.mkdir(parents=True, exist_ok=True)
  (out / "across.json").write_text(json.dumps(result, indent=1))
  (_plot_gaps if len(slices) > 1 else _plot)(result, out / "across.png")
  return result


def _plot(result: dict[str, Any], path: pathlib.Path) -> None:
  from benchmarks.precision import plot_losses

  seeds = sorted({r["seed"] for r in result["runs"]})
  panels = [(f"seed {seed}, replica=2 x data=4, Zero-1 over both",
             [(f"{r['arm']} (final {r['final_loss']:.4f}, {r['final_gap_to_exact']:+.2%})", r["losses"])
              for r in result["runs"] if r["seed"] == seed])
            for seed in seeds]
  plot_losses(panels, path)


def _plot_gaps(result: dict[str, Any], path: pathlib.Path, window: int = 50) -> None:
  """Per slice count, each narrowed arm's relative gap to the exact arm of the same seed, step by step (a
  running mean over ``window`` steps of each loss first: one step's gap is mostly the batch's noise)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np

  smooth = lambda xs: np.convolve(xs, np.ones(window) / window, mode="valid")
  counts = sorted({r["slices"] for r in result["runs"]})
  fig, axes = plt.subplots(1, len(counts), figsize=(6 * len(counts), 4), sharey=True, squeeze=False)
  exact = {(r["slices"], r["seed"]): smooth(r["losses"]) for r in result["runs"] if r["arm"] == "exact"}
  for ax, k in zip(axes[0], counts, strict=True):
    for r in result["runs"]:
      if r["slices"] != k or r["arm"] == "exact":
        continue
      ref = exact[k, r["seed"]]
      gap = 100 * (smooth(r["losses"]) - ref) / ref
      ax.plot(np.arange(window - 1, window - 1 + gap.size), gap, linewidth=1,
              label=f"{r['arm']} seed {r['seed']} (final {r['final_gap_to_exact']:+.3%})")
    ax.axhline(0, color="black", linewidth=0.5)
    for bound in (0.5, -0.5):
      ax.axhline(bound, color="grey", linewidth=0.5, linestyle="--")
    ax.set_title(f"{k} slices of {8 // k} (replica={k} x data={8 // k}), Zero-1 over both")
    ax.set_xlabel("step")
    ax.set_ylabel(f"loss gap to exact, % ({window}-step running means)")
    ax.legend(fontsize=7)
  fig.suptitle(f"{result['model']} ({result['params']:,} parameters) on {result['corpus']}, "
               f"batch {result['batch']}, adamw {result['lr']}")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m benchmarks.across", description=__doc__.split("\n")[0])
  p.add_argument("--steps", type=int, default=1000)
  p.add_argument("--seeds", default="0,1", help="comma-separated seeds (initialisation and data stream)")
  p.add_argument("--corpus", choices=("progressions", "stdlib"), default="progressions")
  p.add_argument("--model", default="small", help="a benchmarks.model config (byte-1m for --corpus stdlib)")
  p.add_argument("--slices", default="2", help="comma-separated slice counts, each replica=k x data=8/k")
  p.add_argument("--batch", type=int, default=32, help="sequences per step (divisible by 16)")
  p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of: {', '.join(ARMS)}")
  p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench_out"))
  args = p.parse_args(argv)
  seeds = [int(s) for s in args.seeds.split(",")]
  slices = tuple(int(s) for s in args.slices.split(","))
  arms = tuple(args.arms.split(","))
  if args.steps < 1 or not seeds:
    p.error("--steps must be >= 1 and --seeds name at least one seed")
  if any(k not in (1, 2, 4, 8) for k in slices) or args.batch % 16 or not set(arms) <= set(ARMS):
    p.error("--slices must divide 8, --batch by 16, and --arms name arms of " + ", ".join(ARMS))
  flags = os.environ.get("XLA_FLAGS", "")
  os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8"
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  run(args.steps, seeds, args.out, corpus=args.corpus, model=args.model, slices=slices, batch=args.batch,
      arms=arms)
  return 0


if __name__ == "__main__":
  sys.exit(main())
