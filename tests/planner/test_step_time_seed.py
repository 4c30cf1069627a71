"""docs/accuracy.md's "Step time, against the seed's measured steps", held to the seed's programs kept as
text.

Each arm of the seed's rig (MaxText's qwen3-0.6b on v6e:2x2) was compiled once by ``scripts/seed_programs.py``
and its programs kept, cut to what the walk reads (``docs/data/maxtext_qwen3_0p6b_v6e_seed/programs/ARM``):
each arm's predicted step is recomputed here from those programs with today's walk and chip table (lane 1:
no compiler), beside what the seed measured on four TPU v6e.
"""

from __future__ import annotations

import gzip
import json
import pathlib

import pytest

from nnx_zero1_plan.chips import CHIPS
from nnx_zero1_plan.networks import network_note, rings_of
from nnx_zero1_plan.row import Figures
from nnx_zero1_plan.step_time import predict_step_time
from tests.support.docs_tables import table_under

ROOT = pathlib.Path(__file__).resolve().parents[2]
KEPT = ROOT / "docs" / "data" / "maxtext_qwen3_0p6b_v6e_seed" / "programs"
# The seed's measured steps (issue 74): tp=4 is 8 x fwd_bwd + update.
MEASURED_MS = {"tensor4": 8 * 97.4 + 139.6, "not_deferred_baseline": 593.1, "not_deferred_zero1": 597.3,
               "deferred_baseline": 437.6, "deferred_zero1": 437.5}
# The docs' promise for each arm where it holds (issue 74): the arms that reduce in every micro-batch miss
# it, and the docs say why.
WITHIN = {"tensor4": 0.20, "deferred_baseline": 0.10, "deferred_zero1": 0.10}
_WALKS: dict[str, Figures] = {}


def programs(arm: str) -> list[tuple[str, str, int]]:
  """An arm's kept programs, each with the times one step runs it."""
  runs = json.loads((KEPT / arm / "runs.json").read_text())["runs"]
  return [(name, gzip.decompress((KEPT / arm / f"{name}.hlo.txt.gz").read_bytes()).decode(), times)
          for name, times in runs]


def walked(arm: str) -> Figures:
  """Today's prediction of an arm's step from its kept programs, walked once for every test."""
  if arm not in _WALKS:
    _WALKS[arm] = predict_step_time(programs(arm), CHIPS["v6e"], devices=4,
                                    tokens_per_device=8 * 1024 * 8 / 4, compute_dtype="bfloat16")
  return _WALKS[arm]


def test_every_arm_is_kept_and_the_kept_programs_are_small():
  assert sorted(p.name for p in KEPT.iterdir()) == sorted(MEASURED_MS)
  assert sum(f.stat().st_size for f in KEPT.rglob("*")) < 5 * 2**20


# docs/accuracy.md's name for each arm, and the programs kept for it.
ARMS = {"baseline": "not_deferred_baseline", "deferred gradient all-reduce": "deferred_baseline",
        "Zero-1": "not_deferred_zero1", "deferred + Zero-1": "deferred_zero1",
        "tensor parallel (tp 4)": "tensor4"}


def test_the_docs_table_is_todays_walk_of_each_kept_arm():
  """Each row's predicted step, compute and ICI are today's walk of its arm's kept programs (the kept plans,
  compiled from the same programs, say the same: tests/test_docs_records.py)."""
  rows = table_under("docs/accuracy.md", "| the seed's arm |")
  assert {r[0] for r in rows} == set(ARMS)
  for arm, _, _, step, measured, ratio, compute, ici, *_ in rows:
    t, kept = walked(ARMS[arm]), MEASURED_MS[ARMS[arm]]
    parts, now = t.step_time, 1000 * (t.predicted_step_s or 0)
    assert parts is not None
    assert (step, measured, ratio) == (f"{now:.1f} ms", f"{kept:.1f} ms", f"{now / kept - 1:+.1%}"), arm
    assert compute == f"{1000 * parts.compute_s:.1f} ms", arm
    assert ici == f"{1000 * parts.fast_s:.1f} ms ({1000 * parts.fast_exposed_s:.1f})", arm


@pytest.mark.parametrize("arm", sorted(WITHIN))
def test_each_arm_is_within_its_bound(arm):
  assert walked(arm).predicted_step_s == pytest.approx(MEASURED_MS[arm] / 1000, rel=WITHIN[arm])


def test_only_the_tensor_parallel_step_is_mostly_network_and_says_so():
  assert "mostly network" in (network_note(walked("tensor4").step_time) or "")
  assert network_note(walked("deferred_zero1").step_time) is None


def test_the_rings_are_the_compilers_own():
  """The activations' all-gathers name no rings (one), their reduce-scatters one, the gradients' all-reduces
  two: read off the programs as compiled."""
  def rings(arm, op):
    hlo = dict((n, h) for n, h, _ in programs(arm))["fwd_bwd_accum"]
    return {rings_of(line) for line in hlo.splitlines() if f" {op}(" in line and '"emitter"' in line}

  assert rings("tensor4", "all-gather") == {1} and "1DAllGatherNonMajorDim" in programs("tensor4")[1][1]
  assert rings("tensor4", "fusion") == {1}  # the fused reduce-scatters: StrategyRing{colors:1}
  assert 2 in rings("not_deferred_baseline", "all-reduce")


def test_the_seed_readme_says_what_two_rings_for_the_unnamed_all_gathers_would_give(monkeypatch):
  """The seed plans' README: the walk keeps one ring where a program names none. Read as two rings, the
  unnamed one-dimensional all-gathers would put deferred Zero-1 within 1% of the baseline and the
  tensor-parallel step outside its 20%; and Zero-1's update walked at one ring is under what the chips
  measured (80.9 ms)."""
  import nnx_zero1_plan.step_time as step_time

  one = {arm: walked(arm) for arm in ("deferred_baseline", "deferred_zero1")}
  update = predict_step_time([p for p in programs("deferred_zero1") if p[0] == "update"], CHIPS["v6e"],
                             devices=4, tokens_per_device=8 * 1024 * 8 / 4, compute_dtype="bfloat16")
  unnamed = lambda line: 2 if "AllGather" in line and "colors:" not in line else rings_of(line)  # noqa: E731
  monkeypatch.setattr(step_time, "rings_of", unnamed)
  two = {arm: predict_step_time(programs(arm), CHIPS["v6e"], devices=4, tokens_per_device=8 * 1024 * 8 / 4,
                                compute_dtype="bfloat16")
         for arm in ("deferred_baseline", "deferred_zero1", "tensor4")}
  ms = {arm: 1000 * (t.predicted_step_s or 0) for arm, t in two.items()}
  said = " ".join((KEPT.parent / "README.md").read_text().split())
  assert (f"would put the deferred Zero-1 step at {ms['deferred_zero1']:.1f} ms, "
          f"{ms['deferred_zero1'] / ms['deferred_baseline'] - 1:.1%} over the baseline's "
          f"{ms['deferred_baseline']:.1f}, and the tensor-parallel step at {ms['tensor4']:.1f} ms "
          f"({ms['tensor4'] / MEASURED_MS['tensor4'] - 1:+.1%}") in said
  assert one["deferred_zero1"].predicted_step_s > one["deferred_baseline"].predicted_step_s
  assert f"the walk gives {1000 * (update.predicted_step_s or 0):.1f}" in said
  assert 1000 * (update.predicted_step_s or 0) < 80.9
