"""The public surface: what a user imports works, and matches flax where it stands in for it."""

import importlib
import importlib.util

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import nnx_zero1
from nnx_zero1 import Zero1Optimizer

PUBLIC_MODULES = ["nnx_zero1", "nnx_zero1.testing", "nnx_zero1.plan", "nnx_zero1.adapters.maxtext"]


@pytest.mark.parametrize("name", nnx_zero1.__all__)
def test_every_documented_name_is_reachable_as_an_attribute(name):
  assert getattr(nnx_zero1, name) is not None


def test_report_is_the_function_not_a_shadowed_module():
  # A submodule named like a function it exports would replace it on first import.
  importlib.import_module("nnx_zero1.testing")
  assert callable(nnx_zero1.report) and callable(nnx_zero1.bytes_per_device)
  assert nnx_zero1.bytes_per_device({"a": jnp.ones(4, jnp.float32)}) == 16


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_public_modules_export_only_what_they_define_publicly(module):
  mod = importlib.import_module(module)
  lazy = set() if importlib.util.find_spec("maxtext") else set(getattr(mod, "_LAZY", ()))  # need maxtext
  for name in set(getattr(mod, "__all__", [])) - lazy:
    assert not name.startswith("_") and hasattr(mod, name), (module, name)


def test_private_code_lives_under_underscored_paths():
  import pathlib

  package = pathlib.Path(nnx_zero1.__file__).parent
  public = {p.relative_to(package).as_posix() for p in package.rglob("*.py") if "_src" not in p.parts}
  # the benchmark lives in benchmarks/, outside the package; plan.py is the planner's command line
  assert public == {"__init__.py", "testing.py", "plan.py"}


def test_zero1_optimizer_sets_every_attribute_nnx_optimizer_sets():
  # If flax adds an attribute to nnx.Optimizer.__init__, Zero1Optimizer must set it too.
  mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
  with jax.set_mesh(mesh):
    model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    plain = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    ours = Zero1Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  missing = set(vars(plain)) - set(vars(ours))
  assert not missing, f"Zero1Optimizer does not set {sorted(missing)}"
  pure = lambda opt: jax.tree.structure(nnx.to_pure_dict(nnx.state(opt)))
  assert pure(plain) == pure(ours)


def test_the_tunix_adapter_without_tunix_says_which_extra_to_install():
  # A process where `tunix` does not import, as after `pip install ".[bench]"`.
  import subprocess
  import sys

  hide_tunix = (
      "import sys, importlib.abc\n"
      "class Hide(importlib.abc.MetaPathFinder):\n"
      "  def find_spec(self, name, path, target=None):\n"
      "    if name.split('.')[0] == 'tunix':\n"
      "      raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
      "sys.meta_path.insert(0, Hide())\n"
      "try:\n"
      "  from nnx_zero1.adapters.tunix import Zero1PeftTrainer\n"
      "except ModuleNotFoundError as e:\n"
      "  print(e)\n"
  )
  proc = subprocess.run([sys.executable, "-c", hide_tunix], capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.strip().splitlines() == [
      'nnx_zero1.adapters.tunix needs Tunix (tested: google-tunix 0.1.7): pip install "nnx-zero1[tunix]"'
  ]
