"""The constants a step's predicted time needs, each measured alone on the chip this process has.

``python -m benchmarks.chip_rates --out DIR`` runs two microbenchmarks and writes ``rates.json``:

- **the clock**: lone matmuls (bfloat16 and float32, three sizes), each compiled, its cycles read off the
  compiled program as the planner reads them (:func:`nnx_zero1_plan.predict_step_time`'s walk at one cycle
  per second) and its time on the device read off a profile: cycles over seconds is the clock the
  compiler's cycles run at;
- **the host link**: a jitted copy of 256 MiB and 1 GiB between device memory and pinned host memory, each
  way and both at once, timed on the device (a profile) and by the wall clock over back-to-back calls.

Nothing here is a training step: the figures are checked against steps they were not measured on
(``benchmarks.limit``, ``scripts/device_check.sh``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["matmul_clock", "host_link", "main"]

# Each class of instruction the walk times apart (nnx_zero1_plan's CYCLE_CLASSES), and the lone programs
# that measure it: a training step's matmul shapes (tokens x width x hidden, both ways) and a square one, and
# the vector unit's elementwise, reduction and exponent work; random data, as a step's is.
_MATMULS = ((8192, 1024, 4096), (8192, 4096, 1024), (8192, 8192, 8192))
_VECTOR = ("multiply_add", "row_sum", "softmax", "multiply_add_bf16")
# A matmul and the work the compiler fuses with it in a training step, alone: the batched matmul of
# attention's scores (heads of 64, at a batch that is and one that is not a multiple of 8), the same with
# its softmax's row sums fused in; a layer norm's backward (a bfloat16 x float32 matmul whose result is
# scaled and summed over the tokens and over the width in the same fusion) at two widths, alone, with its
# input joined from two halves in the same fusion, and with its weight stored transposed; the joined one and
# a float32 matmul again on a step's three-dimensional activations (micro-batch 8 and 13 of 1,024 tokens: the
# compiler writes such a matmul as a convolution over the micro-batch); and a projection with its activation.
_ATTENTION = ((8, 16, 1024, 64), (13, 16, 1024, 64))
_NORM_BACKWARD = ((8192, 8192, 1024), (8192, 4096, 1024))
_STEP_SHAPED = ((8, 1024), (13, 1024))
_COPY_BYTES = (256 * 2**20, 2**30)


def _device_seconds(fn: Callable[..., Any], args: Sequence[Any], runs: int,
                    ops: dict[str, float] | None = None) -> tuple[float, float]:
  """(the device's time per call from a profile's modules, the wall clock's per call over ``runs``
  back-to-back calls), after one call to warm up; ``ops``, where given, gets each instruction's device
  nanoseconds per call."""
  import jax

  from nnx_zero1_plan import profiled

  jax.block_until_ready(fn(*args))
  start = time.perf_counter()
  for _ in range(runs):
    out = fn(*args)
  jax.block_until_ready(out)
  wall = (time.perf_counter() - start) / runs
  profile = profiled(lambda: fn(*args), runs)
  modules = profile["modules"]
  if ops is not None:
    ops.update({name: ns for name, (ns, _) in profile["ops"].items()})  # device_ops names each by its name
  device = sum(ns for ns, _ in modules.values()) / 1e9 if modules else float("nan")
  return device, wall


def _cycles(hlo: str) -> float:
  """The compiler's cycles for a program, walked as the planner walks it."""
  from nnx_zero1_plan import Rates, program_time
  return program_time(hlo, Rates(clock_hz=1.0, collective_s=lambda *collective: 0.0)).compute_s or 0.0


def _fusions(hlo: str, ops: dict[str, float]) -> list[str]:
  """Each estimated instruction of a program: its name, the compiler's cycles and its device nanoseconds
  per call (which fusions the compiler made, and what each cost)."""
  from nnx_zero1._src.hlo import INSTRUCTION, estimated_cycles

  return [f"{m['name']} {estimated_cycles(line)} {ops.get(m['name'], 0.0):.0f}"
          for line in hlo.splitlines()
          if estimated_cycles(line) is not None and (m := INSTRUCTION.search(line))]


