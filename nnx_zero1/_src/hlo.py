"""One reading of a compiled program's HLO text: its computations, how often each runs, and what each
instruction is (a collective, a copy between host and device memory, its estimated cycles).

Private: ``compiled.as_text()`` parsed with small pure functions, from which one record of a program is
read (:class:`nnx_zero1._src.hlo_record.HloRecord`): what is counted and what the planner figures are
functions of that record.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

__all__ = [
    "COLLECTIVES", "COLLECTIVE_OPS", "FUSED_REDUCE_SCATTER_CALL", "INSTRUCTION", "shape_bytes",
    "result_bytes", "computations", "callees", "chosen_branch", "condition_trip_count", "trip_count", "calls",
    "executions", "collective_of", "estimated_cycles", "host_copy", "partitions",
]

# all-to-all: the int8 reduce-scatter across slices or nodes (across_dtype=jnp.int8) is one. Every count has
# these four; a collective-permute (a pipeline's send to its neighbour) is counted where a program has one.
COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all")
COLLECTIVE_OPS = (*COLLECTIVES, "collective-permute")

_DTYPE_BYTES = {
    "pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9][a-z]*)?)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
# One instruction's line, every reader's: its name, result shape (a tuple's spaces too), op and operands.
INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.*?)\s(?P<op>[a-z][\w\-]*)\("
                         r"(?P<args>[^)]*)\)")
_OP = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>.*?)\s"
    r"(?P<op>" + "|".join(COLLECTIVE_OPS) + r")(?P<start>-start)?\("
)
# A collective wrapped in a generic async pair (``async-start(...), calls=%all-gather.3``).
_ASYNC = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>.*?)\sasync-start\(.*\bcalls=%?"
                    r"(?P<op>" + "|".join(COLLECTIVE_OPS) + r")")
# The TPU compiler emits a reduce-scatter as a fusion calling a computation named all-reduce-scatter*
# (an all-reduce and a slice fused into one collective, "SingleInputAllReduceScatterFusion"); its
# result is the scattered slice.
FUSED_REDUCE_SCATTER_CALL = re.compile(r"\bcalls=%?(all-reduce-scatter[\w.\-]*)")
_FUSED_REDUCE_SCATTER = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>.*?)\sfusion\(.*" + FUSED_REDUCE_SCATTER_CALL.pattern
)
# What a collective's line holds, at least: its op's name, or a generic async start.
_COLLECTIVE_WORDS = (*COLLECTIVE_OPS, "async-start(")
# The TPU compiler marks host memory as memory space 5 in a layout ("{1,0:T(8,128)S(5)}").
_HOST_SPACE = "S(5)}"
_PARTITIONS = re.compile(r"\bnum_partitions=(\d+)")
_CALLEE = re.compile(r"\b(body|calls)=%?([\w.\-]+)")
_CALL = re.compile(r"\scall\(.*\bto_apply=%?([\w.\-]+)")
_BRANCHES = re.compile(r"(?:branch_computations=\{([^}]*)\}|true_computation=%?([\w.\-]+), "
                       r"false_computation=%?([\w.\-]+))")
# What a line that runs a computation holds, at least (:func:`calls` reads only those).
_CALLING = ("calls=", "body=", "call(", "_computation")
_CYCLES = re.compile(r'"estimated_cycles":"?(\d+)')
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CONDITION = re.compile(r"\bcondition=%?([\w.\-]+)")
_CONSTANT = re.compile(r"^\s*%?([\w.\-]+)\s*=\s*[su](?:32|64)\[\]\S*\s+constant\((\d+)\)")
_LESS_THAN = re.compile(
    r"^\s*ROOT\s+%?[\w.\-]+\s*=\s*pred\[\]\S*\s+compare\(%?([\w.\-]+),\s*%?([\w.\-]+)\),\s*direction=LT"
)


def _array_bytes(dtype: str, dims: str) -> int:
  size = 1
  for d in filter(None, dims.split(",")):
    size *= int(d)
  # fp8 variants (f8e4m3fn, ...) are one byte.
  return size * _DTYPE_BYTES.get(dtype, 1 if dtype.startswith("f8") else 4)


def shape_bytes(shape: str, *, second_half: bool = False) -> int:
  """Bytes of an HLO shape string; a tuple's elements are summed.

  ``second_half=True`` counts only the last half of the tuple's arrays: the
  results of an async ``all-gather-start``, whose shape is (operands, results).

  Args:
    shape: an HLO shape, e.g. ``"f32[4,8]{1,0}"`` or a tuple ``"(f32[2]{0}, bf16[2,2]{1,0})"``.
    second_half: count only the second half of a tuple's arrays.

  Returns:
    The bytes, as an ``int``; an unknown dtype counts 4 bytes per element.

  Example::

    >>> shape_bytes("f32[4,8]{1,0}")
    128
    >>> shape_bytes("(f32[2]{0}, bf16[2,2]{1,0})")
    16
    >>> shape_bytes("(f32[2]{0}, f32[8]{0})", second_half=True)
    32
  """
  arrays = _ARRAY.findall(shape)
  if second_half:
    arrays = arrays[len(arrays) // 2:]
  return sum(_array_bytes(dtype, dims) for dtype, dims in arrays)


def result_bytes(shape: str, op: str, start: bool) -> int:
  """Bytes a collective produces on one device, from its HLO shape.

  A synchronous collective's shape is its result. An async ``all-gather-start``'s
  is (operands, results). An async ``all-reduce-start``'s is its result on XLA's
  CPU backend and ((operands), results) on XLA's GPU backend, where counting the
  whole tuple would count the data twice.

  Example::

    >>> result_bytes("((bf16[8]{0}), bf16[8]{0})", "all-reduce", start=True)  # GPU
    16
    >>> result_bytes("f32[8]{0}", "all-reduce", start=True)  # CPU
    32
  """
  if start and op == "all-reduce" and shape.startswith("(("):
    depth = 0
    for i, ch in enumerate(shape):
      depth += {"(": 1, ")": -1}.get(ch, 0)
      if depth == 1 and ch == ")":  # the operands' tuple has closed: the rest is the result
        return shape_bytes(shape[i + 1:])
  return shape_bytes(shape, second_half=start and op != "all-reduce")


def computations(hlo: str) -> tuple[dict[str, list[str]], str | None]:
  """Splits HLO text into {computation name: its instruction lines} and the entry's name.

  An instruction is one line, except where its attributes hold newlines (a Pallas kernel's custom call
  carries its metadata over several lines, one of them starting with ``}}``): a line inside a computation
  that is not indented continues the instruction before it, and only ``}`` alone closes the computation.

  Example::

    >>> hlo = "\\n".join(["ENTRY %main (p: f32[8]) -> f32[8] {",
    ...                  '  %k = f32[8]{0} custom-call(%p), backend_config={"m":"{', '}}", metadata={}',
    ...                  "  ROOT %n = f32[8]{0} negate(%k)", "}"])
    >>> [len(lines) for lines in computations(hlo)[0].values()]
    [2]
  """
  bodies: dict[str, list[str]] = {}
  entry, current = None, None
  for line in hlo.splitlines():
    header = _HEADER.match(line)
    if current is None and header and "=" not in line.split("{", 1)[0].split("(", 1)[0]:
      current = header.group(2)
      bodies[current] = []
      entry = current if header.group(1) else entry
    elif line.rstrip() == "}":
      current = None
    elif current is not None and bodies[current] and not line.startswith((" ", "\t")):
      bodies[current][-1] += line
    elif current is not None:
      bodies[current].append(line)
  return bodies, entry


def chosen_branch(line: str, bodies: dict[str, list[str]]) -> str | None:
  """The branch of a conditional every reader counts: one branch runs per call, and the planner assumes the
  costliest, by the compiler's estimated cycles of its instructions (where it gives none, by how many it
  has; the first of equals).

  Example::

    >>> bodies = {"a": ["  %x = f32[] negate(%p)"], "b": ["  %x = f32[] negate(%p)", "  %y = f32[] abs(%x)"]}
    >>> chosen_branch("%c = f32[] conditional(%i, %p, %p), branch_computations={%a, %b}", bodies)
    'b'
  """
  found = _BRANCHES.search(line)
  if found is None:
    return None
  names = [b.strip().lstrip("%") for b in found[1].split(",")] if found[1] else [found[2], found[3]]
  weight = lambda name: (sum(int(c[1]) for c in map(_CYCLES.search, bodies.get(name, ())) if c),  # noqa: E731
                         len(bodies.get(name, ())))
  return max(names, key=weight)


def callees(line: str, bodies: dict[str, list[str]]) -> list[tuple[str, str]]:
  """(kind, computation) for every computation an instruction runs: a while loop's ``body``, a fusion's or
  an async op's ``calls``, a ``call``'s ``to_apply`` and a conditional's chosen branch
  (:func:`chosen_branch`); a reduction's ``to_apply`` is its scalar adder, not a computation run here."""
  if _FUSED_REDUCE_SCATTER.match(line) or _ASYNC.match(line):
    return []  # counted as one collective where it starts; the one inside is not a second
  found = [(kind, callee) for kind, callee in _CALLEE.findall(line)]
  call = _CALL.search(line)
  branch = chosen_branch(line, bodies)
  return found + ([("call", call[1])] if call else []) + ([("branch", branch)] if branch else [])


