"""Will it fit? ``python -m nnx_zero1.plan``: a training step compiled for TPUs or NVIDIA GPUs, never run."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import tqdm

from nnx_zero1_plan import compilers
from nnx_zero1_plan.compilers import AotUnavailable
from nnx_zero1_plan.estimate import WHOLE_OVER_ESTIMATE_UP_TO
from nnx_zero1_plan.inputs import BACKENDS, ONE_SLICE, PlanError, parse_overrides
from nnx_zero1_plan.levers import LEVERS
from nnx_zero1_plan.local import devices_for, plan_here
from nnx_zero1_plan.mesh_axes import SMALLEST_MICRO_BATCH
from nnx_zero1_plan.request import DEFAULT_DEPTHS, SETTING_DEFAULTS, PlanRequest


@dataclasses.dataclass(frozen=True)
class Flag:
  """One of the command line's flags (``--seq-len`` sets the :class:`PlanRequest` field ``seq_len``): its
  words in markdown (``--help`` says them without the backticks, docs/planner.md's flag table as written),
  ``argparse``'s other keywords, and the names ``--help`` lists after the words."""

  name: str
  words: str
  options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  listed: Sequence[str] = ()

  @property
  def help(self) -> str:
    """``--help``'s words: the markdown's backticks dropped, ``%`` escaped (argparse formats help with it)."""
    words = self.words.replace("`", "").replace("%", "%%")
    return f"{words}: {', '.join(self.listed)}" if self.listed else words


# The flags in --help's order; each flag's default is its PlanRequest field's (parse_args sets them).
FLAGS = (
    Flag("--model", "`tunix:CONFIG`, a Tunix `ModelConfig` classmethod (`qwen3_0p6b`, `qwen3_8b`, "
         "`llama3p1_8b`, `gemma3_4b_pt`, ...); `maxtext:MODEL_NAME`, a model of MaxText's `configs/models` "
         "(`qwen3-0.6b`, `llama3.1-8b`, `default`, ...); or `package.module:function`", {"required": True}),
    Flag("--topology", "a TPU slice libtpu knows (`v5e:2x4`, `v6e:2x2`, `v4:2x2x1`, `v5p:2x2x1`, ...), or "
         "NVIDIA GPUs: `h100:8`, `h200:8`, `a100-80g:8`, `b200:8` (one node), and nodes x GPUs per node "
         "(`h100:2x8`: two nodes of 8)", {"required": True}),
    Flag("--slices", f"TPU slices of `--topology` joined over the data-center network (default {ONE_SLICE}); "
         "the default mesh gains `replica` across them. GPU nodes are in the topology (`h100:8x8`; "
         "`--slices` on a GPU target is answered with that spelling)", {"type": int}),
    Flag("--gpus-per-node", "GPU nodes of other than the chip's 8 GPUs, said again: "
         "`--topology h100:8x2 --gpus-per-node 2` plans 8 nodes of 2", {"type": int}),
    Flag("--mesh", "axis sizes, `data=4,fsdp=2,tp=1`; an axis the model's annotations name but this omits "
         "has size 1; default: every device on `data` (on a pod, `replica` across the slices or nodes and "
         "`data` inside each)"),
    Flag("--batch", "the global micro-batch in sequences (default: the smallest multiple of the batch axes' "
         f"size of at least {SMALLEST_MICRO_BATCH}: 8 on up to 8 devices, 64 on `h100:8x8`; the plan states "
         "it, `meta.batch_default`)", {"type": int}),
    Flag("--global-batch", "sequences per optimizer step, as your recipe fixes it, instead of `--batch` and "
         "`--ga`: the plan splits it for each lever into the micro-batch and GA that fit and train fastest. "
         "Refused with `--batch`, `--ga`, `--search` or `--estimate`, a `maxtext:` model, or the "
         "`offload-fraction` lever", {"type": int}),
    Flag("--seq-len", f"tokens per sequence (default {SETTING_DEFAULTS['seq_len']})", {"type": int}),
    Flag("--ga", f"micro-batches per optimizer step (default {SETTING_DEFAULTS['ga']})", {"type": int}),
    Flag("--param-dtype", "the parameters' dtype, e.g. `bfloat16` (`tunix:` models; MaxText's "
         "`weight_dtype`)"),
    Flag("--compute-dtype", "the activations' dtype (`tunix:` models; MaxText's `dtype`)"),
    Flag("--remat", "the remat policy: Tunix's `none`, `block` or `decoder`, or MaxText's `remat_policy` "
         "(`full`, `minimal`, ...); several, comma-separated, a row apiece (default: the model's own)"),
    Flag("--optimizer", f"`{SETTING_DEFAULTS['optimizer']}` (default), `adam`, `lion`, `sgd` (momentum), "
         "`adafactor`"),
    Flag("--levers", f"comma-separated lever names (default `{','.join(SETTING_DEFAULTS['levers'])}`)",
         listed=tuple(LEVERS)),
    Flag("--steps", f"`one`, `split` or both (default `{','.join(SETTING_DEFAULTS['steps'])}`): each lever's "
         "step compiled as one program (as Tunix and `nnx.jit` loops compile it) or as two (as MaxText's "
         "engine)"),
    Flag("--estimate", "TPUs: compile deep `tunix:` and own models at "
         f"{' and '.join(map(str, DEFAULT_DEPTHS))} layers and extrapolate per layer, instead of whole (the "
         f"default): quicker, measured up to {WHOLE_OVER_ESTIMATE_UP_TO}x low, and deciding no fit. Not with "
         "`--search`", {"action": "store_true"}),
    Flag("--tunix-sharding", "`tunix:` models' activation sharding constraints, applied as on the chips: "
         "`default` (Tunix's `ShardingConfig`), `none` (XLA's own propagation), or a JSON object of "
         "`ShardingConfig` `act_*` fields"),
    Flag("--lora", "`tunix:` models: plan a LoRA run of this rank, as Tunix trains one: qwix's adapters on "
         "the attention and MLP projections, and only they trained (`wrt=nnx.LoRAParam`); default: full "
         "fine-tuning", {"type": int, "metavar": "RANK"}),
    Flag("--maxtext-deferral", f"`maxtext:` models: `{SETTING_DEFAULTS['maxtext_deferral']}` (default: "
         "MaxText's engine defers the data-parallel all-reduce to `update` where it can) or `off` (every "
         "micro-batch all-reduces its gradients)", {"choices": ("auto", "off")}),
    Flag("--search", "also find each lever's largest micro-batch that fits, a few compiles per lever, and "
         "recommend by it: from `--batch` up, and where `--batch` does not fit, from the smallest "
         "micro-batch (one sequence per device of the batch axes) up. Refused with `--estimate` or "
         "`--global-batch`", {"action": "store_true"}),
    Flag("--measure", "where this machine's devices are the target's chips: profile the first fitting row of "
         "each build there (a lever's update, with or without the accumulation loop; and a search's largest "
         "micro-batch) and time every row by the runs built as it is, then run each fitting row's "
         "one-program step (with `--search` each lever's largest micro-batch, and the recommended point) for "
         "2 steps, then 8 timed: their median beside the predicted, and the allocator's `bytes_in_use` after "
         "them (`held GiB`: the state, not the program's temporaries)", {"action": "store_true"}),
    Flag("--calibration", "a plan made with `--measure` for this model on the target's chip (its plan.json "
         "or folder; several comma-separated): every row is also timed by the chip's own ratio to the cost "
         "model, kind by kind, on any machine, for any slice or pod of that chip (another chip's is refused)",
         {"metavar": "PATH"}),
    Flag("--margin", "the share of the memory to leave free, for `fits`, the search and the recommendation "
         "(default: the backend's reserve, what a run needs beyond the compiler's figure: TPU none, GPU "
         f"{BACKENDS['cuda'].reserve_bytes // 2**20} MiB)", {"type": float}),
    Flag("--gpu-memory-fraction", "GPU targets: the `XLA_PYTHON_CLIENT_MEM_FRACTION` the run will use "
         f"(default jax's {SETTING_DEFAULTS['gpu_memory_fraction']}); the compiler is told to plan for that "
         "pool, and it is the usable memory", {"type": float}),
    Flag("--out", "folder for `plan.json` and `plan.md` (default: none)"),
    Flag("--traceback", "with a refusal, the whole traceback above its one line (where a model builder of "
         "your own raised)", {"action": "store_true"}),
    Flag("overrides", "MaxText config overrides, last, as on MaxText's own command line (`maxtext:` models "
         "only), e.g. `remat_policy=minimal`", {"nargs": "*", "metavar": "KEY=VALUE"}),
)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  """The command line's flags (:data:`FLAGS`; the names are a contract).

  Example::

    >>> parse_args(["--model", "tunix:qwen3_0p6b", "--topology", "h100:8"]).levers
    ('baseline', 'zero1')
  """
  p = argparse.ArgumentParser(prog="python -m nnx_zero1.plan", description=__doc__.split("\n\n")[0])
  for flag in FLAGS:
    p.add_argument(flag.name, help=flag.help, **flag.options)
  # An old command line's flag, refused (request_of) with a line that says why rather than ignored.
  p.add_argument("--full-depth", action="store_true", help=argparse.SUPPRESS)
  p.set_defaults(**SETTING_DEFAULTS)  # each flag's default is its PlanRequest field's
  return p.parse_args(argv)


def request_of(args: argparse.Namespace) -> PlanRequest:
  """The :class:`PlanRequest` the command line's flags (:func:`parse_args`) ask for, checked: a
  ``PlanError`` for what it refuses, a malformed MaxText override, or ``--full-depth``."""
  if getattr(args, "full_depth", False):
    raise PlanError("--full-depth: whole programs are the default; leave the flag out (--estimate asks for "
                    "reduced depths instead)")
  flags = {name: getattr(args, name) for name in SETTING_DEFAULTS if name in args}
  return PlanRequest(args.model, args.topology, **{**flags, "overrides": parse_overrides(args.overrides)})


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the command line; returns 0, or 2 with one line on stderr for input it cannot plan (with
  ``--traceback``, the traceback above it)."""
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
  with tempfile.NamedTemporaryFile(prefix="nnx_zero1_plan_compiler_", suffix=".log", delete=False) as f:
    return f.name


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

