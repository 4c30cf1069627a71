"""Whether the planner still prints and writes every plan as before a change to its code.

``render OUT`` writes, for each plan.json kept under docs/data, what today's code prints (``stdout.txt``),
writes (``plan.json``, ``plan.md``) and recommends again from its rows, into ``OUT/<its folder>``.
``compile OUT [NAME ...]`` runs a few small plans with the real compilers (TPU, GPU, a global batch, a search,
a pod, a way out, a MaxText and a Tunix model) into ``OUT/<name>``, compile seconds left out. Run both before
and after the change and compare the folders with ``diff -r -x '*.log'``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
TOY = "tests.support.planner_toys:tiny_lm"
BF16 = ["--model", TOY + "_bf16"]
SMALL = ["--batch", "8", "--seq-len", "16"]


def _maxtext_toy() -> list[str]:
  try:
    from tests.support.maxtext_toys import TINY
  except ImportError:  # without MaxText
    return []
  mesh = ("model_name", "run_name", "per_device_batch_size", "max_target_length", "ici_data_parallelism",
          "ici_fsdp_parallelism", "opt_type", "base_output_directory")
  return [f"{k}={v}" for k, v in TINY.items() if k not in mesh]


COMPILES = {
    "tpu": ["--model", TOY, "--topology", "v6e:2x2", "--steps", "one,split"],
    "tpu_estimate": ["--model", TOY, "--topology", "v6e:2x2", "--steps", "one", "--estimate"],
    "global_batch": ["--model", TOY, "--topology", "v5e:2x2", "--global-batch", "32", "--levers", "zero1",
                     "--steps", "one"],
    "gpu": ["--model", TOY, "--topology", "h100:8", "--steps", "one,split"],
    "gpu_bf16": [*BF16, "--topology", "h100:8", "--steps", "one"],
    "gpu_one": [*BF16, "--topology", "h200:1", "--steps", "one"],
    "gpu_search": ["--model", TOY, "--topology", "h100:8", "--steps", "one", "--search", "--margin", "0.999"],
    "way_out": ["--model", TOY, "--topology", "h100:8", "--batch", "64", "--seq-len", "256", "--steps", "one",
                "--margin", "0.9989"],
    "pod": ["--model", TOY, "--topology", "v5e:2x4", "--slices", "2", "--steps", "one"],
    "maxtext": ["--model", "maxtext:default", "--topology", "v6e:2x2", *SMALL, "--ga", "2", "--levers",
                "baseline,zero1,offload", *_maxtext_toy()],
    "tunix": ["--model", "tunix:qwen3_0p6b", "--topology", "v5e:2x4", *SMALL, "--steps", "one",
              "--param-dtype", "bfloat16", "--compute-dtype", "bfloat16"],
}
_VOLATILE = re.compile(r'"(compile_s|search_compile_s|wall_s|seconds|compile_seconds)": [\d.e+-]+')


def render(out: pathlib.Path) -> None:
  for kept in sorted(ROOT.glob("docs/data/**/plan.json")):
    _render_one(kept, out / kept.parent.relative_to(ROOT / "docs/data"))


def _render_one(kept: pathlib.Path, folder: pathlib.Path) -> None:
  from nnx_zero1_plan.plan_md import markdown
  from nnx_zero1_plan.recommend import recommend
  from nnx_zero1_plan.result import Plan

  folder.mkdir(parents=True, exist_ok=True)
  plan = Plan.from_json(json.loads(kept.read_text()))
  again = recommend(plan.rows, plan.meta.request, activation_sharding=plan.meta.activation_sharding,
                    step=plan.recommendation.step if plan.recommendation else None)
  (folder / "stdout.txt").write_text(str(plan))
  (folder / "plan.json").write_text(json.dumps(plan.to_json(), indent=1))
  md = markdown(plan.meta.to_json(), plan.rows, plan.next_steps, plan._lines_under())
  (folder / "plan.md").write_text(md)
  (folder / "recommended.txt").write_text(str(dataclasses.replace(plan, recommendation=again)))


def compile_plans(out: pathlib.Path, names: list[str]) -> None:
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  for name in names or COMPILES:
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    run = subprocess.run([sys.executable, "-m", "nnx_zero1.plan", *COMPILES[name], "--out", str(folder)],
                         cwd=ROOT, env=env, capture_output=True, text=True)
    failed = run.stderr.splitlines()[-3:] if run.returncode else []
    (folder / "exit.txt").write_text("\n".join([str(run.returncode), *failed]))
    (folder / "stdout.log").write_text(run.stdout)  # its compile seconds vary: compared as rendered/
    written = folder / "plan.json"
    if written.exists():
      written.write_text(_VOLATILE.sub(r'"\1": 0', written.read_text()))
      (folder / "plan.md").rename(folder / "plan_md.log")
      _render_one(written, folder / "rendered")
    print(name, run.returncode, flush=True)


if __name__ == "__main__":
  what, where, *only = sys.argv[1:]
  if what == "render":
    render(pathlib.Path(where))
  else:
    compile_plans(pathlib.Path(where), only)
