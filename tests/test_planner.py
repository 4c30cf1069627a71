"""``python -m nnx_zero1.plan``: the planner's inputs, its arithmetic and its tables (every lane), and
a tiny model planned for a TPU slice and for 8 H100s by the real compilers (CI lane 2, which installs
libtpu and XLA's GPU compiler; a lane without one skips its test with the reason).
"""

import importlib.util
import json
import math
import os
import re
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from nnx_zero1 import zero1_sharding
from nnx_zero1.plan import main, parse_args
from nnx_zero1_plan import compilers
from nnx_zero1_plan.depth import extrapolate, extrapolate_row
from nnx_zero1_plan.inputs import (
  PlanError,
  mesh_axes,
  parse_levers,
  parse_mesh,
  parse_model,
  parse_overrides,
  parse_topology,
)
from nnx_zero1_plan.levers import LEVERS
from nnx_zero1_plan.maxtext import config_overrides, engine_attributes
from nnx_zero1_plan.table import next_steps, table
from tests.planner_toys import tiny_lm

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
HAS_GPU_COMPILER = importlib.util.find_spec("jax_cuda13_plugin") is not None
TOY = ["--model", "tests.planner_toys:tiny_lm", "--batch", "8", "--seq-len", "64",
       "--levers", "baseline,zero1"]


# Pure parts: every lane.

def test_mesh_flag_parses_and_fills_the_models_axes_with_size_one():
  assert parse_mesh("data=4, fsdp=2") == {"data": 4, "fsdp": 2}
  assert mesh_axes({"data": 4, "fsdp": 2}, ["fsdp", "tp"], devices=8) == {"data": 4, "fsdp": 2, "tp": 1}
  assert mesh_axes({}, ["tp"], devices=4) == {"data": 4, "tp": 1}
  for bad in ("data", "data=0", "data=2,data=2", "data=x"):
    with pytest.raises(PlanError, match="--mesh"):
      parse_mesh(bad)


def test_a_mesh_whose_product_is_not_the_device_count_is_refused():
  with pytest.raises(PlanError, match=r"--mesh data=4,fsdp=4 has 16 devices; the topology has 8"):
    mesh_axes({"data": 4, "fsdp": 4}, [], devices=8)


def test_topologies_levers_and_models_parse_or_are_refused_in_one_line():
  assert parse_topology("v4:2x2x1", ["h100"]) == ("tpu", "v4", (2, 2, 1))
  assert parse_topology("H100:8", ["h100"]) == ("cuda", "h100", (1, 8))
  for bad in ("h300:8", "h100", "h100:2x2x2", "tpu"):
    with pytest.raises(PlanError, match="unknown topology") as e:
      parse_topology(bad, ["h100"])
    assert "\n" not in str(e.value)
  assert parse_levers("zero1, zero2", LEVERS) == ("zero1", "zero2")
  with pytest.raises(PlanError, match="unknown lever zero3; levers: baseline, zero1"):
    parse_levers("zero1,zero3", LEVERS)
  with pytest.raises(PlanError, match="unknown model"):
    parse_model("qwen3_8b")
  assert parse_model("maxtext:qwen3-0.6b") == ("maxtext", "qwen3-0.6b")


def test_maxtext_settings_become_maxtexts_overrides_or_are_refused_in_one_line():
  axes = ("data", "fsdp", "tensor")
  settings = dict(batch=8, seq_len=1024, ga=8, optimizer="adamw", param_dtype="bfloat16", compute_dtype=None,
                  remat="minimal", known_axes=axes)
  o = config_overrides("qwen3-0.6b", "v6e:2x4", 8, {"data": 2, "fsdp": 4}, **settings,
                       overrides={"remat_policy": "full"})
  assert [o[f"ici_{a}_parallelism"] for a in axes] == ["2", "4", "1"]
  assert [o[k] for k in ("per_device_batch_size", "gradient_accumulation_steps", "weight_dtype")] == [
      "1", "8", "bfloat16"]
  assert o["compile_topology"] == "v6e:2x4" and o["internal_compile_num_devices"] == "8"
  assert o["remat_policy"] == "full" and "dtype" not in o  # the user's overrides last; MaxText's default kept
  for mesh, changes, words in (
      ({"tp": 8}, {}, "--mesh axis tp is not MaxText's; its mesh axes: data, fsdp"),
      ({"data": 8}, {"optimizer": "lion"}, "--optimizer lion is not a MaxText opt_type"),
      ({"data": 8}, {"batch": 4}, "--batch 4 does not split over the 8 devices")):
    with pytest.raises(PlanError, match=re.escape(words)) as e:
      config_overrides("qwen3-0.6b", "v6e:2x4", 8, mesh, **{**settings, **changes})
    assert "\n" not in str(e.value)
  assert engine_attributes("baseline", LEVERS["baseline"]) is None
  assert engine_attributes("zero1", LEVERS["zero1"]) == {}
  assert engine_attributes("offload", LEVERS["offload"]) == {"OFFLOAD_STATE_TO_HOST": True}
  assert engine_attributes("zero2", LEVERS["zero2"]) == {"SHARD_ACCUMULATOR": True}
  with pytest.raises(PlanError, match="MaxText's engine accumulates its own"):
    engine_attributes("zero1-accum", LEVERS["zero1-accum"])
  assert parse_overrides(["remat_policy=minimal", "a.b=1=2"]) == {"remat_policy": "minimal", "a.b": "1=2"}
  with pytest.raises(PlanError, match="is not a MaxText config override"):
    parse_overrides(["remat_policy"])


