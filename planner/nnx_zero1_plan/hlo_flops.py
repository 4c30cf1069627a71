"""A compiled program's matmul FLOPs, counted from its HLO text: XLA's GPU compiler gives no
``cost_analysis()`` for a deviceless compile (a GPU row would carry no compute, and no cost of the remat a
larger micro-batch needs), and the TPU compiler's counts a loop's body once. Only matmuls: elementwise work is
small beside them in a transformer step, and remat shows in the matmuls it repeats."""

from __future__ import annotations

import math
import re

from nnx_zero1_plan.program_record import Instruction, ProgramRecord

_DIMS = re.compile(r"^\(?[a-z]\w*\[(?P<dims>[\d,]*)\]")
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{(?P<dims>[\d,]*)\}")
_WINDOW = re.compile(r"window=\{(?P<spec>[^}]*)\}")
_LABELS = re.compile(r"dim_labels=(?P<lhs>\w+)_(?P<rhs>\w+)->")
_MATMULS = ("dot", "convolution")


def _window(spec: str) -> list[tuple[int, int, int, tuple[int, int], int, int]]:
  """A convolution's window, per spatial dimension: (dimension, size, stride, (low, high) padding, input
  dilation, window dilation)."""
  fields = dict(f.split("=", 1) for f in spec.split() if "=" in f)
  if "size" not in fields:
    return []
  sizes = [int(d) for d in fields["size"].split("x")]
  each = lambda key: [int(d) for d in fields[key].split("x")] if key in fields else [1] * len(sizes)
  pads = ([tuple(int(p) for p in pad.split("_")) for pad in fields["pad"].split("x")] if "pad" in fields
          else [(0, 0)] * len(sizes))
  return [(d, k, s, (pad[0], pad[1]), base, window)
          for d, (k, s, pad, base, window) in enumerate(zip(sizes, each("stride"), pads, each("lhs_dilate"),
                                                           each("rhs_dilate"), strict=True))]


def _taps(n: int, k: int, stride: int, pad: tuple[int, int], base: int, window: int) -> float:
  """The window's taps per output that land on the input, not on its padding or the holes a base (input)
  dilation puts between its elements: the TPU compiler writes a batched matmul as a base-dilated
  convolution whose window reads one real element per output (``size=8 stride=7 lhs_dilate=8``)."""
  extent = (n - 1) * base + 1
  outputs = (extent + pad[0] + pad[1] - (k - 1) * window - 1) // stride + 1
  if outputs < 1:
    return float(k)
  if base == 1 and window == 1:  # the (output, kernel) pairs that land on the input, per output
    low = pad[0]
    return sum(min(k, n + low - p * stride) - max(0, low - p * stride) for p in range(outputs)) / outputs
  real = sum(1 for p in range(outputs) for j in range(k)
             if 0 <= (x := p * stride + j * window - pad[0]) < extent and x % base == 0)
  return real / outputs


def _flops(instruction: Instruction, shapes: dict[str, tuple[int, ...] | None]) -> int:
  """One matmul's FLOPs: a ``dot`` (2 x result x contracted), or a ``convolution`` (the TPU compiler's form
  of a matmul after layout assignment: 2 x result x window x input features per group)."""
  line, operands = instruction.line, [a.strip().lstrip("%") for a in instruction.args.split(",")]
  result, lhs = shapes[instruction.name], shapes.get(operands[0])
  if result is None or lhs is None:
    return 0
  if instruction.op == "dot":
    contracting = _CONTRACTING.search(line)
    if contracting is None:
      return 0
    return 2 * math.prod(result) * math.prod(lhs[int(d)] for d in contracting["dims"].split(",") if d)
  rhs = shapes.get(operands[1]) if len(operands) > 1 else None
  labels, window = _LABELS.search(line), _WINDOW.search(line)
  if rhs is None or labels is None or "i" not in labels["rhs"]:
    return 0
  taps = 1.0
  for dim, k, stride, pad, base, dilation in _window(window["spec"] if window else ""):
    taps *= _taps(lhs[labels["lhs"].index(str(dim))], k, stride, pad, base, dilation)
  # The kernel's input features are per group already (a grouped convolution's kernel holds 1/groups of them).
  return round(2 * math.prod(result) * taps * rhs[labels["rhs"].index("i")])


def dot_flops(program: ProgramRecord | str) -> int:
  """The FLOPs of every matmul in a compiled program (its record, or its text read here), each computation
  as often as it runs (a loop's body times its trip count)."""
  record = ProgramRecord.of(program)
  total = 0
  for body, times in ((record.computations[name], times) for name, times in record.runs.items()):
    shapes: dict[str, tuple[int, ...] | None] = {}
    for instruction in body if any(i.op in _MATMULS for i in body) else ():  # shapes only where a matmul is
      dims = _DIMS.match(instruction.shape)
      shapes[instruction.name] = tuple(int(d) for d in dims["dims"].split(",") if d) if dims else None
      if instruction.op in _MATMULS:
        total += times * _flops(instruction, shapes)
  return total
