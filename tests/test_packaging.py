"""The built (non-editable) wheel ships the plugin only: the adapters inside the package (not as
`adapters`), no planner (its own distribution, planner/), no benchmark harness, no reference engine."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _source_copy(tmp_path: Path) -> Path:
  """What a wheel is built from, copied: a build in the checkout writes its build/ and *.egg-info,
  which another test worker may be building from at the same time."""
  source = tmp_path / "source"
  for folder in ("nnx_zero1", "adapters"):
    shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
  for name in ("pyproject.toml", "README.md", "LICENSE"):
    shutil.copy(ROOT / name, source / name)
  return source


def test_wheel_installs_adapters_as_nnx_zero1_adapters(tmp_path):
  subprocess.run(
      [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path,
       _source_copy(tmp_path)],
      check=True,
      cwd=tmp_path,
  )
  (wheel,) = tmp_path.glob("nnx_zero1-*.whl")
  names = zipfile.ZipFile(wheel).namelist()
  assert "nnx_zero1/adapters/tunix.py" in names
  assert "nnx_zero1/adapters/maxtext.py" in names
  assert "nnx_zero1/adapters/_maxtext_engine.py" in names
  assert "nnx_zero1/py.typed" in names
  assert not any(n.startswith(("adapters/", "benchmarks/", "tests/")) for n in names)
  modules = [n for n in names if n.endswith(".py")]
  assert not [n for n in modules if {"bench", "engine"} & set(Path(n).with_suffix("").parts)], modules
  assert not [n for n in modules if "planner" in n or n.startswith("nnx_zero1_plan/")], modules

  site = tmp_path / "site"
  zipfile.ZipFile(wheel).extractall(site)
  probe = (
      "import nnx_zero1.adapters.tunix as t, nnx_zero1.adapters.maxtext as m, nnx_zero1; "
      f"assert t.__file__.startswith({str(site)!r}), t.__file__; print(nnx_zero1.__file__)"
  )
  out = subprocess.run(
      [sys.executable, "-c", probe], env={"PYTHONPATH": str(site), "JAX_PLATFORMS": "cpu"},
      cwd=tmp_path, capture_output=True, text=True, check=True,
  )
  assert out.stdout.strip().startswith(str(site))

  # Importing the plugin changes no environment variable jax did not (Tunix, imported by its adapter,
  # sets one of its own); without the planner installed, its command says how to install it and exits 2.
  probe = ("import os, jax; before = dict(os.environ); "
           "import nnx_zero1, nnx_zero1.testing, nnx_zero1.adapters.maxtext; "
           "changed = {k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k)}; "
           "assert not changed, changed")
  env = {"PYTHONPATH": str(site), "JAX_PLATFORMS": "cpu"}
  out = subprocess.run([sys.executable, "-c", probe], env=env, cwd=tmp_path, capture_output=True, text=True)
  assert out.returncode == 0, out.stderr[-2000:]
  absent = ("import runpy, sys; sys.modules['nnx_zero1_plan'] = None; sys.argv[1:] = ['--help']; "
            "runpy.run_module('nnx_zero1.plan', run_name='__main__')")  # as if only this wheel were installed
  out = subprocess.run([sys.executable, "-c", absent], env=env, cwd=tmp_path, capture_output=True, text=True)
  assert out.returncode == 2 and "pip install ./planner" in out.stderr, (out.returncode, out.stderr[-2000:])


def test_from_a_source_checkout_root_the_adapters_import_and_the_bench_starts(tmp_path):
  """Python run from the repository root imports the source nnx_zero1/ (which has no adapters/)
  ahead of any installed copy; nnx_zero1.adapters must still import, from the checkout."""
  checkout = tmp_path / "checkout"
  for folder in ("nnx_zero1", "adapters", "benchmarks", "tests"):
    shutil.copytree(ROOT / folder, checkout / folder, ignore=shutil.ignore_patterns("__pycache__"))
  probe = (
      "import nnx_zero1.adapters as a; from nnx_zero1.adapters.maxtext import Zero1EngineMixin; "
      "from tests.support.reference_engine import Zero1Engine; "
      "from nnx_zero1.adapters.tunix import Zero1PeftTrainer; print(a.__file__)"
  )
  env = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
  out = subprocess.run([sys.executable, "-c", probe], env=env, cwd=checkout, capture_output=True, text=True)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip() == str(checkout / "adapters" / "__init__.py")
  bench = subprocess.run([sys.executable, "-m", "benchmarks.bench", "--help"], env=env, cwd=checkout,
                         capture_output=True, text=True)
  assert bench.returncode == 0 and "--quick" in bench.stdout, bench.stderr[-2000:]
