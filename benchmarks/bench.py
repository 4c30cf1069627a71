"""The command line of ``python -m benchmarks.bench``."""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence

from benchmarks import devices

__all__ = ["parse_args", "default_arms", "valid_arms", "missing_extras", "main"]

STEP_ARMS = ("baseline", "zero1", "accum", "zero1-accum")
ENGINE_ARMS = ("engine", "zero1-engine")


def _ints(text: str) -> tuple[int, ...]:
  return tuple(int(x) for x in text.split(",") if x.strip())


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
  """The bench's options; ``--quick`` picks small settings unless they are given explicitly.

  Example::

    >>> args = parse_args(["--quick", "--dp", "2,4"])
    >>> args.dp, args.model, args.steps
    ((2, 4), 'small', 10)
  """
  from benchmarks.model import CONFIGS  # imports jax without starting a backend
  from benchmarks.settings import OPTIMIZERS

  p = argparse.ArgumentParser(
      prog="python -m benchmarks.bench",
      description="Memory, time and collectives of plain nnx.Optimizer vs Zero1Optimizer training.",
  )
  p.add_argument("--quick", action="store_true",
                 help="small model, 10 timed steps, the single-step arms only (baseline, zero1, accum, "
                 "zero1-accum): minutes on 2 CPU cores")
  p.add_argument("--out", default=None,
                 help="folder for bench.json, bench.md, memory.png (default: bench_out; with --aot: "
                 "bench_out_aot)")
  p.add_argument("--dp", type=_ints, default=(2, 4, 8), help="data-parallel sizes, e.g. 2,4,8")
  p.add_argument("--ga", type=_ints, default=(1, 8), help="gradient-accumulation steps, e.g. 1,8")
  p.add_argument("--model", default=None, choices=list(CONFIGS),
                 help="model shape (default: base; --quick: small); the real shapes are for accelerators")
  p.add_argument("--model-config", default=None, metavar="JSON",
                 help="your own model shape: a JSON file of Config fields (vocab, dim, layers, heads, "
                 "kv_heads, head_dim, ffn, tied, qk_norm, sandwich_norms, scan_layers...); overrides --model")
  p.add_argument("--optimizer", default="adamw", choices=list(OPTIMIZERS))
  p.add_argument("--steps", type=int, default=None, help="timed steps per arm (median reported)")
  p.add_argument("--warmup", type=int, default=None, help="untimed steps per arm first")
  p.add_argument("--batch", type=int, default=8, help="global micro-batch, in sequences")
  p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the model's)")
  p.add_argument("--mesh", choices=("explicit", "auto"), default="explicit",
                 help="axis type of the data axis (explicit: jax's default, bit-identical Zero-1)")
  p.add_argument("--arms", default=None,
                 help="comma list of baseline,zero1,accum,zero1-accum,engine,zero1-engine, and the memory "
                 "levers zero2-accum,zero1-offload,zero2-offload (both) (default: all available but the "
                 "levers; --quick: the first four); the first is the reference for loss_diff")
  p.add_argument("--aot", default=None, metavar="TOPOLOGY",
                 help="compile each arm's step for a TPU topology (e.g. v6e:2x2, v5e:2x4, v4:2x2x1, "
                 "v5p:2x2x1) with the real TPU compiler and report its memory and collectives; runs nothing, "
                 "needs no TPU (pip extra aot); default arms baseline,zero1,zero1-accum")
  p.add_argument("--split-step", action=argparse.BooleanOptionalAction, default=True,
                 help="with --aot: compile each arm as two programs, gradients then update, as MaxText's "
                 "engine does, so the update's buffers stay out of the activation peak (default); "
                 "--no-split-step compiles the one jitted step the CPU bench runs")
  p.add_argument("--remat", action="store_true",
                 help="recompute every layer in the backward pass instead of storing its activations "
                 "(nnx.remat, MaxText's remat_policy=full)")
  p.add_argument("--no-shapes", action="store_true", help="skip the real-LLM-shapes table")
  p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
  args = p.parse_args(list(argv))
  if args.model_config:
    from benchmarks.model import register_config

    args.model = register_config(args.model_config)
  quick = {"model": "small", "steps": 10, "warmup": 1, "seq_len": 32}
  full = {"model": "base", "steps": 15, "warmup": 2, "seq_len": None}
  args.quick_changes = {}  # what --quick set, printed at the start of the run
  for key, value in (quick if args.quick else full).items():
    if getattr(args, key) is None:
      setattr(args, key, value)
      if args.quick:
        args.quick_changes[key] = value
  if args.aot and not args.arms:
    args.arms = "baseline,zero1,zero1-accum"
  if args.quick and not args.arms:
    args.quick_changes["arms"] = ",".join(STEP_ARMS)
  # --quick keeps to the single-step arms: the engines add two compiles each (minutes on 2 cores).
  args.arms = tuple(args.arms.split(",")) if args.arms else STEP_ARMS if args.quick else default_arms()
  _check_args(p, args)
  return args


