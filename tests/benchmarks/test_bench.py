"""The bench: `python -m benchmarks.bench` end to end at its tiniest, and its measuring functions."""

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from benchmarks import devices, measure, output, shapes, verdict
from benchmarks.maxtext_arms import MISSING_MAXTEXT
from benchmarks.model import Config
from benchmarks.run import run_cell
from benchmarks.settings import Settings
from nnx_zero1.testing import collectives, shape_bytes
from tests.support.helpers import adam_drift_bound

TINY = ["--model", "tiny", "--steps", "2", "--warmup", "0", "--batch", "8", "--seq-len", "16",
        "--no-progress"]
ROW_FIELDS = {"arm", "dp", "ga", "opt_state_bytes_per_device", "peak_bytes_per_device", "step_ms",
              "compile_s", "collectives", "loss_diff"}


def _fresh_env() -> dict:
  """The environment of a new process that has not been told how many devices to make."""
  env = {k: v for k, v in os.environ.items() if k != devices.CHILD_ENV}
  env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
  env["JAX_PLATFORMS"] = "cpu"
  return env


def test_cli_writes_table_json_md_png_and_meets_memory_and_loss_goals(tmp_path):
  # A fresh interpreter: the bench's modules import nnx_zero1 (and so jax) before its main
  # runs, and the bench must still get its 4 devices.
  args = ["--dp", "4", "--ga", "2", "--arms", "baseline,zero1", "--no-shapes", "--out", str(tmp_path)]
  proc = subprocess.run(
      [sys.executable, "-m", "benchmarks.bench", *TINY, *args],
      env=_fresh_env(), capture_output=True, text=True, timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "rerunning" not in proc.stderr  # devices came from jax_num_cpu_devices, in-process
  assert "zero1" in proc.stdout and "x ideal" in proc.stdout
  # It reads alone: a legend under the table, the goals under a heading, one verdict as the last line.
  assert "x ideal: that / (baseline's / dp)" in proc.stdout and "AR 1x 0.000 is one all-reduce" in proc.stdout
  assert "goals (measured -> met, missed or inconclusive" in proc.stdout
  last = proc.stdout.strip().splitlines()[-1]
  assert last.startswith("verdict: "), last
  assert "final-loss difference == 0" not in last  # bit-identical: that goal is met, so not named
  result = json.loads((tmp_path / "bench.json").read_text())
  assert result["meta"]["devices"] == 4
  assert result["meta"]["cpu_async_dispatch"] is False  # the thread-pool deadlock setting, as in the tests
  rows = {r["arm"]: r for r in result["rows"]}
  assert set(rows) == {"baseline", "zero1"}
  for row in rows.values():
    assert ROW_FIELDS <= set(row)
  base, zero1 = rows["baseline"], rows["zero1"]
  assert zero1["loss_diff"] == 0 and zero1["params_equal"]
  assert zero1["opt_state_bytes_per_device"] <= 1.02 * base["opt_state_bytes_per_device"] / 4
  assert zero1["peak_bytes_per_device"] < base["peak_bytes_per_device"]
  # Zero-1 gathers the new parameters; the plain optimizer never all-gathers.
  assert base["collectives"]["all-gather"]["count"] == 0
  assert zero1["collectives"]["all-gather"]["count"] > 0
  assert zero1["collectives"]["all-reduce"]["count"] >= 1
  md = (tmp_path / "bench.md").read_text()
  assert "| zero1 | 4 | 2 |" in md and "## Goals" in md
  png = (tmp_path / "memory.png").read_bytes()
  assert png.startswith(b"\x89PNG") and len(png) > 1000


def test_step_goal_is_met_missed_or_inconclusive_from_paired_steps():
  rng = np.random.default_rng(0)
  base = list(1.0 + 0.5 * rng.random(12))  # the machine's load moves both arms alike
  same = verdict.estimate_ratio([1.01 * t for t in base], base)
  slow = verdict.estimate_ratio([1.2 * t for t in base], base)
  noisy = verdict.estimate_ratio([t * (1.05 + 0.3 * (rng.random() - 0.5)) for t in base], base)
  assert verdict.judge(same, 1.05) == "met" and same.low == same.high == pytest.approx(1.01)
  assert verdict.judge(slow, 1.05) == "missed"
  assert verdict.judge(noisy, 1.05).startswith("inconclusive (noise ±")
  assert verdict.judge(verdict.estimate_ratio(base[:3], base[:3]), 1.05).startswith("inconclusive")
  assert verdict.judge_all(["met", "missed", "inconclusive (noise ±1.0%)"]) == "missed"
  with pytest.raises(ValueError, match="paired"):
    verdict.estimate_ratio([1.0], [1.0, 2.0])


def test_the_output_labels_other_summation_orders_says_what_inconclusive_means_and_ends_in_one_verdict():
  row = lambda arm, diff, times: {
      "arm": arm, "dp": 2, "ga": output.STEP_RATIO_GA,
      "opt_state_bytes_per_device": 100 if "zero1" in arm else 200,
      "peak_bytes_per_device": 2**20, "step_ms": 20.0, "step_times_ms": times, "compile_s": 1.0,
      "loss_diff": diff, "collectives": {"all-reduce": {"count": 1, "bytes": 8}},
  }
  base = [10.0, 30.0, 11.0, 29.0, 10.5, 31.0]
  noisy = [10.0 * 1.05, 30.0 * 0.98, 11.0 * 1.12, 29.0 * 1.0, 10.5 * 1.09, 31.0 * 1.03]
  rows = [row("baseline", 0.0, base), row("zero1", 0.0, noisy), row("accum", 4.77e-07, base)]
  printed = output.table(rows).splitlines()
  assert printed[-1].endswith("4.77e-07 (sum order)") and printed[-2].endswith(" 0")
  said = "(sum order): the arm adds the micro-batches before the replicas, another order than baseline's"
  assert any(said in line for line in output.legend(rows))
  assert not any("(sum order)" in ln for ln in output.legend(rows[:2]))  # said only where printed
  lines = output.goals_text(rows)
  step = [ln for ln in lines if ln.startswith("step time Zero-1/plain")][0]
  assert "-> inconclusive (noise ±" in step
  assert verdict.INCONCLUSIVE in lines  # what it means, in the output itself
  assert lines[-1].startswith("verdict: 1 of 3 goals not met: step time Zero-1/plain <= 1.05 at GA=8 "
                              "(inconclusive: noise ±"), lines[-1]
  quiet = output.goals_text([row("baseline", 0.0, base), row("zero1", 0.0, [t * 1.01 for t in base])])
  assert quiet[-1] == "verdict: every goal met (3 goals)" and verdict.INCONCLUSIVE not in quiet


def test_goals_judge_step_time_from_the_interval_and_accum_by_bit_identity():
  times = [10.0, 30.0, 11.0, 29.0, 10.5, 31.0]  # a machine whose load swings 3x
  row = lambda arm, factor, equal: {
      "arm": arm, "dp": 2, "ga": output.STEP_RATIO_GA, "opt_state_bytes_per_device": 100, "loss_diff": 0.0,
      "step_ms": 20.0 * factor, "step_times_ms": [t * factor for t in times], "param_bytes": 8,
      "collectives": {op: {"count": 1, "bytes": 8} for op in ("reduce-scatter", "all-gather", "all-reduce")},
      "params_max_diff": 1.2e-5, "params_equal_arms": equal,
  }
  rows = [row("baseline", 1.0, []), row("zero1", 1.0, []), row("accum", 1.0, ["zero1-accum"]),
          row("zero1-accum", 1.02, ["accum"])]
  lines = output.targets(rows)
  step = [line for line in lines if line.startswith("step time Zero-1/plain")]
  assert step and step[0].endswith("-> met") and "dp=2 1.000 [1.000, 1.000]" in step[0]
  assert "zero1-accum parameters bit-identical to accum: True -> met" in lines
  assert not [line for line in lines if "1.2e-05" in line and "->" in line]  # a number, no verdict
  rows[-1]["params_equal_arms"] = []
  assert "zero1-accum parameters bit-identical to accum: False -> missed" in output.targets(rows)
  slow = [row("baseline", 1.0, []), row("zero1", 1.3, [])]  # missed on a quiet machine
  assert [ln for ln in output.targets(slow) if ln.startswith("step time Zero-1/plain")][0].endswith("missed")
  for r in slow:  # the same times while other processes took 40% of the machine
    r["other_cpu_share"] = 0.4
  step = [ln for ln in output.targets(slow) if ln.startswith("step time Zero-1/plain")][0]
  assert step.endswith("-> inconclusive (machine busy: other processes used 40% of its CPU time while the "
                       "arms were timed)")


def test_the_load_meter_sees_another_process_take_a_core():
  import time

  read = measure.load_meter()
  spin = "import time\nt = time.time()\nwhile time.time() - t < 2: pass"
  busy = subprocess.Popen([sys.executable, "-c", spin])
  busy.wait(timeout=60)
  share = read()
  assert share is not None and share > 0.5 / (os.cpu_count() or 1)  # one core spun for ~2 of ~2 s
  idle = measure.load_meter()
  time.sleep(0.5)
  assert idle() is not None


def test_missing_optional_dependencies_give_one_line_before_any_work(tmp_path):
  broken = tmp_path / "site" / "matplotlib"  # a matplotlib that does not import, as if not installed
  broken.mkdir(parents=True)
  (broken / "__init__.py").write_text("raise ImportError('not installed')\n")
  env = {**_fresh_env(), "PYTHONPATH": str(tmp_path / "site")}
  proc = subprocess.run([sys.executable, "-m", "benchmarks.bench", "--quick", "--out", str(tmp_path / "out")],
                        env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2 and not (tmp_path / "out").exists()
  assert proc.stderr.strip().splitlines() == [
      'benchmarks.bench: matplotlib not installed; pip install ".[bench]" (from the repository root)'
  ]


@pytest.mark.parametrize("args, names", [
    (["--arms", "zero1_accum"], "valid arms: baseline, zero1, accum, zero1-accum"),
    (["--aot", "v6e:2x2", "--arms", "engine"], "valid arms: baseline, zero1, accum, zero1-accum"),
    (["--dp", "3"], "valid --dp values: 1,2,4,8"),
    (["--ga", "0"], "must be an integer >= 1"),
    (["--dp", "2,4", "--ga", "1", "--steps", "0"], "--steps must be >= 1"),
])
def test_bad_arguments_exit_2_with_one_line_naming_the_valid_values_before_any_work(tmp_path, args, names):
  out = tmp_path / "out"
  proc = subprocess.run([sys.executable, "-m", "benchmarks.bench", *args, "--out", str(out)],
                        env=_fresh_env(), capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2 and not out.exists()
  (line,) = proc.stderr.strip().splitlines()
  assert line.startswith("python -m benchmarks.bench: error: ") and names in line, line


def test_quick_says_what_it_sets_and_aot_writes_to_its_own_folder():
  from benchmarks.bench import parse_args

  quick = parse_args(["--quick", "--steps", "3"])
  assert quick.quick_changes == {"model": "small", "warmup": 1, "seq_len": 32,
                                 "arms": "baseline,zero1,accum,zero1-accum"}
  assert quick.out == "bench_out" and parse_args(["--aot", "v6e:2x2"]).out == "bench_out_aot"
  assert parse_args(["--aot", "v6e:2x2", "--out", "mine"]).out == "mine"


@pytest.mark.skipif(importlib.util.find_spec("maxtext") is not None, reason="maxtext is installed here")
def test_maxtext_arms_without_maxtext_say_so_in_one_line():
  proc = subprocess.run([sys.executable, "-m", "benchmarks.maxtext_arms"], env=_fresh_env(),
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines() == [f"benchmarks.maxtext_arms: {MISSING_MAXTEXT}"]


def test_device_request_before_and_after_jax_starts():
  script = textwrap.dedent("""
      import nnx_zero1, jax                        # jax imported, no backend yet
      from benchmarks.devices import request_cpu_devices
      assert request_cpu_devices(3)
      assert jax.device_count() == 3               # the backend starts here, with 3 devices
      assert request_cpu_devices(2) and not request_cpu_devices(4)
      print("ok")
  """)
  proc = subprocess.run([sys.executable, "-c", script], env=_fresh_env(), capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_rerun_command_gives_the_child_its_devices():
  _, env = devices.rerun_command(5, ["--quick"])
  proc = subprocess.run([sys.executable, "-c", "import jax; print(jax.device_count())"],
                        env={**env, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=300)
  assert proc.stdout.strip() == "5", proc.stderr[-3000:]
  assert devices.flag_device_count("--xla_force_host_platform_device_count=2") == 2


def test_engine_arms_reduce_once_per_step():
  pytest.importorskip("nnx_zero1.adapters.maxtext")
  settings = Settings(model="tiny", steps=1, warmup=1, seq_len=16)
  engine, zero1 = run_cell(settings, dp=2, ga=2, arms=("engine", "zero1-engine"))  # engine: the reference
  assert zero1["opt_state_bytes_per_device"] <= 1.02 * engine["opt_state_bytes_per_device"] / 2
  # Deferred reduction: the gradients are reduced once per step, by a reduce-scatter under Zero-1;
  # the per-micro-batch kernels reduce only the loss (4 bytes).
  assert zero1["collectives"]["reduce-scatter"]["count"] > 0
  assert engine["collectives"]["reduce-scatter"]["count"] == 0
  gradient_bytes = engine["opt_state_bytes_per_device"] // 2  # adamw: two moments per parameter
  assert engine["collectives"]["all-reduce"]["bytes"] < 1.1 * gradient_bytes
  # Zero1Engine changes where the moments live, not the arithmetic: bit-identical to Engine.
  assert zero1["loss_diff"] == 0 and zero1["params_equal"]


def test_accumulated_arms_reduce_once_and_match_the_engine():
  pytest.importorskip("nnx_zero1.adapters.maxtext")
  settings = Settings(model="tiny", steps=1, warmup=1, seq_len=16)
  rows = run_cell(settings, dp=2, ga=2, arms=("baseline", "accum", "zero1-accum", "zero1-engine"))
  base, accum, zero1, engine = rows
  grads = zero1["param_bytes"]  # float32 gradients: as many bytes as the parameters
  # zero1-accum: one reduce-scatter of the gradients and one all-gather of the parameters per step
  assert zero1["collectives"]["reduce-scatter"]["bytes"] * 2 == grads
  assert zero1["collectives"]["all-gather"]["bytes"] == grads
  assert zero1["collectives"]["all-reduce"]["bytes"] < 1024
  assert zero1["opt_state_bytes_per_device"] <= 1.02 * base["opt_state_bytes_per_device"] / 2
  # accum (nnx.Optimizer): one all-reduce of the gradients per step, where baseline has one per micro-batch
  assert grads <= accum["collectives"]["all-reduce"]["bytes"] < grads + 1024
  assert base["collectives"]["all-reduce"]["bytes"] >= 2 * grads
  for row in (accum, zero1, engine):  # the order of the gradient sums, at most (warmup + steps, lr 1e-3)
    assert row["params_max_diff"] <= adam_drift_bound(1e-3, steps=2)
  # One implementation of deferred reduction: bit-identical to the engine, with and without Zero-1.
  assert {"accum", "zero1-engine"} <= set(zero1["params_equal_arms"])


def test_real_llm_shapes_leave_almost_nothing_replicated():
  row = shapes.replicated_fraction(shapes.CONFIGS["qwen3-0.6b"], 16)
  assert row["replicated_fraction"] <= 0.005 and row["per_device_vs_ideal"] <= 1.02
  # A shape with no dimension divisible by 16 stays whole: the measurement can fail.
  odd = Config(vocab=1000, dim=100, layers=1, heads=2, kv_heads=1, head_dim=50, ffn=300)
  bad = shapes.replicated_fraction(odd, 16)
  assert bad["replicated_fraction"] > 0.5 and bad["replicated_leaves"] > 0


HLO = """\
%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %ar = f32[8]{0} all-reduce(%x), to_apply=%add
}

%cond (p: (s32[], f32[8])) -> pred[] {
  ROOT %lt = pred[] compare(%a, %b), direction=LT
}

ENTRY %main (a: f32[8], b: bf16[4,4]) -> f32[16] {
  %w = (s32[], f32[8]{0}) while(%t), condition=%cond, body=%body, \
backend_config={"known_trip_count":{"n":"3"}}
  %ags = (f32[8]{0}, f32[16]{0}) all-gather-start(%a), dimensions={0}
  %agd = f32[16]{0} all-gather-done(%ags)
  %rs = (f32[2]{0}, bf16[1,4]{1,0}) reduce-scatter(%a, %b), dimensions={0}
  ROOT %ar2 = f32[16]{0} all-reduce-start(%agd), to_apply=%add
}
"""


def test_collectives_count_loops_async_starts_and_tuples():
  got = collectives(HLO)
  assert got["all-reduce"] == {"count": 3 + 1, "bytes": 3 * 32 + 64}
  assert got["all-gather"] == {"count": 1, "bytes": 64}  # the -start's results, not its operands
  assert got["reduce-scatter"] == {"count": 1, "bytes": 8 + 8}
  assert shape_bytes("(f32[2,3]{1,0}, pred[5])") == 29


def test_memory_and_median():
  import jax
  import jax.numpy as jnp

  compiled = jax.jit(lambda x: x @ x.T).lower(jnp.ones((64, 32), jnp.float32)).compile()
  mem = measure.memory(compiled)
  assert mem["argument"] == 64 * 32 * 4 and mem["output"] == 64 * 64 * 4
  assert mem["peak"] >= mem["argument"] + mem["output"]
  assert measure.median_ms([0.001, 0.003, 0.002, 0.1]) == 2.5


def test_transformer_on_an_auto_mesh_is_bit_identical():
  # On Auto meshes XLA's sharding propagation could carry the Zero-1 layout back into
  # the backward pass (the tied embedding's gradient) and reorder sums; update() pins
  # the gradients to their parameters' layout first, so the programs agree exactly.
  settings = Settings(model="tiny", steps=2, warmup=0, seq_len=16, mesh="auto")
  base, zero1 = run_cell(settings, dp=4, ga=1)
  assert zero1["loss_diff"] == 0 and zero1["params_equal"]
  assert zero1["collectives"]["all-reduce"] == base["collectives"]["all-reduce"]


def test_plot_lists_only_series_it_shows_and_says_ga_model_optimizer():
  mib = 2**20
  rows = [{"arm": arm, "dp": dp, "ga": ga, "model": "small", "optimizer": "adamw",
           "opt_state_bytes_per_device": (8 * mib if arm in ("baseline", "accum") else 8 * mib // dp)}
          for arm in ("baseline", "zero1", "accum", "zero1-accum") for dp in (2, 4) for ga in (1, 8)]
  title, series = output.plot_series(rows)
  assert title == "Optimizer state per device, GA=1 (model small, adamw)"
  labels = [label for label, *_ in series]
  assert labels == [
      "nnx.Optimizer, nnx.Optimizer + value_and_grad_accumulated",
      "Zero1Optimizer, Zero1Optimizer + value_and_grad_accumulated, ideal: plain / dp",
  ]
  assert len({tuple(zip(dps, values)) for _, _, dps, values in series}) == len(series)  # none hides another


def test_memory_lever_arms_split_the_accumulator_and_offload_the_state():
  settings = Settings(model="tiny", steps=1, warmup=1, seq_len=16)
  rows = run_cell(settings, dp=2, ga=2, arms=("zero1-accum", "zero2-accum", "zero1-offload"))
  zero1, zero2, offload = rows
  grads = zero1["param_bytes"]
  # ZeRO-2: the accumulator is the gradients' Zero-1 slices, and the reduce-scatter runs per
  # micro-batch (ga of them) instead of once; the parameters are gathered once either way.
  accumulators = [row["grad_accumulator_bytes_per_device"] for row in (zero2, zero1)]
  assert accumulators[0] * 2 == accumulators[1] == grads
  scattered = [row["collectives"]["reduce-scatter"]["bytes"] for row in (zero2, zero1)]
  assert scattered[0] == 2 * scattered[1]
  assert zero2["collectives"]["all-gather"] == zero1["collectives"]["all-gather"]
  assert zero2["temp_bytes_per_device"] < zero1["temp_bytes_per_device"]
  assert zero2["params_max_diff"] <= adam_drift_bound(1e-3, steps=2)  # another order of the sums
  # Offload: the optimizer state in host memory (only the 4-byte step count stays on device),
  # the same collectives and bit-identical parameters.
  assert offload["opt_state_bytes_by_memory_kind"] == {
      "device": 4, "pinned_host": zero1["opt_state_bytes_per_device"] - 4,
  }
  assert offload["collectives"] == zero1["collectives"]
  assert offload["params_equal"] and "zero1-offload" in zero1["params_equal_arms"]
  assert {"step_ms_vs_zero1_accum"} <= set(offload) and zero1["step_ms_vs_zero1_accum"] == 1.0
  # bench.md states each lever's goal with the measured figure.
  goals = [line for line in output._lever_lines(rows) if not line.startswith("(no goal)")]
  assert len(goals) == 3 and all(line.endswith("-> met") for line in goals), goals


@pytest.mark.parametrize("scan_layers", [False, True], ids=["list", "scanned"])
def test_remat_recomputes_the_same_gradients_with_fewer_temporaries(scan_layers):
  import dataclasses

  import jax
  import jax.numpy as jnp
  from flax import nnx

  from benchmarks.model import CONFIGS, Transformer, loss_fn

  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (4, 65)), jnp.int32)
  grads, temps = [], []
  for remat in (False, True):
    cfg = dataclasses.replace(CONFIGS["tiny"], scan_layers=scan_layers, remat=remat, layers=4)
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    step = jax.jit(jax.grad(lambda p, g=graphdef: loss_fn(nnx.merge(g, p), tokens)))
    compiled = step.lower(params).compile()
    grads.append(jax.tree.leaves(compiled(params)))
    temps.append(measure.memory(compiled)["temp"])
  for plain, recomputed in zip(*grads, strict=True):
    np.testing.assert_allclose(recomputed, plain, rtol=1e-5, atol=1e-6)
  assert temps[1] < temps[0], temps
  assert Settings(model="tiny", remat=True).config.remat and not Settings(model="tiny").config.remat