def condition_trip_count(condition: list[str]) -> int | None:
  """The trips of a while loop whose condition computation is ``counter < constant`` (None otherwise).

  The TPU compiler's HLO carries no ``known_trip_count``; a ``lax.scan`` there
  keeps the form ``ROOT compare(counter, constant(N)), direction=LT`` with the
  counter starting at 0.

  Example::

    >>> condition_trip_count([
    ...     "  %c = s32[]{:T(128)} constant(8)",
    ...     "  %i = s32[]{:T(128)} get-tuple-element(%p), index=0",
    ...     "  ROOT %lt = pred[]{:T(512)} compare(%i, %c), direction=LT",
    ... ])
    8
  """
  constants = {m[1]: int(m[2]) for m in map(_CONSTANT.match, condition) if m}
  for line in condition:
    m = _LESS_THAN.match(line)
    if m and m[2] in constants:
      return constants[m[2]]
  return None


def trip_count(line: str, bodies: dict[str, list[str]]) -> int | None:
  """A while instruction's trip count: XLA's own annotation, else read off its condition."""
  trip = _TRIP.search(line)
  if trip:
    return int(trip.group(1))
  condition = _CONDITION.search(line)
  return condition_trip_count(bodies.get(condition.group(1), [])) if condition else None


def calls(line: str, bodies: dict[str, list[str]]) -> list[tuple[str, str, int]]:
  """(kind, computation, times it runs per run of the instruction) for each computation of ``bodies`` an
  instruction runs (:func:`callees`): a while body its trip count times (once where it is not known), any
  other once. The one rule of how often a computation runs; :func:`executions` compounds it.

  Example::

    >>> calls('%w = f32[8]{0} while(%a), body=%b, backend_config={"known_trip_count":{"n":"3"}}', {"b": []})
    [('body', 'b', 3)]
  """
  if not any(word in line for word in _CALLING):
    return []  # most instructions run no computation: none of the slower readings
  trip = trip_count(line, bodies) if "body=" in line else None
  return [(kind, callee, trip if kind == "body" and trip else 1) for kind, callee in callees(line, bodies)
          if callee in bodies]