def valid_arms(aot: bool) -> tuple[str, ...]:
  """The arm names ``--arms`` takes: the single-step arms (all ``--aot`` compiles) and the engines.

  Example::

    >>> valid_arms(aot=True)[:4]
    ('baseline', 'zero1', 'accum', 'zero1-accum')
  """
  from benchmarks.settings import STEP_ARMS as ALL_STEP_ARMS

  return tuple(ALL_STEP_ARMS) + (() if aot else ENGINE_ARMS)


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
  """Exits with status 2 and one line on stderr, naming the valid values, for a value the bench cannot run.

  Before any jax work, so a typo costs nothing (argparse's ``error`` would add the whole usage).
  """
  error = lambda message: p.exit(2, f"{p.prog}: error: {message}\n")
  arms = valid_arms(bool(args.aot))
  unknown = [arm for arm in args.arms if arm not in arms]
  if unknown:
    mode = " with --aot" if args.aot else ""
    error(f"--arms: unknown arm {', '.join(map(repr, unknown))}{mode}; valid arms: {', '.join(arms)}")
  for flag, values, least in (("--dp", args.dp, 1), ("--ga", args.ga, 1)):
    bad = [v for v in values if v < least] or ([] if values else ["(none)"])
    if bad:
      error(f"{flag} {','.join(map(str, bad))}: each value must be an integer >= {least}, e.g. {flag} 1,8")
  if args.batch < 1:
    error(f"--batch {args.batch}: must be an integer >= 1")
  uneven = [dp for dp in args.dp if args.batch % dp]
  if uneven:
    divisors = [d for d in range(1, args.batch + 1) if args.batch % d == 0]
    error(f"--dp {','.join(map(str, uneven))}: the global micro-batch (--batch {args.batch}) must split "
            f"evenly over the data-parallel replicas; valid --dp values: {','.join(map(str, divisors))}")
  if args.steps < 1 or args.warmup < 0:
    error(f"--steps {args.steps} --warmup {args.warmup}: --steps must be >= 1 and --warmup >= 0")
  if args.out is None:
    args.out = "bench_out_aot" if args.aot else "bench_out"


def default_arms() -> tuple[str, ...]:
  """Plain and Zero-1 optimizers (each with a scanned and a deferred-reduction step), plus the
  MaxText-style engines when that adapter is installed.

  Example::

    >>> default_arms()[:4]
    ('baseline', 'zero1', 'accum', 'zero1-accum')
  """
  try:  # the engine arms run the reference engine of a source checkout's tests/
    has_engine = importlib.util.find_spec("tests.support.reference_engine") is not None
  except ModuleNotFoundError:
    has_engine = False
  return STEP_ARMS + (ENGINE_ARMS if has_engine else ())


_BENCH_EXTRA = ("matplotlib", "tqdm")  # what `pip install ".[bench]"` brings


def missing_extras(modules: Sequence[str] = _BENCH_EXTRA) -> list[str]:
  """The modules of the ``bench`` extra that do not import here.

  Args:
    modules: the module names to try.

  Returns:
    The names whose import fails, in order; empty when the bench can run.

  Example::

    >>> missing_extras(["json", "no_such_module_here"])
    ['no_such_module_here']
  """
  missing = []
  for name in modules:
    try:
      importlib.import_module(name)
    except ImportError:
      missing.append(name)
  return missing


