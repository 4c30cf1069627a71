"""Running ``python -m nnx_zero1.plan`` with the real compilers in a child process (CI lane 2): which
compilers this environment has, the planner's toy model, and a plan's plan.json."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

from nnx_zero1_plan import compilers

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
HAS_GPU_COMPILER = importlib.util.find_spec("jax_cuda13_plugin") is not None
HAS_MAXTEXT = importlib.util.find_spec("maxtext") is not None
TOYS = "tests.support.planner_toys"  # the planner's toy models, by their module's name
TOY = ["--model", f"{TOYS}:tiny_lm", "--batch", "8", "--seq-len", "64", "--levers", "baseline,zero1"]


def planner_env() -> dict:
  """This process's environment without what the planner sets for itself, nor the test's virtual devices."""
  env = {k: v for k, v in os.environ.items() if k not in compilers.ENV}
  env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
  return env


def run_plan(tmp_path, *args, toy=TOY) -> dict:
  """``python -m nnx_zero1.plan`` on the toy model (``args`` after ``toy``, :data:`TOY` by default, override
  it); plan.json."""
  proc = subprocess.run([sys.executable, "-m", "nnx_zero1.plan", *toy, *args, "--out", str(tmp_path)],
                        env=planner_env(), capture_output=True, text=True, timeout=400)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads((tmp_path / "plan.json").read_text())
  assert (tmp_path / "plan.md").read_text().startswith("# Will it fit?")
  return result
