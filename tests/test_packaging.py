"""The built (non-editable) wheel ships the adapters inside the package, not as `adapters`."""

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_installs_adapters_as_nnx_zero1_adapters(tmp_path):
  subprocess.run(
      [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path, ROOT],
      check=True,
      cwd=tmp_path,
  )
  (wheel,) = tmp_path.glob("nnx_zero1-*.whl")
  names = zipfile.ZipFile(wheel).namelist()
  assert "nnx_zero1/adapters/tunix.py" in names
  assert "nnx_zero1/adapters/maxtext.py" in names
  assert "nnx_zero1/adapters/_maxtext_engine.py" in names
  assert "nnx_zero1/py.typed" in names
  assert "nnx_zero1/bench/__main__.py" in names
  assert not any(n.startswith("adapters/") for n in names)

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