def _devices_or_rerun(need: int, argv: Sequence[str]) -> int | None:
  """None when this process can run the bench; otherwise the exit code of a fresh run."""
  if devices.request_cpu_devices(need):
    return None
  if os.environ.get(devices.CHILD_ENV):
    raise SystemExit(f"benchmarks.bench: needs {need} devices and could not get them")
  cmd, env = devices.rerun_command(need, list(argv))
  print(f"benchmarks.bench: jax already started with too few devices; rerunning with {need}", file=sys.stderr)
  return subprocess.call(cmd, env=env)


def _say_what_quick_sets(args: argparse.Namespace) -> None:
  """One line on stderr: the settings ``--quick`` chose because no flag gave them."""
  if args.quick_changes:
    chosen = ", ".join(f"--{key.replace('_', '-')} {value}" for key, value in args.quick_changes.items())
    print(f"benchmarks.bench: --quick sets {chosen} (a flag given explicitly wins)", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the bench and writes its files; returns the process exit code.

  Example::

    >>> main(["--quick", "--dp", "2", "--ga", "1", "--model", "tiny", "--out", "/tmp/b"])  # doctest: +SKIP
    0
  """
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parse_args(argv)
  if args.aot:
    _say_what_quick_sets(args)
    from benchmarks import aot_cli  # compiles for a TPU topology; needs no devices

    return aot_cli.main(args)
  missing = missing_extras()
  if missing:  # before any work: the table and plot need them at the end
    print(f"benchmarks.bench: {', '.join(missing)} not installed; "
          'pip install ".[bench]" (from the repository root)', file=sys.stderr)
    return 2
  _say_what_quick_sets(args)
  devices.synchronous_cpu_dispatch()
  rerun = _devices_or_rerun(max(args.dp), argv)
  if rerun is not None:
    return rerun

  import jax
  from tqdm import tqdm

  from benchmarks import output, run, shapes
  from benchmarks import settings as settings_lib

  settings = settings_lib.Settings(
      model=args.model, dp=args.dp, ga=args.ga, steps=args.steps, warmup=args.warmup, batch=args.batch,
      seq_len=args.seq_len, optimizer=args.optimizer, mesh=args.mesh, remat=args.remat,
  )
  shape_names = () if args.no_shapes else shapes.REAL_SHAPES[::2] if args.quick else shapes.REAL_SHAPES
  shape_dps = (2, 4, 8, 16)
  ticks = len(args.dp) * len(args.ga) * len(args.arms) * (1 + args.warmup + args.steps)
  start = time.perf_counter()
  with tqdm(total=ticks + len(shape_names) * len(shape_dps), file=sys.stderr, disable=args.no_progress,
            desc="bench", unit="step") as bar:
    rows = [
        row for dp in args.dp for ga in args.ga
        for row in run.run_cell(settings, dp, ga, args.arms, tick=bar.update)
    ]
    shape_rows = []
    for name in shape_names:
      for dp in shape_dps:
        shape_rows.append({"model": name, **shapes.replicated_fraction(shapes.CONFIGS[name], dp)})
        bar.update()
  device = jax.devices()[0]
  meta = {
      **settings_lib.describe(settings),
      "arms": list(args.arms),
      "platform": device.platform,
      "device_kind": device.device_kind,
      "devices": jax.device_count(),
      "host_cpus": os.cpu_count(),
      "machine": f"{platform.machine()} {platform.system()}, python {platform.python_version()}",
      "jax": jax.__version__,
      "cpu_async_dispatch": devices.cpu_async_dispatch(),
      "wall_s": round(time.perf_counter() - start, 1),
  }
  result = {"meta": meta, "rows": rows, "shapes": shape_rows}
  paths = output.write_all(result, args.out)
  print(f"benchmarks.bench: model {args.model} ({meta['params']:,} params), {args.optimizer}, "
        f"{args.mesh} mesh, {meta['devices']} {device.platform} devices ({device.device_kind}) "
        f"on {meta['host_cpus']} host CPUs; {meta['wall_s']} s")
  print(output.table(rows))
  print("\n".join(output.legend(rows)))
  *goals, verdict = output.goals_text(rows)
  print("\n" + "\n".join(goals))
  if shape_rows:
    print("\nOptimizer bytes Zero-1 leaves replicated on real LLM shapes (adamw, float32):")
    print(output.shapes_table(shape_rows))
  print("wrote " + ", ".join(paths))
  print(verdict)  # the last line: every goal met, or which were not
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