def _vector_program(kind: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
  import jax
  import jax.numpy as jnp

  keys = jax.random.split(jax.random.key(0), 3)
  if kind.startswith("multiply_add"):
    dtype = jnp.bfloat16 if kind.endswith("bf16") else jnp.float32
    args = tuple(jax.random.normal(k, (2**26,), dtype) for k in keys)
    return jax.jit(lambda a, b, c: a * b + c), args
  x = jax.random.normal(keys[0], (8192, 4096), jnp.float32)
  if kind == "row_sum":
    return jax.jit(lambda a: a.sum(axis=-1)), (x,)
  return jax.jit(lambda a: jax.nn.softmax(a, axis=-1)), (x,)


def _scores(q: Any, k: Any) -> Any:
  import jax.numpy as jnp

  return jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32)


def _fused_programs() -> list[tuple[str, Any, tuple[Any, ...]]]:
  """The lone programs of a matmul with the work a step fuses with it (:data:`_ATTENTION`,
  :data:`_NORM_BACKWARD`): (name, jitted function, arguments)."""
  import jax
  import jax.numpy as jnp

  keys = jax.random.split(jax.random.key(2), 4)
  cases: list[tuple[str, Any, tuple[Any, ...]]] = []
  for b, h, t, d in _ATTENTION:
    q, k = (jax.random.normal(key, (b, h, t, d), jnp.bfloat16) for key in keys[:2])
    cases.append((f"attention scores {b}x{h}x{t}x{d}", jax.jit(_scores), (q, k)))
    cases.append((f"attention scores {b}x{h}x{t}x{d} + row sums",
                   jax.jit(lambda q, k: (s := _scores(q, k), jnp.exp(s).sum(-1))), (q, k)))
  for tokens, hidden, width in _NORM_BACKWARD:
    x = jax.random.normal(keys[0], (tokens, hidden), jnp.bfloat16)
    w = jax.random.normal(keys[1], (hidden, width), jnp.float32)
    g = jax.random.normal(keys[2], (tokens, width), jnp.float32)
    s = jax.random.normal(keys[3], (width,), jnp.float32)

    def norm_backward(x, w, g, s):
      y = jnp.dot(x, w, preferred_element_type=jnp.float32)
      return y, (y * g).sum(0), (y * g * s).sum(-1)

    cases.append((f"norm backward {tokens}x{hidden}x{width}", jax.jit(norm_backward), (x, w, g, s)))
    halves = jnp.split(x, 2, axis=-1)  # the same, its input two halves joined (a gate and its up projection)
    cases.append((f"norm backward {tokens}x{hidden}x{width} of joined halves",
                  jax.jit(lambda a, b, w, g, s: norm_backward(jnp.concatenate([a, b], -1), w, g, s)),
                  (*halves, w, g, s)))
    cases.append((f"norm backward {tokens}x{hidden}x{width} by the weight stored transposed",
                  jax.jit(lambda x, wt, g, s: norm_backward(x, wt.T, g, s)), (x, w.T.copy(), g, s)))
  for batch, seq in _STEP_SHAPED:  # the same, as a step holds its activations: [micro-batch, sequence, width]
    x = jax.random.normal(keys[0], (batch, seq, 4096), jnp.bfloat16)
    y = jax.random.normal(keys[0], (batch, seq, 4096), jnp.bfloat16)
    w = jax.random.normal(keys[1], (8192, 1024), jnp.float32)
    g = jax.random.normal(keys[2], (batch, seq, 1024), jnp.float32)
    s = jax.random.normal(keys[3], (1024,), jnp.float32)

    def joined_norm_backward(x, y, w, g, s):
      out = jnp.dot(jnp.concatenate([x, y], -1), w, preferred_element_type=jnp.float32)
      return out, (out * g).sum((0, 1)), (out * g * s).sum(-1)

    cases.append((f"norm backward {batch}x{seq}x8192x1024 of joined halves", jax.jit(joined_norm_backward),
                  (x, y, w, g, s)))
    a = jax.random.normal(keys[0], (batch, seq, 1024), jnp.float32)
    cases.append((f"matmul {batch}x{seq}x1024x4096 float32", jax.jit(lambda a, b: a @ b),
                  (a, jax.random.normal(keys[1], (1024, 4096), jnp.float32))))
  x, w = (jax.random.normal(key, shape, jnp.bfloat16)
          for key, shape in zip(keys, ((8192, 1024), (1024, 4096)), strict=False))
  cases.append(("matmul 8192x1024x4096 + gelu", jax.jit(lambda x, w: jax.nn.gelu(x @ w)), (x, w)))
  return cases


