"""Every ``Zero1Error`` names its fix: what to pass, what to use instead, or where the docs say it.

Two checks. Statically, every ``Zero1Error(...)`` in the package and its adapters is read from the
source (a message built from a variable must build it from a fix, checked where it is defined).
At run time, a few refusals a newcomer meets first are raised for real and their messages read.
``tests/core/test_bad_inputs.py`` reads the message of each refusal it raises the same way.
"""

import ast
from pathlib import Path

import jax
import optax
import pytest
from flax import nnx

from nnx_zero1 import Zero1Error, Zero1Optimizer, report, zero1_sharding
from nnx_zero1._src import checkpoint, checks, mesh
from tests.support.helpers import MLP, names_a_fix

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted([*(ROOT / "nnx_zero1").rglob("*.py"), *(ROOT / "adapters").glob("*.py")])
# Messages whose fix is a named piece of text, each checked below where it is defined (``fix``: an
# argument, each caller's checked by test_bad_inputs' refusals).
FIX_PIECES = {"fix": None, "_FIX": mesh._FIX, "PLACE_MODEL": checks.PLACE_MODEL, "_GRADS": checks._GRADS,
              "_SAME_BUILD": checkpoint._SAME_BUILD}
# Functions whose refusals are reasons their one caller re-raises with the fix (checked there).
REASONS = {"declared_layout": "layout_plan.param_layouts"}


def _template(node: ast.expr) -> str:
  """The message's text as written: literal parts as they are, each formatted value as ``{source}``."""
  if isinstance(node, ast.Constant) and isinstance(node.value, str):
    return node.value
  if isinstance(node, ast.JoinedStr):
    parts = (v.value if isinstance(v, ast.FormattedValue) else v for v in node.values)
    return "".join(_template(part) for part in parts)
  if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
    return _template(node.left) + _template(node.right)
  return "{" + ast.unparse(node) + "}"


def refusals() -> list[tuple[str, str]]:
  """``(where, message template)`` for every ``Zero1Error(...)`` raised in the package and adapters."""
  found = []
  for path in SOURCES:
    for function in ast.walk(ast.parse(path.read_text())):
      if not isinstance(function, ast.FunctionDef) or function.name in REASONS:
        continue
      for node in ast.walk(function):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Zero1Error" and node.args:
          found.append((f"{path.relative_to(ROOT)}:{node.lineno}", _template(node.args[0])))
  return sorted(set(found))  # a nested function's refusals are walked with each enclosing one


def test_the_source_reader_finds_every_refusal():
  assert len(refusals()) >= 60  # (66 when this was written: a reader that found few would prove little)
  assert any("optax.flatten" in message for _, message in refusals())
  reasons = [line for line in (ROOT / "nnx_zero1" / "_src" / "layout_plan.py").read_text().splitlines()
             if "declared_layout(" in line]
  assert reasons, "the caller that re-raises declared_layout's reasons with their fix"


@pytest.mark.parametrize("where, message", refusals(), ids=[where for where, _ in refusals()])
def test_every_refusal_in_the_source_names_its_fix(where, message):
  pieces = [name for name in FIX_PIECES if "{" + name + "}" in message]
  assert names_a_fix(message) or pieces, f"{where}: no fix in {message!r}"


@pytest.mark.parametrize("name", [name for name, text in FIX_PIECES.items() if text is not None])
def test_each_named_fix_is_one(name):
  assert names_a_fix("; " + FIX_PIECES[name]), FIX_PIECES[name]


def test_the_fix_check_can_fail():
  assert not names_a_fix("none of the optimizer state can be tied to a parameter; mesh axes ('data',)")
  assert names_a_fix("so Zero-1 would split nothing; use optax.adamw(...) itself")


MESH = jax.make_mesh((8,), ("data",))


def _message(call) -> str:
  with pytest.raises(Zero1Error) as info:
    call()
  return str(info.value)


def _on_mesh():
  with jax.set_mesh(MESH):
    return MLP(nnx.Rngs(0))


@pytest.mark.parametrize("call", [
    lambda: Zero1Optimizer(_on_mesh(), optax.flatten(optax.adamw(1e-3))),
    lambda: Zero1Optimizer(MLP(nnx.Rngs(0)), optax.adamw(1e-3), MESH),
    lambda: Zero1Optimizer(MLP(nnx.Rngs(0)), optax.adamw(1e-3), strict=True),
    lambda: Zero1Optimizer(_on_mesh(), optax.adamw(1e-3), data_axis="batch"),
    lambda: Zero1Optimizer(_on_mesh(), optax.adamw(1e-3), wrt=nnx.BatchStat),
    lambda: Zero1Optimizer(_on_mesh(), optax.adamw(1e-3), jax.sharding.AbstractMesh((8,), ("data",))),
    lambda: report(nnx.Optimizer(MLP(nnx.Rngs(0)), optax.adamw(1e-3), wrt=nnx.Param)),
    lambda: zero1_sharding((4,), jax.NamedSharding(MESH, jax.P("data", None))),
], ids=["optax.flatten", "off the mesh", "strict, one device", "no data axis", "wrt selects nothing",
        "abstract mesh", "report of nnx.Optimizer", "spec longer than the shape"])
def test_the_first_refusals_a_newcomer_meets_name_their_fix(call):
  message = _message(call)
  assert names_a_fix(message), message


def test_flatten_says_what_to_use_instead():
  message = _message(lambda: Zero1Optimizer(_on_mesh(), optax.flatten(optax.adamw(1e-3))))
  assert "optax.adamw(...)" in message or "without optax.flatten" in message, message