@pytest.mark.skipif(importlib.util.find_spec("tunix") is None, reason="needs Tunix: pip install \".[tunix]\"")
def test_unknown_tunix_models_and_flags_are_refused_in_one_line():
  from nnx_zero1_plan.models import model_source

  for model, words in (("tunix:mistral_7b", "Tunix families: qwen3"), ("tunix:qwen3_9b", "ModelConfig has"),
                       ("tests.planner_toys:no_such", "unknown model tests.planner_toys:no_such")):
    with pytest.raises(PlanError, match=words) as e:
      model_source(model)
    assert "\n" not in str(e.value)
  with pytest.raises(PlanError, match="--remat 'sometimes' is not one of"):
    model_source("tunix:qwen3_0p6b", remat="sometimes")
  with pytest.raises(PlanError, match="computes in its parameters' dtype"):
    model_source("tunix:llama3p1_8b", compute_dtype="bfloat16")  # float32 parameters, no dtype field
  with pytest.raises(PlanError, match="apply to tunix: models"):
    model_source("tests.planner_toys:tiny_lm", param_dtype="bfloat16")


@pytest.mark.parametrize("argv, words", [
    (["--levers", "zero3"], "unknown lever zero3"),
    (["--topology", "h300:8"], "unknown topology 'h300:8'"),
    (["--model", "no_colon"], "unknown model 'no_colon'"),
    (["--mesh", "data=three"], "--mesh entry 'data=three'"),
    (["--steps", "one,fused"], "unknown step fused; steps: one, split"),
    (["remat_policy=full"], "config overrides (key=value) apply to maxtext: models"),
    (["--model", "maxtext:qwen3-0.6b", "--steps", "one"], "as two programs: --steps split"),
    (["--mesh", "dta=4"], "unknown --mesh axis dta; axes the model names or the planner splits over: data"),
    (["--levers", "zero1-master"], "--levers zero1-master does not apply to tests.planner_toys:tiny_lm: "
                                   "zero1-master keeps float32 copies of narrower parameters"),
    (["--model", "tests.planner_toys:tiny_lm_bf16", "--levers", "zero1,zero1-bf16state"],
     "zero1-bf16state stores the state in bfloat16; for bfloat16 parameters it is bfloat16 already"),
    (["--remat", "block"], "--remat apply to tunix: models"),
    (["--margin", "1.5"], "--margin is the share of the usable memory to leave free"),
])
def test_bad_inputs_exit_2_with_one_line(capsys, argv, words):
  args = ["--model", "tests.planner_toys:tiny_lm", "--topology", "v6e:2x2", *argv]
  assert main(args) == 2
  err = capsys.readouterr().err.strip()
  assert words in err and "\n" not in err


def test_flags_are_the_contracts_names():
  args = parse_args(["--model", "tunix:qwen3_8b", "--topology", "v5e:2x4", "--mesh", "data=4,fsdp=2",
                     "--batch", "8", "--seq-len", "1024", "--ga", "8", "--param-dtype", "bfloat16",
                     "--compute-dtype", "bfloat16", "--remat", "decoder", "--optimizer", "adamw",
                     "--levers", "baseline,zero1", "--out", "d"])
  assert (args.mesh, args.ga, args.param_dtype, args.remat, args.out) == ("data=4,fsdp=2", 8, "bfloat16",
                                                                         "decoder", "d")


