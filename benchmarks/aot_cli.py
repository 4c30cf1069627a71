"""``python -m benchmarks.bench --aot TOPOLOGY ...``: the bench's ahead-of-time mode, end to end."""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

from nnx_zero1_plan import AotUnavailable, require_libtpu, start_cpu_jax

__all__ = ["AOT_ARMS", "main"]

AOT_ARMS = ("baseline", "zero1", "zero1-accum")


def main(args: argparse.Namespace) -> int:
  """Compiles every (dp, ga, arm) for ``args.aot`` and writes bench.json, bench.md, memory.png.

  Returns 0, or 2 with the install command on stderr when libtpu is missing.

  Example::

    from benchmarks.bench import parse_args
    main(parse_args(["--aot", "v6e:2x2", "--model", "tiny", "--dp", "4", "--ga", "2"]))
  """
  try:
    version = require_libtpu()
  except AotUnavailable as e:
    print(f"benchmarks.bench: {e}", file=sys.stderr)
    return 2
  start_cpu_jax()
  import jax

  from benchmarks import aot, aot_output
  from benchmarks import settings as settings_lib

  settings = settings_lib.Settings(
      model=args.model, dp=args.dp, ga=args.ga, batch=args.batch, seq_len=args.seq_len,
      optimizer=args.optimizer, mesh=args.mesh, remat=args.remat,
  )
  start = time.perf_counter()
  rows = []
  for dp in args.dp:
    for ga in args.ga:
      for row in aot.run_aot(settings, args.aot, dp, ga, args.arms, split_step=args.split_step):
        rows.append(row)
        if not args.no_progress:
          done = "refused (does not fit)" if row.get("hbm_oom") else "compiled"
          print(f"benchmarks.bench: {done} {row['arm']} dp={dp} ga={ga} for {args.aot} in "
                f"{row['compile_s']} s", file=sys.stderr)
  meta = {
      **settings_lib.describe(settings),
      "arms": list(args.arms),
      "compiled_for": args.aot,
      "programs_per_step": 2 if args.split_step else 1,
      "libtpu": version,
      "host_cpus": os.cpu_count(),
      "machine": f"{platform.machine()} {platform.system()}, python {platform.python_version()}",
      "jax": jax.__version__,
      "wall_s": round(time.perf_counter() - start, 1),
  }
  paths = aot_output.write_all({"meta": meta, "rows": rows}, args.out)
  print(f"benchmarks.bench: model {args.model} ({meta['params']:,} params), {args.optimizer}, compiled for "
        f"{args.aot} by libtpu {version} (nothing ran); {meta['wall_s']} s")
  print(aot_output.table(rows))
  print("wrote " + ", ".join(paths))
  return 0
