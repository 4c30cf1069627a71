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