def test_without_the_compiler_the_planner_says_what_to_install(monkeypatch):
  monkeypatch.setattr(compilers.importlib.util, "find_spec", lambda name: None)
  with pytest.raises(compilers.AotUnavailable, match=re.escape('pip install "./planner[aot]"')):
    compilers.require_libtpu()
  with pytest.raises(compilers.AotUnavailable, match="pip install --no-deps jax-cuda13-plugin=="):
    compilers.require_cuda_plugin()
  assert "nnx-zero1[" not in compilers.install_hint("0.12.0.1")  # not on the package index


@pytest.mark.parametrize("topology, words", [("v6e:2x2", 'pip install "./planner[aot]"'),
                                              ("h100:8", "pip install --no-deps jax-cuda13-plugin==")])
def test_the_command_without_its_compiler_exits_2_with_the_install_line(monkeypatch, capsys, topology, words):
  monkeypatch.setattr(compilers.importlib.util, "find_spec", lambda name: None)
  assert main(["--model", "tests.planner_toys:tiny_lm", "--topology", topology]) == 2
  err = capsys.readouterr().err.strip()
  assert words in err and "\n" not in err


def test_extrapolation_is_the_line_through_two_depths():
  assert extrapolate(110, 120, 1, 2, 28) == 380
  assert extrapolate(100, 140, 2, 4, 6) == 180
  r1, r2 = {"a": 10, "b": None, "c": {"x": 1}}, {"a": 14, "b": 3, "c": {"x": 3}}
  r = extrapolate_row(r1, r2, 2, 4, 8, ("a", "b", "c"))
  assert r == {"a": 22, "b": None, "c": {"x": 7}}
  with pytest.raises(ValueError):
    extrapolate(1, 2, 4, 2, 8)


def _row(lever, peak, **kw):
  return {"lever": lever, "compiled_for": "v5e:2x4", "mesh": {"data": 8}, "opt_state_bytes_per_device": 2**30,
          "argument_bytes_per_device": peak // 2, "temp_bytes_per_device": peak // 2,
          "peak_bytes_per_device": peak,
          "hbm_bytes": 16 * 2**30, "fits": peak <= 16 * 2**30, "compile_s": 3.0, "collectives": {}, **kw}


def test_the_table_and_what_to_try_next_when_nothing_fits():
  rows = [_row("baseline", 20 * 2**30), _row("zero1", 17 * 2**30, depth=28, depth_extrapolated_from=[2, 4])]
  lines = table(rows).splitlines()
  assert lines[0].split()[:3] == ["lever", "step", "compiled"]
  assert "extrapolated to 28 layers from 2/4" in lines[3]
  meta = {"model": "tunix:qwen3_8b", "topology": "v5e:2x4", "mesh": {"data": 8, "fsdp": 1}, "batch": 32,
          "seq_len": 1024, "ga": 1, "levers": ["baseline", "zero1"], "steps": ["one"]}
  blocked = {"zero1-master": "float32 already"}
  steps = next_steps(rows, meta, list(LEVERS), blocked=blocked, remat="decoder", batch_unit=8)
  at = "python -m nnx_zero1.plan --model tunix:qwen3_8b --topology v5e:2x4 --mesh data=8,fsdp=1 --batch"
  assert steps[0] == f"the lever zero1-accum: {at} 32 --seq-len 1024 --ga 1 --levers zero1-accum --steps one"
  assert not [s for s in steps if "zero1-master" in s]  # a lever that cannot apply is not offered
  assert steps[-3].startswith("zero1 comes closest, 1.00 GiB over") and "--mesh data=4,fsdp=2" in steps[-3]
  assert steps[-2].startswith("remat (recomputes") and steps[-2].endswith("--remat decoder")
  assert steps[-1].startswith("half the micro-batch") and f"{at} 16 --seq-len 1024 --ga 2" in steps[-1]
  # Half of 8 sequences does not split over 8 devices; a model with no --remat is not offered one.
  steps = next_steps(rows, dict(meta, batch=8), list(LEVERS), blocked=blocked, remat=None, batch_unit=8)
  assert not [s for s in steps if s.startswith(("half", "remat"))]
  # After the compiler refused every program: the smaller micro-batch still.
  refused = [dict(_row("baseline", 0), peak_bytes_per_device=None, fits=False, error="RESOURCE_EXHAUSTED")]
  steps = next_steps(refused, meta, ["baseline"], blocked={}, remat=None, batch_unit=8)
  assert steps == ["half the micro-batch, twice the accumulation (the same tokens per step; the compiler "
                   f"refused every program at this micro-batch): {at} 16 --seq-len 1024 --ga 2 --levers "
                   "baseline --steps one"]
  assert next_steps([_row("zero1", 2**30)], meta, list(LEVERS), blocked={}, remat=None, batch_unit=8) == []


