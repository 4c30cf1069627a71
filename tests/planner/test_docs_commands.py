"""Every ``python -m nnx_zero1.plan`` command the documentation shows runs as pasted: each parses into a
checked ``PlanRequest`` and a mesh and micro-batch that split over its topology's devices (no compiler, every
lane), a placeholder model (``my_pkg.models:build``) standing for the planner's toy; one pod command runs end
to end on the toy with XLA's GPU compiler (lane 2)."""

import contextlib
import io
import json
import math
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from nnx_zero1.plan import parse_args
from nnx_zero1_plan import LEVERS, request_of
from nnx_zero1_plan.inputs import PlanError, parse_topology
from nnx_zero1_plan.mesh_axes import batch_axes, mesh_axes, micro_batch
from tests.support.compiled_plans import HAS_GPU_COMPILER, TOYS, planner_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCES = sorted([ROOT / "README.md", ROOT / "planner" / "README.md", *ROOT.glob("docs/*.md"),
                  *ROOT.glob("planner/nnx_zero1_plan/*.py"), *ROOT.glob("examples/*.py")])
COMMAND = "python -m nnx_zero1.plan"
TOY = f"{TOYS}:tiny_lm"
# The pages about the planner, where every lever and flag named is the planner's own.
PLANNER_PAGES = [ROOT / "README.md", ROOT / "planner" / "README.md",
                 *(ROOT / "docs" / f"{name}.md" for name in ("planner", "accuracy", "pods"))]
_LEVER_LIKE = re.compile(r"(baseline|zero[12][a-z0-9-]*|offload[a-z0-9-]*)")
# A flag the command line still takes, to refuse it in one line that says why (its help leaves it out).
_REFUSED = {"--full-depth"}


def commands(text: str) -> list[str]:
  """Each planner command in ``text`` as pasted: an inline code span whole, or a line with its ``\\``
  continuations, up to a shell comment or the next command of a chain."""
  found = []
  for m in re.finditer(re.escape(COMMAND), text):
    if m.start() and text[m.start() - 1] == "`":
      command = text[m.start():text.index("`", m.end())]
    else:
      lines = text[m.start():].split("\n")
      command = lines.pop(0)
      while command.rstrip().endswith("\\") and lines:
        command = command.rstrip()[:-1] + " " + lines.pop(0)
    command = re.split(r"&&|;|\|", " ".join(command.split()))[0].strip()
    if "--model" in command and "..." not in command and "{" not in command:
      found.append(command)
  return found


def documented() -> list[tuple[str, str]]:
  return [(str(path.relative_to(ROOT)), command) for path in SOURCES
          for command in commands(path.read_text())]


def _pasted(command: str) -> list[str]:
  """The command's flags, a placeholder model (one of the docs' ``my_...`` modules) as the toy."""
  argv = shlex.split(command, comments=True)[3:]
  model = argv.index("--model") + 1
  if argv[model].startswith("my"):
    argv[model] = TOY
  return argv


def _devices(topology: str, slices: int) -> int:
  """The devices a topology names: GPUs, or one TPU device per chip of every slice (v4 and later)."""
  platform, _, shape = parse_topology(topology, ["h100", "h200", "a100-80g", "b200"])
  return math.prod(shape) * (slices if platform == "tpu" else 1)


DOCUMENTED = documented()


def test_the_documentation_shows_the_planners_commands():
  found = DOCUMENTED
  assert len(found) >= 20, found
  assert any("h100:8x8" in c and "--mesh" not in c for _, c in found)  # the pod command that failed as pasted


@pytest.mark.parametrize("where, command", DOCUMENTED,
                         ids=[f"{w}-{i}" for i, (w, _) in enumerate(DOCUMENTED)])
