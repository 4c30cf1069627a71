"""MaxText's real engine, stock and with Zero-1, compiled for a TPU slice on a machine without one.

MaxText's ahead-of-time engine (``maxtext_engine_compile.AbstractMaxTextEngine``)
against ``Zero1AbstractMaxTextEngine``, on one MaxText config: ``base.yml``'s
defaults, the model named, and the overrides given. A step is MaxText's three
kernels (``fwd_bwd``, ``fwd_bwd_accum``, ``update``); its peak per chip is the
accumulating kernel's with the optimizer state resident beside it, or the
update's, whichever is larger (the planner's split-step arithmetic). Needs
maxtext and libtpu (Python >= 3.12).

Run (the seed's configuration: qwen3-0.6b, dp=4, adamw, micro-batch 8x1024, GA 8)::

  python -m benchmarks.maxtext_aot --topology v6e-4 model_name=qwen3-0.6b per_device_batch_size=2 \
      max_target_length=1024 gradient_accumulation_steps=8 ici_data_parallelism=4 ici_fsdp_parallelism=1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from nnx_zero1._src.planner import compilers

__all__ = ["compile_engine", "main"]

# The config values a row records: what MaxText's defaults chose.
_REPORTED = ("model_name", "shard_mode", "remat_policy", "scan_layers", "dtype", "weight_dtype", "opt_type",
             "gradient_accumulation_steps", "global_batch_size_to_train_on")


def compile_engine(zero1: bool, topology: str, overrides: dict[str, str]) -> dict[str, Any]:
  """One engine's kernels compiled for ``topology`` (MaxText's name, e.g. ``v6e-4``): bytes per chip."""
  from nnx_zero1.adapters import _compat

  _compat.ensure_tunix_types()  # before MaxText's engine modules import Tunix's
  import maxtext
  from flax import nnx
  from maxtext.configs import pyconfig
  from maxtext.trainers.pre_train import train_compile
  from maxtext.training_engine import maxtext_engine_compile as mec

  from nnx_zero1._src.planner.abstract import abstract_bytes_per_device
  from nnx_zero1._src.planner.compiled import memory, split_memory
  from nnx_zero1.adapters.maxtext import Zero1AbstractMaxTextEngine
  from nnx_zero1.testing import collectives

  base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
  args = {"run_name": "maxtext_aot", "compile_topology": topology, "compile_topology_num_slices": 1,
          "jax_cache_dir": "", "enable_checkpointing": False, **overrides}
  config = pyconfig.initialize(["maxtext_aot", base] + [f"{k}={v}" for k, v in args.items()])
  mesh = train_compile.get_topology_mesh(config)
  start = time.perf_counter()
  engine = (Zero1AbstractMaxTextEngine if zero1 else mec.AbstractMaxTextEngine)(config, mesh)
  kernels = engine.compile_kernels(mec.get_shaped_micro_batch(config))
  opt_bytes = abstract_bytes_per_device(nnx.state(engine.optimizer.opt_state))
  mem = {name: memory(kernel) for name, kernel in kernels.items()}
  step = split_memory(mem["fwd_bwd_accum"], mem["update"], opt_bytes)
  return {
      "engine": type(engine).__name__, "compile_s": round(time.perf_counter() - start, 1),
      "opt_state_bytes_per_device": opt_bytes, "peak_bytes_per_device": step["peak"],
      "config": {k: str(getattr(config, k)) for k in _REPORTED},
      "kernels": {k: {**m, "collectives": collectives(kernels[k].as_text())} for k, m in mem.items()},
  }


def main(argv: Sequence[str] | None = None) -> int:
  """Compiles both engines and prints their bytes per chip; returns 0 (2 without maxtext or libtpu)."""
  p = argparse.ArgumentParser(prog="python -m benchmarks.maxtext_aot", description=__doc__.split("\n\n")[0])
  p.add_argument("--topology", default="v6e-4", help="MaxText's compile_topology (default v6e-4)")
  p.add_argument("--out", default=None, help="a JSON file for both engines' figures")
  p.add_argument("overrides", nargs="*", help="MaxText config overrides, key=value")
  args = p.parse_args(argv)
  try:
    compilers.require_libtpu()
  except compilers.AotUnavailable as e:
    print(f"benchmarks.maxtext_aot: {e}", file=sys.stderr)
    return 2
  compilers.start_cpu_jax()
  overrides = dict(o.split("=", 1) for o in args.overrides)
  rows = {name: compile_engine(name == "zero1", args.topology, overrides) for name in ("maxtext", "zero1")}
  gib = lambda n: f"{n / 2**30:.2f}"
  for name, row in rows.items():
    kernels = row["kernels"]
    print(f"{name:8s} opt {gib(row['opt_state_bytes_per_device'])} GiB, fwd_bwd_accum peak "
          f"{gib(kernels['fwd_bwd_accum']['peak'])} + opt, update peak {gib(kernels['update']['peak'])}: "
          f"step peak {gib(row['peak_bytes_per_device'])} GiB per chip ({row['compile_s']} s)")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(rows, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