def matmul_clock(runs: int = 10) -> list[dict[str, Any]]:
  """Each lone program's cycles (the compiler's, walked as the planner walks them), its time on the device
  and the clock they imply, by the class the walk puts its instructions in: matmuls in bfloat16 and in
  float32, and the vector unit's work."""
  import jax
  import jax.numpy as jnp

  from nnx_zero1_plan import cycle_class

  cases: list[tuple[str, Any, tuple[Any, ...]]] = []
  for dtype in (jnp.bfloat16, jnp.float32):
    for m, k, n in _MATMULS:
      a, b = jax.random.split(jax.random.key(1))
      args = (jax.random.normal(a, (m, k), dtype), jax.random.normal(b, (k, n), dtype))
      cases.append((f"matmul {m}x{k}x{n} {jnp.dtype(dtype).name}", jax.jit(lambda x, y: x @ y), args))
  cases += [(kind, *_vector_program(kind)) for kind in _VECTOR] + _fused_programs()
  rows = []
  for name, fn, args in cases:
    hlo = fn.lower(*args).compile().as_text()
    cycles = _cycles(hlo)
    ops: dict[str, float] = {}
    device, wall = _device_seconds(fn, args, runs, ops)
    rows.append({"program": name, "classes": sorted(cycle_class(hlo)), "cycles": cycles, "device_s": device,
                 "wall_s": wall, "clock_hz": cycles / device, "fusions": _fusions(hlo, ops)})
  return rows


def host_link(runs: int = 5) -> list[dict[str, Any]]:
  """Bytes per second of a jitted copy between device memory and pinned host memory: each way alone and
  both at once, on the device (a profile) and by the wall clock."""
  import jax
  import jax.numpy as jnp

  device = jax.devices()[0]
  on_device = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
  on_host = on_device.with_memory_kind("pinned_host")
  rows = []
  for nbytes in _COPY_BYTES:
    x = jax.device_put(jnp.ones((nbytes // 4,), jnp.float32), on_device)
    h = jax.device_put(jnp.ones((nbytes // 4,), jnp.float32), on_host)
    cases = {
        "to_host": (jax.jit(lambda a: jax.device_put(a, on_host)), (x,), nbytes),
        "to_device": (jax.jit(lambda a: jax.device_put(a, on_device)), (h,), nbytes),
        "both": (jax.jit(lambda a, b: (jax.device_put(a, on_host), jax.device_put(b, on_device))), (x, h),
                 2 * nbytes),
    }
    for way, (fn, args, moved) in cases.items():
      hlo = fn.lower(*args).compile().as_text() or ""
      seconds, wall = _device_seconds(fn, args, runs)
      rows.append({"way": way, "bytes": moved, "device_s": seconds, "wall_s": wall,
                   "device_bytes_per_s": moved / seconds, "wall_bytes_per_s": moved / wall,
                   "copy_starts": hlo.count("copy-start(")})
  return rows


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m benchmarks.chip_rates", description=__doc__.splitlines()[0])
  p.add_argument("--out", default="bench_out/chip_rates")
  args = p.parse_args(argv)
  import jax

  os.makedirs(args.out, exist_ok=True)
  found: dict[str, Any] = {"device_kind": jax.devices()[0].device_kind, "jax": jax.__version__}
  for name, bench in (("matmul_clock", matmul_clock), ("host_link", host_link)):
    try:
      found[name] = bench()
    except Exception as e:  # keep the other microbenchmark's figures and this one's error
      found[name] = {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"}
    print(name, json.dumps(found[name], indent=1), flush=True)
  with open(os.path.join(args.out, "rates.json"), "w") as f:
    json.dump(found, f, indent=1)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
