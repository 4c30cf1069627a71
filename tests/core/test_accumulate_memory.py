"""What ``value_and_grad_accumulated`` holds in device memory: no more than the one-program step with one
micro-batch, one accumulator's bytes with several.

XLA's CPU backend schedules the programs into the same temporaries either way, so the CPU tests read the
program: each gradient is held whole (an optimization barrier) on its own, never all of them together,
which kept a second whole copy of the gradients alive. The TPU compiler's own figures are read where
libtpu is installed (CI lane 2).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest

from nnx_zero1 import Zero1Optimizer
from tests.support.accumulate import MESH, accumulated, batch_on_mesh, build, params, token_batches
from tests.support.compiled_plans import HAS_LIBTPU, planner_env


def barrier_operands(text: str) -> list[int]:
  """How many operands each ``optimization_barrier`` of a StableHLO module holds together."""
  return [len(m.group(1).split(",")) for m in re.finditer(r"stablehlo\.optimization_barrier ([^:]+):", text)]


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_each_gradient_is_held_whole_on_its_own(micro_batches):
  model, opt = build(Zero1Optimizer, optax.adamw(1e-3))
  batch = batch_on_mesh(token_batches(1)[0])
  with jax.set_mesh(MESH):
    text = accumulated.lower(model, opt, batch, micro_batches=micro_batches).as_text()
  held = barrier_operands(text)
  leaves = len(jax.tree.leaves(params(model)))
  # One barrier per gradient (the bits of a tied embedding's scatter-add stay the engine's), one for
  # the micro-batch count; none holds two gradients, which would keep them all alive together.
  assert held.count(1) >= leaves + 1 and max(held) == 1, held


def test_probe_sees_a_barrier_over_every_gradient():
  """The probe fails on the layout it guards against: one barrier over the whole gradient tree."""
  text = jax.jit(lambda a, b: jax.lax.optimization_barrier((a, b))).lower(np.ones(2), np.ones(3)).as_text()
  assert barrier_operands(text) == [2]


@pytest.mark.skipif(not HAS_LIBTPU, reason="needs libtpu: ./planner[aot], Python >= 3.12 (CI lane 2)")
def test_tpu_compiler_temporaries_one_micro_batch_as_one_program_two_add_one_accumulator():
  from nnx_zero1_plan import compilers

  env = compilers.planning_environment(planner_env())
  done = subprocess.run([sys.executable, "-m", "tests.support.accumulate_memory"], env=env,
                        capture_output=True, text=True, timeout=600, check=True)
  got = json.loads(done.stdout.strip().splitlines()[-1])
  # Measured (libtpu 0.0.50.1): one program 194.1 MiB, one micro-batch 178.2, two 248.8, parameters 192.0.
  # A barrier over all gradients gave 250.8 and 411.5 (two copies of the gradients).
  assert got["ga1"] <= got["one"], got
  assert got["ga2"] <= got["one"] + got["param_bytes"], got