# The compilers: CI lane 2.

def _env() -> dict:
  env = {k: v for k, v in os.environ.items() if k not in compilers.ENV}
  env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
  return env


def _plan(tmp_path, *args) -> dict:
  proc = subprocess.run([sys.executable, "-m", "nnx_zero1.plan", *TOY, *args, "--out", str(tmp_path)],
                        env=_env(), capture_output=True, text=True, timeout=400)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads((tmp_path / "plan.json").read_text())
  assert (tmp_path / "plan.md").read_text().startswith("# Will it fit?")
  return result


def _rule_saving(data: int) -> int:
  """Optimizer bytes per device the layout rule takes off each replica, on a CPU mesh of the same shape."""
  mesh = jax.make_mesh((data,), ("data",), devices=jax.devices()[:data])
  with jax.set_mesh(mesh):
    model = nnx.eval_shape(lambda: tiny_lm())
    opt = nnx.eval_shape(lambda: nnx.Optimizer(model, optax.adamw(1e-5), wrt=nnx.Param))
  saving = 0
  for x in jax.tree.leaves(nnx.state(opt, nnx.OptState)):
    home = x.sharding if isinstance(x.sharding, NamedSharding) else NamedSharding(mesh, jax.P())
    zero1 = zero1_sharding(x.shape, home, "data")
    rows_kept = math.prod(home.shard_shape(x.shape)) - math.prod(zero1.shard_shape(x.shape))
    saving += rows_kept * np.dtype(x.dtype).itemsize
  return saving


def _check_rule_and_fits(result: dict, data: int) -> dict:
  """Both steps' arguments fall by the layout rule's bytes; returns the rows by (lever, step)."""
  rows = {(r["lever"], r["step"]): r for r in result["rows"]}
  assert set(rows) == {(lever, step) for lever in ("baseline", "zero1") for step in ("one", "split")}
  saving = _rule_saving(data)
  assert saving > 0
  for step in ("one", "split"):
    base, zero1 = rows["baseline", step], rows["zero1", step]
    assert base["mesh"] == {"data": data} and base["depth_extrapolated_from"] is None
    assert base["argument_bytes_per_device"] - zero1["argument_bytes_per_device"] == saving
    assert base["opt_state_bytes_per_device"] - zero1["opt_state_bytes_per_device"] == saving
  for r in rows.values():
    assert r["hbm_bytes"] == result["meta"]["hbm_bytes"]
    assert r["fits"] == (r["peak_bytes_per_device"] <= r["hbm_bytes"])
    assert set(r["collectives"]) == {"per_step", "per_micro_batch"}
    assert (r["update_peak_bytes_per_device"] is None) == (r["step"] == "one")
  return rows


@pytest.mark.skipif(not HAS_LIBTPU, reason="needs libtpu: ./planner[aot], Python >= 3.12 (CI lane 2)")
def test_tpu_plan_saves_what_the_layout_rule_predicts_and_extrapolates_from_reduced_depth(tmp_path):
  full = _plan(tmp_path / "full", "--topology", "v6e:2x2", "--full-depth", "--steps", "one,split")
  rows = _check_rule_and_fits(full, data=4)
  assert full["meta"]["hbm_bytes"] == 33_543_694_581  # v6e: 31.24G, as the TPU compiler words it
  # The split step's update program: Zero-1 updates a quarter of each moment and parameter per chip.
  flops = [rows[lever, "split"]["update_flops_per_device"] for lever in ("baseline", "zero1")]
  assert 0 < flops[1] < flops[0] / 2
  reduced = _plan(tmp_path / "reduced", "--topology", "v6e:2x2", "--steps", "one")
  one_program = [r for r in full["rows"] if r["step"] == "one"]
  for a, b in zip(one_program, reduced["rows"], strict=True):
    assert b["depth_extrapolated_from"] == [2, 4] and b["depth"] == 6
    assert b["argument_bytes_per_device"] == a["argument_bytes_per_device"]  # parameters are linear in depth
    error = abs(b["peak_bytes_per_device"] - a["peak_bytes_per_device"]) / a["peak_bytes_per_device"]
    print(f"{a['lever']}: extrapolated peak {b['peak_bytes_per_device']:,} B, "
          f"compiled {a['peak_bytes_per_device']:,} B ({error:.2%})")
    assert error < 0.05