def executions(graph: Mapping[str, Sequence[tuple[str, int]]], entry: str | None) -> dict[str, int]:
  """How many times each computation runs per call of the entry, from each computation's calls (``graph``:
  (callee, times per run of it), :func:`calls`' ``computation`` and ``times``), in the order they are first
  reached.

  Example::

    >>> executions({"main": [("body", 3)], "body": [("f", 1)]}, "main")
    {'main': 1, 'body': 3, 'f': 3}
  """
  runs: dict[str, int] = {}

  def visit(name: str, times: int) -> None:
    runs[name] = runs.get(name, 0) + times
    for callee, per_run in graph.get(name, ()):
      visit(callee, times * per_run)

  if entry is not None:
    visit(entry, 1)
  return runs


def collective_of(line: str) -> tuple[str, int, bool] | None:
  """(op, bytes of its result on one device, whether it is an async start) where ``line`` is a collective
  (each of :data:`COLLECTIVE_OPS`, synchronous, ``-start``, in a generic async pair, or the TPU compiler's
  fused reduce-scatter); None otherwise. A ``-done`` is its start's end, not a second collective.

  Example::

    >>> collective_of("%ag = (f32[2]{0}, f32[8]{0}) all-gather-start(%p), dimensions={0}")
    ('all-gather', 32, True)
    >>> collective_of("%cp = f32[4]{0} collective-permute(%p), source_target_pairs={{0,1},{1,0}}")
    ('collective-permute', 16, False)
  """
  if not any(word in line for word in _COLLECTIVE_WORDS):  # most lines: no pattern need be tried
    return None
  fused = _FUSED_REDUCE_SCATTER.match(line)
  if fused:
    return "reduce-scatter", shape_bytes(fused["shape"]), False
  m = _OP.match(line) or _ASYNC.match(line)
  if m is None:
    return None
  start = bool(m.groupdict().get("start")) or "async-start(" in line
  return m["op"], result_bytes(m["shape"], m["op"], start), start


def estimated_cycles(line: str) -> int | None:
  """The TPU compiler's estimate of an instruction (its ``backend_config``'s ``estimated_cycles``), if any.

  Example::

    >>> estimated_cycles('%f = f32[8]{0} fusion(%p), backend_config={"estimated_cycles":"12"}')
    12
  """
  found = _CYCLES.search(line)
  return int(found[1]) if found else None


def host_copy(shape: str) -> str | None:
  """Which way an async copy moves between host and device memory (``to-host``, ``to-device``), from its
  shape, (destination, source, context); None for a copy within one memory.

  Example::

    >>> host_copy("(f32[8]{0:S(5)}, f32[8]{0}, u32[]{:S(2)})"), host_copy("(f32[8]{0}, f32[8]{0}, u32[])")
    ('to-host', None)
  """
  parts = shape.split(", ")
  if len(parts) < 2 or (_HOST_SPACE in parts[0]) == (_HOST_SPACE in parts[1]):
    return None
  return "to-host" if _HOST_SPACE in parts[0] else "to-device"


def partitions(hlo: str) -> int:
  """The devices a compiled SPMD program runs on: its module's ``num_partitions`` (1 when it names none).

  Example::

    >>> partitions("HloModule jit_f, num_partitions=8"), partitions("HloModule jit_f")
    (8, 1)
  """
  found = _PARTITIONS.search(hlo)
  return int(found[1]) if found else 1
