"""The quickstart example runs as a user would run it and shows what the README promises."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quickstart_runs_and_matches_the_plain_optimizer():
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  out = subprocess.run(
      [sys.executable, ROOT / "examples" / "quickstart.py", "--steps", "2"],
      env=env, capture_output=True, text=True, timeout=300, check=True,
  ).stdout
  assert "losses bit-identical: True" in out
  assert "(0.125x, ideal 1/8 = 0.125)" in out
  assert "replicated: no dimension divisible by the data-axis size" in out


def test_the_readme_quick_start_runs_when_pasted_into_a_file(tmp_path):
  readme = (ROOT / "README.md").read_text()
  section = readme[readme.index("## Quick start"):]
  start = section.index("```python\n") + len("```python\n")
  code = section[start:section.index("\n```", start)]
  script = tmp_path / "quick_start.py"
  script.write_text(code + "\n")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  out = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=300,
                       cwd=tmp_path)
  assert out.returncode == 0, out.stderr[-3000:]
  losses = eval(out.stdout.splitlines()[0])  # the printed list of three losses
  assert len(losses) == 3 and losses[2] < losses[0]
  assert "per device" in out.stdout, out.stdout[-2000:]  # the report
