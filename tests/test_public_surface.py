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

PUBLIC_MODULES = ["nnx_zero1", "nnx_zero1.testing", "nnx_zero1.adapters.maxtext"]


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
  assert public == {"__init__.py", "testing.py"}  # the benchmark lives in benchmarks/, outside the package


def test_zero1_optimizer_sets_every_attribute_nnx_optimizer_sets():
  # If flax adds an attribute to nnx.Optimizer.__init__, Zero1Optimizer must set it too.
  mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
  with jax.set_mesh(mesh):
    model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    plain = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    ours = Zero1Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  missing = set(vars(plain)) - set(vars(ours))
  assert not missing, f"Zero1Optimizer does not set {sorted(missing)}"
  pure = lambda opt: jax.tree.structure(nnx.to_pure_dict(nnx.state(opt)))  # noqa: E731
  assert pure(plain) == pure(ours)
