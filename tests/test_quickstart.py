"""The quickstart example runs as a user would run it and shows what the README promises."""

import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_zero1 import Zero1Optimizer

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


# Every jax.make_mesh call in the README and the docs (one level of parentheses inside its arguments).
MESH_CALL = re.compile(r"jax\.make_mesh\((?:[^()]|\([^()]*\))*\)")
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


class EmbeddingModel(nnx.Module):
  """The models people train start with a lookup: on an Explicit mesh nnx.Embed's needs an out_sharding."""

  def __init__(self, rngs: nnx.Rngs):
    self.embed, self.out = nnx.Embed(64, 16, rngs=rngs), nnx.Linear(16, 64, rngs=rngs)

  def __call__(self, ids):
    return self.out(self.embed(ids))


def docs_meshes() -> list[tuple[str, str]]:
  return [(path.name, call) for path in DOCS for call in MESH_CALL.findall(path.read_text())]


def test_the_probe_finds_the_quick_start_mesh():
  assert ("README.md", 'jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))') in docs_meshes()


@pytest.mark.parametrize("where, call", docs_meshes())
def test_every_docs_mesh_trains_an_embedding_model(where, call):
  mesh = eval(call, {"jax": jax, "AxisType": AxisType, "dp": 8, "devices": jax.devices()})
  if "data" not in mesh.axis_names:
    pytest.skip(f"{call}: a refusal's example (no data axis)")
  with jax.set_mesh(mesh):
    model = EmbeddingModel(nnx.Rngs(0))
    optimizer = Zero1Optimizer(model, optax.adamw(1e-3))

  @nnx.jit
  def step(model, optimizer, ids):
    loss, grads = nnx.value_and_grad(
        lambda m: optax.softmax_cross_entropy_with_integer_labels(m(ids[:, :-1]), ids[:, 1:]).mean())(model)
    optimizer.update(model, grads)
    return loss

  ids = jax.device_put(np.arange(16 * 9).reshape(16, 9) % 64, NamedSharding(mesh, P("data")))
  with jax.set_mesh(mesh):
    assert np.isfinite(float(step(model, optimizer, ids))), (where, call)


def test_an_explicit_mesh_is_what_the_probe_refuses():
  """The failure the docs' meshes avoid: jax.make_mesh's default (Explicit axes) and an nnx.Embed lookup."""
  with pytest.raises(Exception, match="out_sharding"):
    test_every_docs_mesh_trains_an_embedding_model("-", 'jax.make_mesh((8,), ("data",), '
                                                   'axis_types=(AxisType.Explicit,))')