def test_each_documented_command_parses_into_a_plan_of_its_topology(where, command):
  """The flags as ``main`` reads them, the request it checks, then the checks that need only the topology's
  device count: the mesh (``replica`` across the slices or nodes) and the micro-batch split over it."""
  request = request_of(parse_args(_pasted(command)))
  devices = _devices(request.topology, request.slices)
  if request.model_ref.kind.engine:  # --mesh names one slice's ici_* axes; the batch is global
    assert request.batch is None or request.batch % devices == 0, (where, command)
    return
  try:
    axes = mesh_axes(request.mesh_sizes, [], devices, domains=request.domains, where=request.backend.domain)
    unit = math.prod(axes[a] for a in batch_axes(axes))
    micro_batch(request.batch, unit, "the batch axes")
  except PlanError as e:
    pytest.fail(f"{where}: {command}: {e}")


@pytest.mark.skipif(not HAS_GPU_COMPILER, reason="needs XLA's GPU compiler (CI lane 2)")
def test_the_eight_node_pod_command_runs_as_pasted(tmp_path):
  """docs/pods.md's eight nodes of eight H100s, the toy for its placeholder model: the default micro-batch
  is 64, one sequence per GPU, said in the plan; replica runs across the nodes; the recommendation's code
  builds that mesh node by node."""
  (command,) = [c for w, c in DOCUMENTED if w == "docs/pods.md" and "h100:8x8" in c and "--mesh" not in c]
  proc = subprocess.run([sys.executable, "-m", "nnx_zero1.plan", *_pasted(command), "--out", str(tmp_path)],
                        env=planner_env(), capture_output=True, text=True, timeout=500)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads((tmp_path / "plan.json").read_text())
  meta = result["meta"]
  assert meta["mesh"] == {"replica": 8, "data": 8} and meta["domains"] == 8 and meta["batch"] == 64
  assert meta["batch_default"].startswith("--batch not given: micro-batch 64, the smallest")
  assert "--batch not given: micro-batch 64" in proc.stdout
  assert {r["lever"] for r in result["rows"]} == {"baseline", "zero1", "zero1-pod"}
  assert all(r["fits"] for r in result["rows"])
  code = result["recommendation"]["code"]
  assert "np.array(by_node).reshape(8, 8), ('replica', 'data')" in code


def _spans(text: str) -> list[str]:
  """A page's inline code spans (its fenced blocks left out)."""
  return re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))


def _flags() -> set[str]:
  """The command line's flags, as its help lists them."""
  help_text = io.StringIO()
  with contextlib.redirect_stdout(help_text), pytest.raises(SystemExit):
    parse_args(["--help"])
  said = re.sub(r"-\n\s+", "-", help_text.getvalue())  # a flag argparse wrapped at its hyphen, whole again
  return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", said)) - {"--help"} | _REFUSED


def test_the_flag_table_is_the_command_lines_flags():
  from tests.support.docs_tables import table_under

  named = {flag for cell, _ in table_under("docs/planner.md", "| flag |")
           for flag in re.findall(r"`(--[\w-]+)`", cell)}
  assert named == _flags(), named ^ _flags()


def flag_row(flags) -> str:
  """docs/planner.md's flag table row of ``flags`` (one, or a few the page says together), as far as their
  words go (``--help``'s): the page may go on after either cell's.

  Example::

    >>> from nnx_zero1_plan.cli import FLAGS
    >>> print(flag_row([flag for flag in FLAGS if flag.name in ("--seq-len", "--ga")]))
    | `--seq-len`, `--ga` | tokens per sequence (default 1024); micro-batches per optimizer step (default 1) |
  """

  def spelt(flag) -> str:  # ``--lora`` RANK, or a positional's ``KEY=VALUE ...``
    metavar = flag.options.get("metavar")
    if not flag.name.startswith("--"):
      return f"`{metavar} ...`"
    return f"`{flag.name}` {metavar}" if metavar else f"`{flag.name}`"

  return f"| {', '.join(map(spelt, flags))} | {'; '.join(flag.words for flag in flags)} |"


