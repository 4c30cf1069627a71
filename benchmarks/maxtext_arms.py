"""MaxText's own engine with its Zero-1 flag vs ``Zero1MaxTextTrainingEngine``, on one tiny decoder.

Needs ``maxtext`` (Python >= 3.12). Two arms on the same config, mesh and
micro-batches: ``maxtext-flag`` (``MaxTextTrainingEngine`` with
``shard_optimizer_over_data=True``) and ``zero1-maxtext``
(``Zero1MaxTextTrainingEngine``, flag off). Per arm: optimizer bytes per
device, median step time (``ga`` x ``fwd_bwd`` + ``update``), the update
kernel's collectives, and the final loss.

Run::

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
    python -m benchmarks.maxtext_arms --dp 4 --ga 4 --steps 5 --out bench_out
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import pathlib
import statistics
import sys
import time
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from benchmarks import devices
from nnx_zero1 import bytes_per_device
from nnx_zero1.testing import collectives
from tests.support.maxtext_toys import tiny_batches, tiny_config, tiny_mesh

__all__ = ["MISSING_MAXTEXT", "run_arm", "main"]

MISSING_MAXTEXT = (
    "needs maxtext, which is not installed here: on Python >= 3.12, "
    "pip install -r .ci/requirements-newest.txt && pip install --no-deps maxtext==0.2.5"
)

def run_arm(name: str, dp: int, ga: int, steps: int, warmup: int = 1) -> dict:
  """One arm: builds the engine, runs ``warmup + steps`` optimizer steps, measures them."""
  from nnx_zero1.adapters.maxtext import Zero1MaxTextTrainingEngine  # first: supplies the Tunix types

  stock = importlib.import_module("maxtext.training_engine.maxtext_engine").MaxTextTrainingEngine

  flag = name == "maxtext-flag"
  config = tiny_config(ici_data_parallelism=dp, shard_optimizer_over_data=flag)
  cls = stock if flag else Zero1MaxTextTrainingEngine
  engine = cls(config, mesh=tiny_mesh(config))
  batches = tiny_batches(config, ga * (warmup + steps))
  engine.compile(batches[0])
  times = []
  for s in range(warmup + steps):
    start = time.perf_counter()
    for b in batches[s * ga:(s + 1) * ga]:
      engine.fwd_bwd(b)
    engine.update()
    jax.block_until_ready(nnx.state(engine.model))
    times.append(time.perf_counter() - start)
  hlo = engine._lower_kernels(batches[0])["update"].compile().as_text()
  buffers = engine.get_metrics().weighted_metrics
  loss = buffers["loss"].compute() if "loss" in buffers else None
  return {
      "arm": name, "dp": dp, "ga": ga,
      "optimizer_bytes_per_device": bytes_per_device(nnx.state(engine.optimizer)),
      "step_ms": 1e3 * statistics.median(times[warmup:]),
      "update_collectives": collectives(hlo),
      "loss": np.asarray(loss).ravel().tolist() if loss is not None else None,
      "params": jax.tree.map(np.asarray, nnx.state(engine.model, nnx.Param)),
  }


def _table(rows: Sequence[dict]) -> str:
  flag, ours = rows
  lines = [
      "| arm | optimizer bytes/device | step ms | update: all-reduce | reduce-scatter | all-gather |",
      "|---|---:|---:|---|---|---|",
  ]
  for r in rows:
    cells = [f'{r["update_collectives"][op]["count"]} x, {r["update_collectives"][op]["bytes"]} B'
             for op in ("all-reduce", "reduce-scatter", "all-gather")]
    head = f'| {r["arm"]} | {r["optimizer_bytes_per_device"]} | {r["step_ms"]:.1f} | '
    lines.append(head + " | ".join(cells) + " |")
  diff = max(float(np.max(np.abs(a - b))) for a, b in zip(
      jax.tree.leaves(flag["params"]), jax.tree.leaves(ours["params"]), strict=True))
  lines.append("")
  lines.append(f'dp={flag["dp"]}, ga={flag["ga"]}: step-time ratio zero1-maxtext / maxtext-flag = '
               f'{ours["step_ms"] / flag["step_ms"]:.3f}; max |parameter difference| = {diff:.3g}; '
               f'losses {flag["loss"]} vs {ours["loss"]}')
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
  """Runs both arms and writes ``maxtext.json`` and ``maxtext.md`` into ``--out``."""
  p = argparse.ArgumentParser(prog="python -m benchmarks.maxtext_arms",
                              description=__doc__.splitlines()[0])
  p.add_argument("--dp", type=int, default=4)
  p.add_argument("--ga", type=int, default=4)
  p.add_argument("--steps", type=int, default=5)
  p.add_argument("--out", default="bench_out")
  args = p.parse_args(argv)
  if importlib.util.find_spec("maxtext") is None:
    print(f"benchmarks.maxtext_arms: {MISSING_MAXTEXT}", file=sys.stderr)
    return 2
  devices.synchronous_cpu_dispatch()  # the CPU thread-pool deadlock the tests avoid the same way
  rows = [run_arm(name, args.dp, args.ga, args.steps) for name in ("maxtext-flag", "zero1-maxtext")]
  table = _table(rows)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "maxtext.md").write_text(table + "\n")
  (out / "maxtext.json").write_text(json.dumps([{k: v for k, v in r.items() if k != "params"} for r in rows],
                                               indent=1))
  print(table)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
