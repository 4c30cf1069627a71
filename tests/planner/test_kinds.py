"""The planner's kinds (pure, traced, compiled, orchestrates) checked, not described.

ARCHITECTURE.md's planner table is the map; these tests read it and every planner module's imports (``ast``,
those inside functions too) and fail where the code and the map part: a pure module that reaches jax or a
module of another kind, a module the map leaves out, ``run`` imported by anything but the entry points, a
private name of the optimizer imported from anywhere but the module made for the planner, a benchmark that
imports a planner name ``__all__`` does not declare, a platform's name compared where the platform's record
(``inputs.Backend``) names the fact, a model kind's name where its record (``inputs.ModelKind``) does. No
compiler needed (lane 1).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLANNER = ROOT / "planner" / "nnx_zero1_plan"
PACKAGE = "nnx_zero1_plan"

# Packages that import jax when imported (the optimizer's own package does, through nnx_zero1/__init__.py).
REACHES_JAX = {"jax", "jaxlib", "flax", "optax", "orbax", "tunix", "maxtext", "libtpu", "nnx_zero1"}

# The imports inside a pure module's functions that start the planning process's work, where that process
# is the caller's own (the command line) or the caller asks for the compiler itself; each is run only when
# called, never when the module is imported. (module, function) -> what it may import.
ENTRY_POINTS = {
    ("cli", "main"): {f"{PACKAGE}.run"},  # the command line's process is the planning process
    ("__init__", "compile_only_devices"): {f"{PACKAGE}.targets"},  # a user asks for the compiler's devices
    ("compilers", "keep_jax_on_cpu"): {"jax"},  # starts jax, in the planning process only
}
# The child processes' one entry point (python -m nnx_zero1_plan.worker): it imports the orchestrator at its
# top, and nothing imports it.
WORKER = "worker"

# The optimizer's private names reach the planner through one module made for it; MaxText's engine is read
# through the adapters' own internals (MaxText's, not the optimizer's).
FOR_PLANNER = "nnx_zero1._src.companion"
OTHER_PRIVATE = {("maxtext", "nnx_zero1.adapters._compat")}


def _module_names() -> list[str]:
  return sorted(p.stem for p in PLANNER.glob("*.py"))


def _imports(module: str, types: bool = False) -> list[tuple[str | None, str]]:
  """``(outermost enclosing function or None, imported module)`` for every import in ``module`` that runs; a
  name imported from the package is its submodule where there is one. An import under ``if TYPE_CHECKING:``
  names a type for the type checker and never runs: no dependency, unless ``types`` (the import graph's
  floors count it: a module that names another's type stands on it)."""
  found: list[tuple[str | None, str]] = []
  modules = set(_module_names())

  def visit(node: ast.AST, function: str | None) -> None:
    for child in ast.iter_child_nodes(node):
      if isinstance(child, ast.If) and ast.unparse(child.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
        visit(ast.Module(body=child.orelse + (child.body if types else []), type_ignores=[]), function)
        continue
      inside = function
      if function is None and isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
        inside = child.name
      if isinstance(child, ast.Import):
        found.extend((inside, alias.name) for alias in child.names)
      elif isinstance(child, ast.ImportFrom) and child.module:
        if child.module == PACKAGE:
          found.extend((inside, f"{PACKAGE}.{a.name}" if a.name in modules else PACKAGE) for a in child.names)
        else:
          found.append((inside, child.module))
      visit(child, inside)

  visit(ast.parse((PLANNER / f"{module}.py").read_text()), None)
  return found


def _planner_module(name: str) -> str | None:
  """``nnx_zero1_plan.x.y`` as the planner's module ``x`` (the package itself: ``__init__``)."""
  if name == PACKAGE:
    return "__init__"
  return name.split(".")[1] if name.startswith(f"{PACKAGE}.") else None


def documented_kinds(text: str) -> dict[str, str]:
  """The kind of each module in ARCHITECTURE.md's planner table: the kind column (its first word, carried
  down empty cells), then the module names.

  Example::

    >>> documented_kinds("## The planner: x\\n| kind | module | what |\\n|---|---|---|\\n"
    ...                  "| pure: never jax | `a.py`, `b.py` | ... |\\n| | `c.py` | ... |\\n"
    ...                  "| compiled | `d.py` | ... |\\n")
    {'a': 'pure', 'b': 'pure', 'c': 'pure', 'd': 'compiled'}
  """
  section = text.split("## The planner:", 1)[1].split("\n## ", 1)[0]
  kinds: dict[str, str] = {}
  kind = None
  for line in section.splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if not line.startswith("|") or len(cells) < 2 or cells[0] == "kind" or re.fullmatch(r"[-| ]+", line):
      continue
    if cells[0]:
      kind = re.match(r"\w+", cells[0]).group()  # type: ignore[union-attr]
    for name in re.findall(r"`([\w]+)\.py`", cells[1]):
      assert name not in kinds, f"{name}.py is in ARCHITECTURE.md's planner table twice"
      kinds[name] = kind  # type: ignore[assignment]
  return kinds


ARCHITECTURE = (ROOT / "ARCHITECTURE.md").read_text()
KINDS = documented_kinds(ARCHITECTURE)


def test_the_map_names_every_planner_module_once_and_only_modules_that_exist():
  assert set(KINDS.values()) == {"pure", "traced", "compiled", "orchestrates"}
  assert sorted(KINDS) == _module_names()


@pytest.mark.parametrize("module", sorted(m for m, k in KINDS.items() if k == "pure"))
def test_a_pure_module_reaches_neither_jax_nor_a_module_of_another_kind(module):
  # Inside functions too: a pure module's function runs in the caller's process, which never imports jax
  # (plan() must not), except the entry points above.
  wrong = []
  for function, name in _imports(module):
    if name in ENTRY_POINTS.get((module, function), set()):
      continue
    planner = _planner_module(name)
    if name.split(".")[0] in REACHES_JAX or (planner is not None and KINDS.get(planner) != "pure"):
      wrong.append(f"{name} (in {function or 'the module'})")
  assert not wrong, f"{module}.py is pure in ARCHITECTURE.md and imports {', '.join(wrong)}"


@pytest.mark.parametrize("module", sorted(m for m, k in KINDS.items() if k == "traced"))
def test_a_traced_module_reaches_no_compiling_module(module):
  # A traced module builds shapes and compiles nothing: what compiles (and loads a compiler) is a module of
  # the compiled kind, which a traced one never imports, inside its functions neither.
  wrong = [f"{name} (in {function or 'the module'})" for function, name in _imports(module)
           if KINDS.get(_planner_module(name) or "") in ("compiled", "orchestrates")]
  assert not wrong, f"{module}.py is traced in ARCHITECTURE.md and imports {', '.join(wrong)}"


@pytest.mark.parametrize("module", _module_names())
def test_only_the_entry_points_import_the_orchestrator(module):
  for function, name in _imports(module):
    if _planner_module(name) in {m for m, k in KINDS.items() if k == "orchestrates"} and module != "run":
      assert (module, function) in ENTRY_POINTS or module == WORKER, f"{module}.{function} imports {name}"
    assert _planner_module(name) != WORKER, f"{module}.py imports the worker, which nothing imports"


def _import_graph() -> dict[str, set[str]]:
  """Each planner module's planner imports, every one counted: at the top, inside functions, for types."""
  return {m: {p for _, name in _imports(m, types=True) if (p := _planner_module(name)) and p != m}
          for m in _module_names()}


def floors(graph: dict[str, set[str]]) -> dict[str, int]:
  """Each module's floor: 1 for one that imports no other, else one above the highest it imports.

  Raises:
    AssertionError: modules import each other in a loop (named).

  Example::

    >>> floors({"a": set(), "b": {"a"}, "c": {"a", "b"}})
    {'a': 1, 'b': 2, 'c': 3}
  """
  found: dict[str, int] = {}

  def floor(module: str, path: tuple[str, ...]) -> int:
    assert module not in path, f"an import loop: {' -> '.join((*path[path.index(module):], module))}"
    if module not in found:
      found[module] = 1 + max((floor(m, (*path, module)) for m in graph[module]), default=0)
    return found[module]

  for module in graph:
    floor(module, ())
  return found


def test_no_planner_module_imports_another_in_a_loop_and_the_house_has_at_most_11_floors():
  built = floors(_import_graph())
  assert max(built.values()) <= 11, sorted(built.items(), key=lambda kv: kv[1])
  # ARCHITECTURE.md's floor plan is the code's.
  drawn = {name: int(floor) for floor, names in re.findall(r"^- floor (\d+): (.+)$", ARCHITECTURE, re.M)
           for name in re.findall(r"`(\w+)`", names)}
  assert drawn == built, {m: (drawn.get(m), built.get(m)) for m in set(drawn) | set(built)
                          if drawn.get(m) != built.get(m)}


@pytest.mark.parametrize("module", _module_names())
def test_the_optimizers_private_names_come_from_the_module_made_for_the_planner(module):
  for _, name in _imports(module):
    private = name.startswith("nnx_zero1.") and any(part.startswith("_") for part in name.split("."))
    if private and name != FOR_PLANNER:
      assert (module, name) in OTHER_PRIVATE, f"{module}.py imports {name}: add the name to {FOR_PLANNER}"


def test_each_optimizer_of_the_menu_is_the_code_the_recommendation_prints(monkeypatch):
  # steps.OPTIMIZERS and request.OPTIMIZER_CODE are built from one table: each factory, called on a stand-in
  # for optax that records the call, is the printed code's call (read by ast, never run).
  from nnx_zero1_plan import steps
  from nnx_zero1_plan.request import OPTIMIZER_CODE

  class Recorder:
    def __getattr__(self, function):
      return lambda *args, **kwargs: (function, args, kwargs)

  monkeypatch.setattr(steps, "optax", Recorder())
  assert set(steps.OPTIMIZERS) == set(OPTIMIZER_CODE)
  for name, code in OPTIMIZER_CODE.items():
    call = ast.parse(code, mode="eval").body
    assert isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
    assert ast.unparse(call.func.value) == "optax"
    printed = (call.func.attr, tuple(ast.literal_eval(a) for a in call.args),
               {k.arg: ast.literal_eval(k.value) for k in call.keywords})
    assert steps.OPTIMIZERS[name]() == printed, name


def test_every_public_name_resolves_and_the_package_alone_imports_no_jax():
  import subprocess
  import sys

  import nnx_zero1_plan

  assert all(getattr(nnx_zero1_plan, name) is not None for name in nnx_zero1_plan.__all__)
  # A public name a module also bears would become that module once anything imports it.
  assert not set(nnx_zero1_plan.__all__) & set(_module_names())
  # The compiled steps' names are imported on first use, so plan()'s caller stays without jax.
  code = "import sys, nnx_zero1_plan; print('jax' in sys.modules)"
  assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        check=True).stdout.strip() == "False"


def test_the_benchmarks_use_the_planners_public_names_only_each_documented():
  """benchmarks/ is outside the planner: it imports the names ``nnx_zero1_plan.__all__`` declares, each in
  docs/planner.md's "Your own loop" table, and no planner module by its path."""
  import nnx_zero1_plan

  section = (ROOT / "docs" / "planner.md").read_text().split("## Your own loop", 1)[1].split("\n## ", 1)[0]
  for path in sorted((ROOT / "benchmarks").glob("*.py")):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        assert not [a.name for a in node.names if a.name.startswith(f"{PACKAGE}.")], path.name
      elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == PACKAGE:
        assert node.module == PACKAGE, f"benchmarks/{path.name} imports {node.module}: use the public names"
        for alias in node.names:
          assert alias.name in nnx_zero1_plan.__all__, f"benchmarks/{path.name} imports {alias.name}"
          assert f"`{alias.name}" in section, f"{alias.name} is not in docs/planner.md's Your own loop"


# Where a platform's name is still compared: the one module that names jax's own devices as a topology does.
NAMES_PLATFORMS = {"local_chips"}


def test_a_plan_reads_what_differs_by_platform_from_its_backend_not_by_the_platforms_name():
  named = {module: [ast.unparse(node) for node in ast.walk(ast.parse((PLANNER / f"{module}.py").read_text()))
                    if isinstance(node, ast.Compare)
                    and any(isinstance(c, ast.Constant) and c.value in ("tpu", "cuda", "gpu")
                            for c in (node.left, *node.comparators))]
           for module in sorted(set(_module_names()) - NAMES_PLATFORMS)}
  assert not any(named.values()), {m: c for m, c in named.items() if c}  # read a fact of inputs.Backend


def test_a_plan_reads_what_differs_by_model_kind_from_its_kind_not_by_the_kinds_name():
  kinds = ("tunix", "maxtext", "tunix:", "maxtext:")
  is_kind = lambda node: isinstance(node, ast.Constant) and node.value in kinds

  def asks_the_name(node: ast.AST) -> bool:
    if isinstance(node, ast.Compare):
      return any(map(is_kind, (node.left, *node.comparators)))
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("startswith", "endswith") and any(map(is_kind, node.args)))

  named = {module: [ast.unparse(node) for node in ast.walk(ast.parse((PLANNER / f"{module}.py").read_text()))
                    if asks_the_name(node)] for module in _module_names()}
  assert not any(named.values()), {m: c for m, c in named.items() if c}  # read a fact of inputs.ModelKind
