"""The README's set-up commands, run as a newcomer runs them: in a fresh virtual environment, from
the repository root (the benchmark harness, ``benchmarks/``, is not in the wheel), and from elsewhere
Python imports what pip installed.

The venv sees this environment's packages (a ``.pth`` naming its site-packages: ``--system-site-packages``
would show the base interpreter's, not this virtual environment's, and pip would install the whole
stack again) so pip finds the dependencies installed; the package itself is installed into the venv by
the README's own ``pip install`` and shadows any other copy. The benchmark command runs as written plus
flags that shorten it (one dp, one GA, one step, two arms), so the test takes a minute, not ten.
The test command needs no test here: CI's first lane runs it verbatim in a fresh venv from the
repository root (checked below).
"""

import json
import os
import re
import shlex
import site
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHORTER = "--dp 2 --ga 1 --steps 1 --warmup 0 --arms baseline,zero1 --no-shapes --no-progress"


def _readme_commands() -> list[str]:
  """The commands of the README's bash blocks, in order (the two set-up commands come first)."""
  blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
  return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
  path = tmp_path_factory.mktemp("readme") / "venv"
  subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
  own = subprocess.run([path / "bin" / "python", "-c", "import site; print(site.getsitepackages()[0])"],
                       check=True, capture_output=True, text=True).stdout.strip()
  # Appended after the venv's own site-packages, so what the README's pip installs shadows them.
  (Path(own) / "_this_environment.pth").write_text("\n".join(site.getsitepackages()) + "\n")
  return path


def _run(command: str, venv: Path, cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS", "VIRTUAL_ENV")}
  env["PATH"] = f"{venv / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}"
  env["VIRTUAL_ENV"] = str(venv)
  return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True,
                        timeout=timeout)


def test_the_two_set_up_commands_come_first_and_ci_runs_the_second_verbatim():
  main, tests = _readme_commands()[:2]
  assert main == 'pip install ".[bench]" ./planner && python -m benchmarks.bench --quick'
  assert tests == 'pip install -e ".[tunix,test]" -e ./planner && python -m pytest'
  ci = (ROOT / ".ci" / "run").read_text()
  assert re.search(r"^pip install -e \"\.\[tunix,test\]\" -e \./planner && python -m pytest$", ci, flags=re.M)


def test_the_main_command_runs_from_the_root_and_elsewhere_the_installed_copy_imports(venv, tmp_path):
  install, bench = (part.strip() for part in _readme_commands()[0].split("&&"))
  done = _run(f"{install} -q", venv, ROOT)
  assert done.returncode == 0, done.stderr[-3000:]
  where = "import nnx_zero1, nnx_zero1.adapters.maxtext as m; print(nnx_zero1.__file__, m.__file__)"
  out = tmp_path / "out"
  done = _run(f"{bench} {SHORTER} --out {shlex.quote(str(out))}", venv, ROOT)
  assert done.returncode == 0, done.stderr[-3000:]
  rows = json.loads((out / "bench.json").read_text())["rows"]
  assert {r["arm"] for r in rows} == {"baseline", "zero1"}
  assert (out / "memory.png").read_bytes().startswith(b"\x89PNG")
  for cwd, home in ((ROOT, ROOT), (tmp_path, venv)):
    # From the root Python imports the checkout (its adapters/ registered); elsewhere, the venv's copy.
    files = _run(f"python -c {shlex.quote(where)}", venv, cwd).stdout.split()
    assert len(files) == 2 and all(f.startswith(str(home)) for f in files), files