@pytest.mark.skipif(not HAS_GPU_COMPILER, reason="needs XLA's GPU compiler: pip install --no-deps "
                    "jax-cuda13-plugin==0.12.0.1 jax-cuda13-pjrt==0.12.0.1 (Python >= 3.12), CI lane 2")
def test_gpu_plan_saves_what_the_layout_rule_predicts(tmp_path):
  result = _plan(tmp_path, "--topology", "h100:8", "--full-depth", "--steps", "one,split")
  rows = _check_rule_and_fits(result, data=8)
  assert rows["zero1", "split"]["update_flops_per_device"] is None  # XLA's GPU compiler has no cost analysis
  assert result["rows"][0]["device_kind"] == "NVIDIA H100 80GB HBM3"
  assert result["meta"]["hbm_bytes"] == int(84_929_347_584 * 0.75)  # jax's GPU pool, the smaller limit


_TWO_NODES = """
from nnx_zero1_plan import compilers
compilers.start_cpu_jax()
from nnx_zero1_plan.targets import make_target
target = make_target("h200:2x8")
nodes = {d.process_index for d in target.devices}
print(len(target.devices), len(nodes), target.device_kind)
"""


@pytest.mark.skipif(not HAS_GPU_COMPILER, reason="needs XLA's GPU compiler (CI lane 2)")
def test_a_two_node_gpu_target_has_both_nodes_devices():
  proc = subprocess.run([sys.executable, "-c", _TWO_NODES], env=_env(), capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.split()[:2] == ["16", "2"] and "NVIDIA H200" in proc.stdout


@pytest.mark.skipif(not HAS_GPU_COMPILER, reason="needs XLA's GPU compiler (CI lane 2)")
def test_gpu_plan_of_the_bfloat16_levers(tmp_path):
  """On 8x H100, a bfloat16 model: float32 master weights add 8P/dp bytes of arguments (masters
  4P/dp, float32 moments 4P/dp over bfloat16 ones) and all-gather exactly what pure bfloat16 Zero-1
  does, 2 bytes per parameter (bfloat16 state would change nothing there: the planner refuses it,
  tests above; what it halves on a float32 model, tests/test_state_dtype.py measures on CPU)."""
  params = sum(x.size for x in jax.tree.leaves(nnx.state(nnx.eval_shape(tiny_lm), nnx.Param)))
  argv = ["--model", "tests.planner_toys:tiny_lm_bf16", "--topology", "h100:8", "--full-depth",
          "--levers", "zero1,zero1-master", "--steps", "one"]
  out = tmp_path / "bf16"
  proc = subprocess.run([sys.executable, "-m", "nnx_zero1.plan", *argv, *TOY[2:-2], "--out", str(out)],
                        env=_env(), capture_output=True, text=True, timeout=400)
  assert proc.returncode == 0, proc.stderr[-3000:]
  bf16 = {r["lever"]: r for r in json.loads((out / "plan.json").read_text())["rows"]}
  gathered = [bf16[n]["collectives"]["per_step"]["all-gather"]["bytes"] for n in ("zero1", "zero1-master")]
  assert gathered == [2 * params] * 2
  args = [bf16[n]["argument_bytes_per_device"] for n in ("zero1", "zero1-master")]
  assert args[1] - args[0] == params


@pytest.mark.skipif(not HAS_GPU_COMPILER, reason="needs XLA's GPU compiler (CI lane 2)")
def test_a_search_on_8_h100_finds_the_edge_and_recommends_by_it(tmp_path):
  """The search, compiled for 8 H100s: a 99.9% margin leaves the tiny model ~61 MiB, so its edge is a
  hundred-odd sequences away; every claim is checked against the compiles the search made."""
  result = _plan(tmp_path, "--topology", "h100:8", "--steps", "one", "--search", "--margin", "0.999",
                 "--levers", "zero1")
  usable = int(result["meta"]["hbm_bytes"] * 0.001)
  rows = {r["lever"]: r for r in result["rows"]}
  for r in rows.values():
    probes = {p["batch"]: p for p in r["search"]}
    edge, above = r["max_micro_batch"], r["above"]
    assert edge % 8 == 0 and edge >= 16 and above == edge + 8, (edge, above)
    assert probes[edge]["fits"] and probes[edge]["peak_bytes_per_device"] <= usable
    assert not probes[above]["fits"] and probes[above]["peak_bytes_per_device"] > usable
    assert r["refused_because"].startswith("peak ") and len(probes) <= 10
    # Near the edge the compiler's peaks wobble by MiB; across the search they rise with the batch.
    assert probes[8]["peak_bytes_per_device"] < probes[edge]["peak_bytes_per_device"]
  best = result["recommendation"]
  assert best["lever"] == "zero1" and best["micro_batch"] == rows["zero1"]["max_micro_batch"]
  assert best["cli"].startswith("python -m nnx_zero1.plan --model tests.planner_toys:tiny_lm --topology h100")
  assert f"--batch {best['micro_batch']} " in best["cli"] and best["lever"] in rows


HAS_MAXTEXT = importlib.util.find_spec("maxtext") is not None


@pytest.mark.skipif(not (HAS_LIBTPU and HAS_MAXTEXT),
                    reason="needs libtpu and maxtext (extra aot + maxtext==0.2.5, Python >= 3.12), CI lane 2")
def test_maxtext_plan_compiles_maxtexts_engine_for_each_lever(tmp_path):
  """``maxtext:`` through MaxText's own ahead-of-time engine, a 2-layer decoder (MaxText's defaults and the
  toys' overrides) on v6e:2x2, GA 2: each Zero-1 lever is ``Zero1AbstractMaxTextEngine``, the rows are
  split steps, and a lever of this library's own accumulation is refused on its row."""
  from tests.maxtext_toys import TINY

  skip = ("model_name", "run_name", "per_device_batch_size", "max_target_length", "ici_data_parallelism",
          "ici_fsdp_parallelism", "opt_type", "base_output_directory")
  overrides = [f"{k}={v}" for k, v in TINY.items() if k not in skip]
  argv = ["--model", "maxtext:default", "--topology", "v6e:2x2", "--batch", "8", "--seq-len", "16",
          "--ga", "2", "--levers", "baseline,zero1,zero1-accum,offload", "--out", str(tmp_path), *overrides]
  proc = subprocess.run([sys.executable, "-m", "nnx_zero1.plan", *argv], env=_env(), capture_output=True,
                        text=True, timeout=400)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads((tmp_path / "plan.json").read_text())
  rows = {r["lever"]: r for r in result["rows"]}
  assert result["meta"]["layers"] == 2 and list(result["meta"]["steps"]) == ["split"]
  assert all(r["step"] == "split" and r["device_kind"].startswith("TPU v6") for r in rows.values())
  base, zero1, offload = rows["baseline"], rows["zero1"], rows["offload"]
  assert base["maxtext_config"]["shard_mode"].endswith("EXPLICIT")  # the toys' override, applied last
  # A quarter of the moments per chip (the step count stays whole): the update kernel reads that much less.
  assert 3 * zero1["opt_state_bytes_per_device"] < base["opt_state_bytes_per_device"]
  assert zero1["update_peak_bytes_per_device"] < base["update_peak_bytes_per_device"]
  assert 0 < zero1["update_flops_per_device"] < base["update_flops_per_device"] / 2
  # A step is two micro-batches' gradient kernels and one update; Zero-1's update gathers the new slices.
  gathered = {lever: (rows[lever]["collectives"]["per_step"]["all-gather"]["bytes"],
                      rows[lever]["collectives"]["per_micro_batch"]["all-gather"]["bytes"])
              for lever in ("baseline", "zero1")}
  assert gathered["baseline"][0] == 2 * gathered["baseline"][1]
  assert gathered["zero1"][0] - 2 * gathered["zero1"][1] > zero1["param_bytes_per_device"] / 2
  assert offload["opt_state_bytes_by_memory_kind"].get("pinned_host", 0) > 0
  assert offload["opt_state_bytes_per_device"] < zero1["opt_state_bytes_per_device"] / 10
  assert "MaxText's engine accumulates its own" in rows["zero1-accum"]["error"]
  if HAS_GPU_COMPILER:  # MaxText's ahead-of-time engine compiles for TPUs only: one line, exit 2
    gpu = subprocess.run([sys.executable, "-m", "nnx_zero1.plan", "--model", "maxtext:default", "--topology",
                          "h100:8"], env=_env(), capture_output=True, text=True, timeout=300)
    assert gpu.returncode == 2 and "for TPU slices only; h100:8 is a GPU target" in gpu.stderr
