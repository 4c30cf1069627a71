"""docs/getting_started.md's refused optimizer, held to the code: the Zero1Error it quotes is what
``Zero1Optimizer`` raises for ``optax.flatten(optax.adamw(1e-3))`` on that page's model and mesh, word for
word."""

import re
from pathlib import Path

import jax
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType

from nnx_zero1 import Zero1Error, Zero1Optimizer
from tests.support.helpers import assert_trees_equal, pure

PAGE = Path(__file__).resolve().parents[1] / "docs" / "getting_started.md"


def test_the_quoted_refusal_of_a_flattened_optimizer_is_what_zero1_raises():
  quoted = [line for block in re.findall(r"```text\n(.*?)```", PAGE.read_text(), flags=re.S)
            for line in block.splitlines() if "Zero1Error: " in line]
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  with jax.set_mesh(mesh):
    model = nnx.Sequential(nnx.Linear(16, 64, rngs=nnx.Rngs(0)), nnx.relu,
                           nnx.Linear(64, 16, rngs=nnx.Rngs(1)))
    before = pure(model)
    with pytest.raises(Zero1Error) as raised:
      Zero1Optimizer(model, optax.flatten(optax.adamw(1e-3)))
  assert quoted == [f"{type(raised.value).__module__}.{type(raised.value).__name__}: {raised.value}"]
  assert_trees_equal(model, before)
