"""A bfloat16 matmul with a float32 result, priced as XLA's GPU cost model prices the same matmul with a
bfloat16 result.

XLA's GPU cost model (its speed-of-light estimator) prices a matmul from tables measured on the GPU, keyed by
the operands' and the result's types (``bf16xbf16->bf16``, ``f32xf32->f32``, float8 into bfloat16). A
bfloat16 matmul with a float32 result (attention's logits, anything asked for with
``preferred_element_type=jnp.float32``) has no entry and is priced as the CUDA cores would do it: 9.6 TFLOP/s
on an H100 where the same matmul with a bfloat16 result is priced at 577. Tensor cores accumulate in float32
either way, so such a matmul is priced as the compiler prices the same one with a bfloat16 result, asked of
it in one small program compiled for the same GPUs.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nnx_zero1_plan.gpu_schedule import dumped_schedule
from nnx_zero1_plan.program_record import ProgramRecord

# (lhs shape, rhs shape, ((lhs contracting, rhs contracting), (lhs batch, rhs batch)))
Matmul = tuple[tuple[int, ...], tuple[int, ...], tuple[tuple[tuple[int, ...], tuple[int, ...]],
                                                       tuple[tuple[int, ...], tuple[int, ...]]]]
_SHAPE = re.compile(r"^(?P<dtype>\w+)\[(?P<dims>[\d,]*)\]")


def _dims(text: str, key: str) -> tuple[int, ...]:
  found = re.search(key + r"=\{([\d,]*)\}", text)
  return tuple(int(d) for d in found[1].split(",") if d) if found else ()


def _shape(text: str) -> tuple[str, tuple[int, ...]]:
  found = _SHAPE.match(text)
  return (found["dtype"], tuple(int(d) for d in found["dims"].split(",") if d)) if found else ("", ())


def float32_result_matmuls(record: ProgramRecord) -> dict[str, Matmul]:
  """Each instruction of ``record`` fusing a bfloat16 matmul with a float32 result, by name: its matmul."""
  found: dict[str, Matmul] = {}
  for body in record.computations.values():
    for instruction in body:
      for call in (c for c in instruction.calls if c.kind == "calls"):
        inner = record.computations.get(call.computation, ())
        shapes = {i.name: _shape(i.shape) for i in inner}
        for dot in (i for i in inner if i.op == "dot" and _shape(i.shape)[0] == "f32"):
          lhs, rhs = (shapes.get(a.strip().lstrip("%"), ("", ())) for a in dot.args.split(",")[:2])
          if lhs[0] == rhs[0] == "bf16":
            found[instruction.name] = (lhs[1], rhs[1], (
                (_dims(dot.line, "lhs_contracting_dims"), _dims(dot.line, "rhs_contracting_dims")),
                (_dims(dot.line, "lhs_batch_dims"), _dims(dot.line, "rhs_batch_dims"))))
  return found


@functools.cache
def bfloat16_result_seconds(matmul: Matmul, devices: tuple[Any, ...]) -> float:
  """XLA's GPU cost model's seconds for ``matmul`` with a bfloat16 result on ``devices``' GPU: the costliest
  instruction of a program that does it on each device (with a small all-reduce, since the scheduler dumps no
  estimates for a program without a collective)."""
  mesh = Mesh(np.array(devices), ("d",))
  lhs, rhs, numbers = matmul
  whole = NamedSharding(mesh, PartitionSpec())
  args = [jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=whole) for shape in (lhs, rhs)]
  tiny = jax.ShapeDtypeStruct((len(devices),), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec("d")))
  probe = lambda a, b, t: (jax.lax.dot_general(a, b, numbers, preferred_element_type=jnp.bfloat16), t.sum())
  with dumped_schedule() as (options, read):
    jax.jit(probe).lower(*args, tiny).compile(options)
    return max(s for module in read().values() for s in module.values())


def tensor_core_priced(scheduled: Mapping[str, Mapping[str, float]], records: Sequence[ProgramRecord],
                       devices: Sequence[Any]) -> dict[str, dict[str, float]]:
  """``scheduled`` (XLA's GPU scheduler's seconds, ``{module: {instruction: seconds}}``) with each bfloat16
  matmul with a float32 result of ``records`` priced as the same matmul with a bfloat16 result."""
  priced = {module: dict(seconds) for module, seconds in scheduled.items()}
  for record in records:
    own = priced.get(record.module or "", {})
    for name, matmul in float32_result_matmuls(record).items():
      if name in own:
        own[name] = bfloat16_result_seconds(matmul, tuple(devices))
  return priced