def test_each_flag_table_row_starts_with_its_flags_words():
  """A row's cells start as :func:`flag_row` prints them from its flags' words, the page free to go on after
  them; every flag has its row."""
  from nnx_zero1_plan.cli import FLAGS
  from tests.support.docs_tables import cells, table_under

  rowed = []
  for first, words in table_under("docs/planner.md", "| flag |"):
    flags = [flag for flag in FLAGS if cells(flag_row([flag]))[0] in first]
    start = flag_row(flags)
    assert all(map(str.startswith, (first, words), cells(start))), f"the row should start: {start[:-2]}"
    rowed += [flag.name for flag in flags]
  assert sorted(rowed) == sorted(flag.name for flag in FLAGS)


@pytest.mark.parametrize("page", PLANNER_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_lever_and_flag_the_planners_pages_name_is_the_command_lines(page):
  """A lever is named as the planner names it (`zero2`, `offload`, never the bench's `zero2-accum`), a flag
  as `parse_args` takes it."""
  flags = _flags()
  for span in _spans(page.read_text()):
    if _LEVER_LIKE.fullmatch(span):
      assert span in LEVERS, f"{page.name}: `{span}` is not one of the planner's levers"
    if span.startswith("--") or COMMAND in span:  # not another program's command line
      for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", span):
        assert flag in flags, f"{page.name}: `{span}`"


def test_where_a_page_names_the_planners_levers_they_are_its_own():
  # docs/memory_levers.md and the bench's pages name the bench's arms too (zero2-accum, zero1-offload): in a
  # sentence about the planner, what follows the word names the planner's levers.
  for page in sorted((ROOT / "docs").glob("*.md")):
    for sentence in re.split(r"(?<=[.!?])\s+", " ".join(page.read_text().split())):
      if "planner" not in sentence:
        continue
      assert "of the same name" not in sentence, f"{page.name}: an arm's name is no lever's: {sentence!r}"
      after = sentence[sentence.index("planner"):]
      for span in _spans(after):
        assert not _LEVER_LIKE.fullmatch(span) or span in LEVERS, f"{page.name}: `{span}` in {sentence!r}"


def test_memory_levers_names_the_command_lines_levers_and_the_benchmarks_arms_as_arms():
  """docs/memory_levers.md's lever table gives each lever's `--levers` name; every other lever-like name on
  the page is one of the benchmark's arms, said to be one: in a table whose first column is the arm, or in a
  sentence that says "arm"."""
  from benchmarks.precision import ARMS as PRECISION_ARMS
  from benchmarks.settings import STEP_ARMS
  from tests.support.docs_tables import table_under

  page = ROOT / "docs" / "memory_levers.md"
  named = [n for row in table_under("docs/memory_levers.md", "| lever | option | the planner's `--levers` |")
           for n in re.findall(r"`([^`]+)`", row[2])]
  assert named and set(named) <= set(LEVERS), named
  arms = set(STEP_ARMS) | set(PRECISION_ARMS)
  header = ""
  for paragraph in re.split(r"\n\s*\n", re.sub(r"```.*?```", "", page.read_text(), flags=re.S)):
    if paragraph.lstrip().startswith("|"):
      lines = paragraph.strip().splitlines()
      header, units = lines[0], lines[2:]
    else:
      header, units = "", re.split(r"(?<=[.!?])\s+", " ".join(paragraph.split()))
    for unit in units:
      for span in _spans(unit):
        name = span.split(" ")[0]
        lever_like = re.fullmatch(r"(baseline|accum|zero[12][a-z0-9.-]*|offload[a-z0-9.-]*)", name)
        if not lever_like or name in LEVERS:
          continue
        assert name in arms, f"memory_levers.md: `{name}` is neither a lever nor an arm: {unit!r}"
        said = header.split("|")[1] if header else unit
        assert "arm" in said, f"`{name}` not said to be an arm: {unit!r}"
