"""Compiles the seed's MaxText arms (qwen3-0.6b on v6e:2x2) once and keeps each program's text, gzipped, under
docs/data/maxtext_qwen3_0p6b_v6e_seed/programs/ARM/, so a change to the step-time model re-walks kept text
instead of compiling again (6 to 13 minutes an arm on the project's machine). Each text is cut to what the
walk and the FLOP count read (:func:`kept_text`), checked to walk and count as the whole program did.

Run with the py312 venv, from the worktree, with the worktree first on the path:
  PYTHONPATH=.:planner nice /work/venvs/py312/bin/python scripts/seed_programs.py [ARM ...]
"""

from __future__ import annotations

import gzip
import json
import os
import re
import sys

# (arm, mesh axes, lever, MaxText's deferral of the data-parallel all-reduce)
ARMS = {
    "tensor4": ({"tensor": 4}, "baseline", True),
    "not_deferred_baseline": ({"data": 4}, "baseline", False),
    "not_deferred_zero1": ({"data": 4}, "zero1", False),
    "deferred_baseline": ({"data": 4}, "baseline", True),
    "deferred_zero1": ({"data": 4}, "zero1", True),
}
OUT = os.path.join("docs", "data", "maxtext_qwen3_0p6b_v6e_seed", "programs")
_FUSED = re.compile(r" fusion\(.*?calls=%([\w.\-]+)")
_NAME = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = ")
_KEPT_IN_FUSIONS = re.compile(r" (?:dot|convolution|all-reduce)\(")
_CONFIG = re.compile(r"backend_config=\{.*\}$")
_READ = re.compile(r'"(?:estimated_cycles|emitter|strategy)":"\w+"|\w+\{colors:\d+')


def _read_config(line: str) -> str:
  """A line's ``backend_config`` cut to what the walk reads: the compiler's cycles, and a collective's
  emitter, strategy and rings (``colors``)."""
  config = _CONFIG.search(line)
  if config is None:
    return line
  kept = [f'"debug":"{m}"' if "colors" in m else m for m in _READ.findall(config[0])]
  return line[:config.start()] + "backend_config={" + ",".join(kept) + "}"


def kept_text(hlo: str) -> str:
  """The program's text as kept: every line the walk and the FLOP count read. Inside a fused computation
  (whose cost its fusion's line carries) only its matmuls, its all-reduces (a fused reduce-scatter's groups),
  the lines they read and its root; no line's ``metadata``. Checked to walk and count as the whole text."""
  from nnx_zero1._src.hlo import INSTRUCTION
  fused = set(_FUSED.findall(hlo))
  out, body, inside = [], [], False

  def close() -> None:
    wanted = {a.strip().lstrip("%") for ln in body if _KEPT_IN_FUSIONS.search(ln)
              for a in INSTRUCTION.match(ln)["args"].split(",")}
    out.extend(ln for ln in body if _KEPT_IN_FUSIONS.search(ln) or ln.lstrip().startswith("ROOT ")
               or ((m := _NAME.match(ln)) and m[1] in wanted))

  for line in map(_read_config, re.sub(r", metadata=\{[^{}]*\}", "", hlo).splitlines()):
    header = re.match(r"^%([\w.\-]+) ", line)
    if header:
      inside = header[1] in fused
      out.append(line)
    elif inside and line.startswith("  "):
      body.append(line)
    else:
      if body:
        close()
        body.clear()
      inside = inside and not line.startswith("}")
      out.append(line)
  return "\n".join(out) + "\n"


def compile_arm(arm: str) -> None:
  """Compiles one arm and writes its programs (``KERNEL.hlo.txt.gz``) and ``runs.json`` (times per step)."""
  from nnx_zero1_plan.compilers import start_cpu_jax
  start_cpu_jax()  # before jax starts a backend: the TPU compiler only compiles here
  from nnx_zero1_plan.chips import CHIPS
  from nnx_zero1_plan.hlo_flops import dot_flops
  from nnx_zero1_plan.levers import LEVERS
  from nnx_zero1_plan.maxtext import compile_maxtext, config_overrides, mesh_axis_names, output_directory
  from nnx_zero1_plan.step_time import program_time, rates_for

  axes, lever, defer = ARMS[arm]
  with output_directory() as out:
    overrides = config_overrides(
        "qwen3-0.6b", "v6e:2x2", 4, axes, batch=8, seq_len=1024, ga=8, optimizer="adamw", param_dtype=None,
        compute_dtype=None, remat="none", known_axes=mesh_axis_names(), output_dir=out,
        overrides={"scan_layers": "false", "shard_mode": "explicit"})
    programs, _, figures, _ = compile_maxtext(lever, LEVERS[lever], overrides, defer)
  folder = os.path.join(OUT, arm)
  os.makedirs(folder, exist_ok=True)
  rates = rates_for(CHIPS["v6e"])
  for name, _, whole, _ in programs:  # each program's record (the whole text read once)
    text = kept_text(whole.text)
    assert program_time(text, rates) == program_time(whole, rates), name
    assert dot_flops(text) == dot_flops(whole), name
    with gzip.open(os.path.join(folder, f"{name}.hlo.txt.gz"), "wt", compresslevel=9) as f:
      f.write(text)
  with open(os.path.join(folder, "runs.json"), "w") as f:
    json.dump({"mesh": axes, "lever": lever, "maxtext_deferral": "auto" if defer else "off",
               "deferred_all_reduce": figures.maxtext_config.deferred_all_reduce if figures.maxtext_config
               else None, "runs": [[name, times] for name, _, _, times in programs],
               "compile_s": round(figures.compile_s or 0, 1)}, f, indent=1)
  print(f"{arm}: wrote {folder} in {figures.compile_s:.0f} s", flush=True)


if __name__ == "__main__":
  for a in sys.argv[1:] or list(ARMS):
    compile_arm(a)
