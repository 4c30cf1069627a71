"""Will it fit? ``python -m nnx_zero1.plan``: a training step compiled for TPUs or NVIDIA GPUs, never run.

The command line (the line above is ``--help``'s): its flags, their :class:`PlanRequest`, and :func:`main`.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import tqdm

from nnx_zero1_plan import compilers
from nnx_zero1_plan.compilers import AotUnavailable
from nnx_zero1_plan.depth import WHOLE_OVER_ESTIMATE_UP_TO
from nnx_zero1_plan.inputs import ONE_SLICE, PlanError, parse_overrides
from nnx_zero1_plan.levers import LEVERS
from nnx_zero1_plan.local import devices_for, plan_here
from nnx_zero1_plan.mesh_axes import SMALLEST_MICRO_BATCH
from nnx_zero1_plan.request import DEFAULT_DEPTHS, SETTING_DEFAULTS, PlanRequest


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  """The command line's flags (the names are a contract).

  Example::

    >>> parse_args(["--model", "tunix:qwen3_0p6b", "--topology", "h100:8"]).levers
    ('baseline', 'zero1')
  """
  p = argparse.ArgumentParser(prog="python -m nnx_zero1.plan", description=__doc__.split("\n\n")[0])
  p.add_argument("--model", required=True, help="tunix:CONFIG (e.g. tunix:qwen3_8b), maxtext:MODEL_NAME "
                 "(e.g. maxtext:qwen3-0.6b) or package.module:function")
  p.add_argument("--topology", required=True, help="v5e:2x4, v6e:2x2, v4:2x2x1, v5p:..., h100:8, h200:8, "
                 "a100-80g:8, b200:8, h100:2x8 (nodes x GPUs)")
  p.add_argument("--slices", type=int, help="TPU slices of --topology joined over the data-center network "
                 f"(default {ONE_SLICE}); the default mesh gains replica across them (GPU nodes: h100:8x8)")
  p.add_argument("--gpus-per-node", type=int, help="GPU nodes of other than the chip's standard 8 GPUs, said "
                 "again: --topology h100:8x2 --gpus-per-node 2 (8 nodes of 2)")
  p.add_argument("--mesh", help="axis sizes, e.g. data=4,fsdp=2 (default: every device on data; on a pod "
                 "replica=SLICES_OR_NODES first, then data)")
  p.add_argument("--batch", type=int, help="global micro-batch in sequences (default: the smallest multiple "
                 f"of the batch axes' size of at least {SMALLEST_MICRO_BATCH})")
  p.add_argument("--global-batch", type=int, help="sequences per optimizer step, as your recipe fixes it: "
                 "the plan splits it for each lever into the micro-batch and GA that fit and train fastest "
                 "(instead of --batch and --ga)")
  p.add_argument("--seq-len", type=int, help="tokens per sequence (default 1024)")
  p.add_argument("--ga", type=int, help="micro-batches per optimizer step (default 1)")
  p.add_argument("--param-dtype", help="parameters' dtype, e.g. bfloat16 (tunix: and maxtext: models)")
  p.add_argument("--compute-dtype", help="activations' dtype, e.g. bfloat16 (tunix: and maxtext: models)")
  p.add_argument("--remat", help="remat policy: none, block, decoder (tunix: models); MaxText's remat_policy "
                 "(maxtext: models: full, minimal, ...); several, comma-separated, plan each (default: the "
                 "model's own)")
  p.add_argument("--optimizer", help="adamw (default), adam, lion, sgd, adafactor")
  p.add_argument("--levers", help=f"comma-separated, of: {', '.join(LEVERS)} (default baseline,zero1)")
  p.add_argument("--steps", help="one (one program: gradients + update, as Tunix and nnx.jit loops compile "
                 "it), split (two programs, as MaxText's engine); default both")
  p.add_argument("--estimate", action="store_true", help=f"TPUs: compile deep models at {DEFAULT_DEPTHS} "
                 "layers and extrapolate (quicker; every such figure marked an estimate, measured up to "
                 f"{WHOLE_OVER_ESTIMATE_UP_TO}x low; decides no fit); default: whole programs")
  # An old command line's flag, refused (request_of) with a line that says why rather than ignored.
  p.add_argument("--full-depth", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--tunix-sharding", help="tunix: models' activation constraints, applied as on the chips: "
                 "default (Tunix's, the mesh's data axes in each batch entry), none (XLA's propagation), or "
                 "JSON of ShardingConfig act_* fields")
  p.add_argument("--lora", type=int, metavar="RANK", help="tunix: models: plan a LoRA run of this rank "
                 "(qwix's adapters on the attention and MLP projections, as Tunix's examples; only they "
                 "trained, wrt=nnx.LoRAParam); default: full fine-tuning")
  p.add_argument("--maxtext-deferral", choices=("auto", "off"), help="maxtext: models: auto (default: "
                 "MaxText's engine defers the data-parallel all-reduce to update where it can) or off (every "
                 "micro-batch all-reduces its gradients)")
  p.add_argument("--search", action="store_true", help="also find each lever's largest micro-batch that fits "
                 "(from --batch up, a few compiles per lever), and recommend by it")
  p.add_argument("--measure", action="store_true", help="where this machine's devices are the target's "
                 "chips: profile the first fitting row's step there, time every row also by that "
                 "calibration, and run each fitting row's one-program step (a search's largest, the "
                 "recommended point) for 2 + 8 steps: the median beside the predicted")
  p.add_argument("--calibration", metavar="PATH", help="a plan made with --measure on this model on the "
                 "target's chip (its plan.json or folder; several comma-separated): each row is also timed "
                 "by the chip's own ratio to the cost model, kind by kind, from the runs built as its step "
                 "is (another chip is refused)")
  p.add_argument("--margin", type=float, help="share of the memory to leave free (default: the backend's "
                 "reserve, what a run needs beyond the compiler's figure: TPU none, GPU 256 MiB)")
  p.add_argument("--gpu-memory-fraction", type=float, help="GPU targets: the XLA_PYTHON_CLIENT_MEM_FRACTION "
                 f"the run will use (default jax's {SETTING_DEFAULTS['gpu_memory_fraction']}); the compiler "
                 "plans for it")
  p.add_argument("--out", default=None, help="folder for plan.json and plan.md (default: none)")
  p.add_argument("--traceback", action="store_true", help="with a refusal (its one line), the whole "
                 "traceback too: where a model builder of your own raised")
  p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                 help="MaxText config overrides (maxtext: models), e.g. remat_policy=minimal")
  p.set_defaults(**SETTING_DEFAULTS)  # each flag's default is its PlanRequest field's
  return p.parse_args(argv)


def request_of(args: argparse.Namespace) -> PlanRequest:
  """The :class:`PlanRequest` the command line's flags (:func:`parse_args`) ask for, checked.

  Raises:
    PlanError: what :class:`PlanRequest` refuses, a malformed MaxText override, or ``--full-depth``.

  Example::

    >>> request_of(parse_args(["--model", "m:f", "--topology", "h100:2x8"])).domains
    2
  """
  if getattr(args, "full_depth", False):
    raise PlanError("--full-depth: whole programs are the default; leave the flag out (--estimate asks for "
                    "reduced depths instead)")
  flags = {name: getattr(args, name) for name in SETTING_DEFAULTS if name in args}
  return PlanRequest(args.model, args.topology, **{**flags, "overrides": parse_overrides(args.overrides)})


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the command line; returns 0, or 2 with one line on stderr for input it cannot plan (with
  ``--traceback``, the traceback above it).

  Example::

    main(["--model", "tunix:qwen3_0p6b", "--topology", "h100:8", "--out", "plan_out"])
  """
  args = parse_args(argv)
  stream: list[Any] = [sys.stderr]  # where the planner's own lines go: the terminal's stderr
  bar: Any = None

  def say(line: str) -> None:
    (print if bar is None else bar.write)(f"nnx_zero1.plan: {line}", file=stream[0])
    if bar is not None and line.startswith("compiled "):
      bar.update()

  log = None
  try:
    request = request_of(args)
    # Where the target's chips are this machine's, they are compiled for (and run on) in child processes,
    # one at a time; elsewhere this process is the planner's own, kept on jax's CPU backend.
    here = devices_for(request, measure=args.measure)
    if here is None:
      compilers.start_cpu_jax()
      from nnx_zero1_plan.run import make_plan  # jax's, imported once this process is prepared for it

    log = _compiler_log(args.out)
    with compilers.compiler_messages_to(log) as terminal:
      stream[0] = terminal
      # A search runs a few compiles per lever: a bar counts them, the lines go above it.
      bar = (tqdm.tqdm(desc="nnx_zero1.plan: search", unit=" compiles", file=terminal, disable=None)
             if args.search else None)  # disable=None: no bar where stderr is not a terminal
      result = (make_plan(request, progress=say) if here is None
                else plan_here(request, progress=say, measure=args.measure))
  except (PlanError, AotUnavailable) as e:
    stream[0] = sys.stderr
    if args.traceback:
      traceback.print_exception(e, file=sys.stderr)
    say(str(e))
    return 2
  finally:
    stream[0] = sys.stderr
    if bar is not None:
      bar.close()
    if log is not None:
      _said_compiler_log(log, args.out, say)
  print(result)
  if args.out:
    print("wrote " + ", ".join(result.write(args.out)))
  return 0


def _compiler_log(out: str | None) -> str:
  """Where the compilers' own messages go: ``compiler.log`` beside plan.json, else a file of its own."""
  if out:
    os.makedirs(out, exist_ok=True)
    return os.path.join(out, "compiler.log")
  handle, path = tempfile.mkstemp(prefix="nnx_zero1_plan_compiler_", suffix=".log")
  os.close(handle)
  return path


def _said_compiler_log(log: str, out: str | None, say: Callable[[str], None]) -> None:
  """One line where the compilers said something (kept in ``--out``'s ``compiler.log``); an empty log, or
  one of no ``--out``, removed, so a plan leaves no file behind."""
  with open(log) as f:
    lines = sum(1 for line in f if line.strip())
  if out is None or not lines:
    os.remove(log)
  if lines:
    where = f"in {log}" if out else "(--out keeps them in compiler.log)"
    say(f"the compilers printed {lines} lines of their own messages, kept off this output {where}")

