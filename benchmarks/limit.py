"""The compiler's memory figures against what a real accelerator's allocator holds when the step runs.

``python -m benchmarks.limit`` compiles one lever's training step (the
planner's own step, :func:`nnx_zero1_plan.step_jit`) on the devices this process
has, at each micro-batch asked for, reads ``memory_analysis()``, runs the step
and reads the allocator's peak (``Device.memory_stats()``). Each micro-batch
runs in a fresh child process, so each peak is that step's alone. It is the
evidence for the planner's margin: what the run time holds beyond the
compiler's figure, and whether a step the compiler's figure puts under the
memory pool runs. The same compile asks XLA's GPU scheduler for its schedule,
so each row also carries the planner's predicted step time for that very
program (:func:`nnx_zero1_plan.predict_step_time`; a TPU's program carries its own
estimates) beside the median of its steady-state steps. ``--keep DIR`` keeps each
compiled program's text and a profile of three of its steps: each instruction's
time on the device, by name, which is what a prediction is checked against.

    XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 python -m benchmarks.limit \\
        --model examples.planner_decoder:build --batch 8,16,24 --out bench_out/limit
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

__all__ = ["measure", "main"]

_STATS = ("bytes_limit", "bytes_in_use", "peak_bytes_in_use", "largest_alloc_size", "bytes_reserved")


def _device_stats(device: Any) -> dict[str, int]:
  stats = device.memory_stats() or {}
  return {k: int(stats[k]) for k in _STATS if k in stats}


def measure(model: str, lever_name: str, batch: int, seq_len: int, optimizer: str, steps: int = 12,
            ga: int = 1, keep: str | None = None) -> dict[str, Any]:
  """One lever's step at ``batch`` (x ``ga`` micro-batches) on this process's devices: compiled, run
  ``steps`` times, measured; with ``keep``, its program's text and a profile of three more steps written
  there.

  Returns:
    The compiler's figures (:func:`nnx_zero1_plan.memory`, bytes per device), the allocator's
    (``memory_stats()`` before the compile and after the run), the step's median time over the steps after
    the first, the planner's prediction for the same compiled program (``predicted_ms``, None where the
    compiler gave no estimate, with ``time_absent``), and the run's error in one line (None when every step
    ran).
  """
  import jax
  import numpy as np
  from jax.sharding import AxisType, Mesh

  from nnx_zero1_plan import (
    CHIPS,
    LEVERS,
    ProgramRecord,
    chip_of,
    compile_step,
    dump_options,
    lever_state,
    memory,
    model_source,
    placed_batch,
    placed_state,
    predict_step_time,
    profiled,
    run_steps,
    scheduled_seconds,
  )

  devices = jax.devices()
  device = devices[0]
  mesh = Mesh(np.array(devices), ("data",), axis_types=(AxisType.Auto,))
  lever = LEVERS[lever_name]
  source = model_source(model)
  # The plan's own path: the abstract state compiled (steps.compile_step), the real one placed on its layout.
  abstract = lever_state(lever, lambda: source.build(None), optimizer, mesh)
  _, state = placed_state(lever, lambda: source.build(None), optimizer, mesh, abstract)
  tokens = placed_batch(lever, mesh, batch, seq_len, ga)
  row: dict[str, Any] = {"model": model, "lever": lever_name, "batch": batch, "ga": ga, "seq_len": seq_len,
                         "devices": len(devices), "device_kind": device.device_kind,
                         "mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
                         "before_compile": _device_stats(device)}
  with tempfile.TemporaryDirectory() as schedule:
    # XLA's GPU scheduler writes its estimates only when asked; a TPU program carries its own.
    gpu = device.platform == "gpu"
    compiled, seconds = compile_step(lever, abstract, source.loss_fn, mesh, batch, seq_len, ga,
                                     compiler_options=dump_options(schedule) if gpu else None)
    scheduled = scheduled_seconds(schedule) if gpu else None
  row["compile_s"] = round(seconds, 1)
  row["compiler"] = memory(compiled)
  name = f"{lever_name}_{batch}x{ga}_s{seq_len}"
  hlo = compiled.as_text()
  if keep:
    with gzip.open(os.path.join(keep, f"{name}.hlo.txt.gz"), "wt") as f:
      f.write(hlo)
  chip = chip_of(device.device_kind)
  if chip is not None:
    record = ProgramRecord.read(hlo)
    record = dataclasses.replace(record, estimates=(scheduled or {}).get(record.module or ""))
    tokens = ga * batch * seq_len / len(devices)
    predicted = predict_step_time([("step", record, 1)], CHIPS[chip], devices=len(devices),
                                  tokens_per_device=tokens, compute_dtype="bfloat16")
    row["predicted_ms"] = None if predicted.predicted_step_s is None else round(
        1000 * predicted.predicted_step_s, 2)
    row["time_absent"] = predicted.time_absent
  # The first step may include the allocator's growth: the median of those after it.
  state, runs = run_steps(compiled, state, tokens, warmup=1, timed=steps - 1)
  row["run_error"] = runs.error
  if runs.loss is not None and runs.error is None:
    row["loss"] = runs.loss
  row["step_ms"] = None if runs.step_s is None else round(1000 * runs.step_s, 2)
  row["steps_ms"] = [round(1000 * t, 3) for t in runs.times_s]
  if keep and row["run_error"] is None:
    def step() -> Any:  # the state is donated: each call takes the last one's
      nonlocal state
      state, loss = compiled(state, tokens)
      return loss

    ops = profiled(step, 3)
    with open(os.path.join(keep, f"{name}.ops.json"), "w") as f:
      json.dump(ops, f)
    row["device_ms"] = {k: round(v[0] / 1e6, 3) for k, v in ops.get("modules", {}).items()}
  row["after_run"] = _device_stats(device)
  return row


def _table(rows: Sequence[dict[str, Any]]) -> str:
  gib = lambda n: "-" if n is None else f"{n / 2**30:.2f}"
  head = ("mem fraction", "micro-batch", "args", "temp", "args+out-alias+temp", "compiler's peak", "xla_peak",
          "pool (bytes_limit)", "run peak", "run peak - args+out-alias+temp", "ran", "step ms",
          "predicted ms")
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for r in rows:
    if "compiler" not in r:
      lines.append(f"| {r.get('mem_fraction')} | {r['batch']} | child failed: {r.get('error', '')[:200]} |")
      continue
    c, after = r["compiler"], r["after_run"]
    peak = after.get("peak_bytes_in_use")
    lines.append("| " + " | ".join([
        str(r["mem_fraction"]), str(r["batch"]), gib(c["argument"]), gib(c["temp"]), gib(c["formula_peak"]),
        gib(c["peak"]), gib(c["xla_peak"]), gib(after.get("bytes_limit")),
        gib(peak), gib(None if peak is None else peak - c["formula_peak"]),
        "yes" if r["run_error"] is None else "NO: " + r["run_error"][:80], str(r["step_ms"]),
        str(r.get("predicted_ms"))]) + " |")
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m benchmarks.limit", description=__doc__.splitlines()[0])
  p.add_argument("--model", default="examples.planner_decoder:build",
                 help="a planner model (package.module:function)")
  p.add_argument("--lever", default="baseline")
  p.add_argument("--batch", default="8,16", help="global micro-batches, one child process each")
  p.add_argument("--seq-len", type=int, default=1024)
  p.add_argument("--ga", type=int, default=1, help="micro-batches per step")
  p.add_argument("--keep", default=None, help="a folder for each program's text and its profile")
  p.add_argument("--optimizer", default="adamw")
  p.add_argument("--timeout", type=int, default=240, help="seconds per micro-batch")
  p.add_argument("--out", default="bench_out/limit")
  p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.child is not None:
    row = measure(args.model, args.lever, args.child, args.seq_len, args.optimizer, ga=args.ga,
                  keep=args.keep)
    print("LIMIT_ROW " + json.dumps(row))
    return 0
  os.makedirs(args.out, exist_ok=True)
  if args.keep:
    os.makedirs(args.keep, exist_ok=True)
  path = os.path.join(args.out, "limit.jsonl")
  rows = []
  for batch in (int(b) for b in args.batch.split(",")):
    cmd = [sys.executable, "-m", "benchmarks.limit", "--model", args.model, "--lever", args.lever,
           "--seq-len", str(args.seq_len), "--optimizer", args.optimizer, "--ga", str(args.ga),
           "--child", str(batch)] + (["--keep", args.keep] if args.keep else [])
    try:
      done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
      found = [line[10:] for line in done.stdout.splitlines() if line.startswith("LIMIT_ROW ")]
      row = json.loads(found[0]) if found else {
          "batch": batch, "mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
          "error": " ".join(done.stderr.split())[-600:]}
    except subprocess.TimeoutExpired:
      row = {"batch": batch, "mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
             "error": f"timed out after {args.timeout} s"}
    rows.append(row)
    with open(path, "a") as f:
      f.write(json.dumps(row) + "\n")
    print(_table([row]).splitlines()[-1], flush=True)
  print(_table(rows))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
