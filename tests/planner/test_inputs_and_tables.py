"""``python -m nnx_zero1.plan``: the planner's inputs, its arithmetic and its tables, with no compiler
(every lane; the plans the real compilers make are tests/planner/test_compiled_plans.py)."""


import dataclasses
import importlib.util
import json
import re
import shlex
from pathlib import Path

import pytest

from nnx_zero1.plan import main, parse_args
from nnx_zero1_plan import compilers
from nnx_zero1_plan.estimate import extrapolate, extrapolate_row
from nnx_zero1_plan.inputs import (
  PlanError,
  parse_levers,
  parse_mesh,
  parse_model,
  parse_overrides,
  parse_topology,
)
from nnx_zero1_plan.levers import LEVERS, engine_attributes
from nnx_zero1_plan.maxtext import config_overrides
from nnx_zero1_plan.mesh_axes import mesh_axes
from nnx_zero1_plan.request import PlanRequest, command_line
from nnx_zero1_plan.result import Plan
from nnx_zero1_plan.row import Figures, Made, OpCount, Row
from nnx_zero1_plan.settings import ADDED_LATER, PlanSettings
from nnx_zero1_plan.table import table
from nnx_zero1_plan.way_out import next_steps
from tests.support.rows import make_row

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
HAS_GPU_COMPILER = importlib.util.find_spec("jax_cuda13_plugin") is not None
TOYS = "tests.support.planner_toys"  # the planner's toy models, by their module's name
TOY = ["--model", f"{TOYS}:tiny_lm", "--batch", "8", "--seq-len", "64",
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
  # What a plan asks of a model's kind, read from one table (a module of the user's own is the function kind).
  maxtext, tunix, own = (parse_model(m).kind for m in ("maxtext:qwen3-0.6b", "tunix:qwen3_8b", "m:f"))
  assert maxtext.engine and maxtext.steps == ("split",) and not tunix.engine and tunix.trainer
  assert own.steps == ("one", "split") and not own.takes and own.remat_hint is None


def test_a_states_bytes_by_dtype_and_by_the_data_axes_it_splits_over():
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from nnx_zero1_plan.abstract import bytes_by_dtype, describe_model, state_split

  mesh = jax.make_mesh((1, 1), ("replica", "data"))
  leaf = lambda dtype, *spec: jax.ShapeDtypeStruct((12, 4), dtype, sharding=NamedSharding(mesh, P(*spec)))
  tree = {"mu": leaf(jnp.bfloat16, "data"), "nu": leaf(jnp.float32, ("replica", "data")),
          "count": jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P()))}
  assert bytes_by_dtype(tree) == {"bfloat16": 96, "float32": 192}  # the arrays: the step count left out
  assert {k: round(v, 3) for k, v in state_split(tree, ("replica", "data")).items()} == {
      "data": 0.329, "none": 0.014, "replica,data": 0.658}
  assert describe_model(lambda: nnx.Linear(2, 2, rngs=nnx.Rngs(0))) == ((), frozenset({"float32"}))


def test_a_maxtext_plan_writes_in_a_folder_of_its_own_named_unlike_a_package_and_leaves_nothing(
    tmp_path, monkeypatch):
  # MaxText's base_output_directory was <temp>/nnx_zero1_plan, left there: any Python started in the temp
  # folder then imported that empty folder as the planner (a namespace package) and `plan` was missing.
  import importlib.machinery
  import tempfile

  from nnx_zero1_plan import run
  from nnx_zero1_plan.maxtext import output_directory

  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
  with output_directory() as out:
    settings = dict(batch=8, seq_len=16, ga=1, optimizer="adamw", param_dtype=None, compute_dtype=None,
                    remat=None, known_axes=("data",), output_dir=out)
    folder = Path(config_overrides("default", "v6e:2x2", 4, {"data": 4}, **settings)["base_output_directory"])
    assert folder.parent == tmp_path and folder.is_dir()
    assert importlib.machinery.PathFinder.find_spec("nnx_zero1_plan", [str(tmp_path)]) is None
  assert not list(tmp_path.iterdir())
  # make_plan makes the folder for a maxtext: plan and removes it, whatever ends the plan (here the
  # compiler's search, stopped before anything compiles).
  seen = []

  def stop(platform):
    seen.extend(p.name for p in tmp_path.iterdir())
    raise PlanError("stopped")

  monkeypatch.setattr(run, "require_compiler", stop)
  with pytest.raises(PlanError, match="stopped"):
    run.make_plan(PlanRequest("maxtext:default", "v6e:2x2", steps="split"))
  assert len(seen) == 1 and seen[0].startswith("maxtext_out_") and not list(tmp_path.iterdir())


def test_maxtext_settings_become_maxtexts_overrides_or_are_refused_in_one_line():
  axes = ("data", "fsdp", "tensor")
  settings = dict(batch=8, seq_len=1024, ga=8, optimizer="adamw", param_dtype="bfloat16", compute_dtype=None,
                  remat="minimal", known_axes=axes, output_dir="/tmp/maxtext_out_1")
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
  assert o["base_output_directory"] == "/tmp/maxtext_out_1"
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
                       (f"{TOYS}:no_such", f"unknown model {TOYS}:no_such")):
    with pytest.raises(PlanError, match=words) as e:
      model_source(model)
    assert "\n" not in str(e.value)
  with pytest.raises(PlanError, match="--remat 'sometimes' is not one of"):
    model_source("tunix:qwen3_0p6b", remat="sometimes")
  with pytest.raises(PlanError, match="computes in its parameters' dtype"):
    model_source("tunix:llama3p1_8b", compute_dtype="bfloat16")  # float32 parameters, no dtype field
  with pytest.raises(PlanError, match="apply to tunix: models"):
    model_source("tests.support.planner_toys:tiny_lm", param_dtype="bfloat16")


@pytest.mark.parametrize("argv, words", [
    (["--levers", "zero3"], "unknown lever zero3"),
    (["--topology", "h300:8"], "unknown topology 'h300:8'"),
    (["--model", "no_colon"], "unknown model 'no_colon'"),
    (["--mesh", "data=three"], "--mesh entry 'data=three'"),
    (["--steps", "one,fused"], "unknown step fused; steps: one, split"),
    (["remat_policy=full"], "config overrides (key=value) apply to maxtext: models"),
    (["--model", "maxtext:qwen3-0.6b", "--steps", "one"], "as two programs: --steps split"),
    (["--mesh", "dta=4"], "unknown --mesh axis dta; axes the model names or the planner splits over: "
                          "replica, data"),
    (["--levers", "zero1-master"], f"--levers zero1-master does not apply to {TOYS}:tiny_lm: "
                                   "zero1-master keeps float32 copies of narrower parameters"),
    (["--model", "tests.support.planner_toys:tiny_lm_bf16", "--levers", "zero1,zero1-bf16state"],
     "zero1-bf16state stores the state in bfloat16; for bfloat16 parameters it is bfloat16 already"),
    # A lever that would send the bytes of another: refused before anything compiles, as bf16state is.
    *[(["--model", f"{TOYS}:tiny_lm_bf16", "--slices", "2", "--levers", f"zero1-{lever}"],
       f"--levers zero1-{lever} does not apply to {TOYS}:tiny_lm_bf16: zero1-{lever} sends float32 gradients "
       "across slices or nodes in bfloat16; bfloat16 parameters' gradients cross in bfloat16 already")
      for lever in ("accum-bf16across", "pod-accum-bf16across")],
    # The int8 levers narrow only what crosses: one slice has nothing across to narrow.
    *[(["--levers", f"zero1-{lever}"], f"--levers zero1-{lever} does not apply to {TOYS}:tiny_lm: "
       f"zero1-{lever} narrows what crosses between slices or nodes; this target is one")
      for lever in ("accum-int8across", "pod-accum-int8across", "pod-master-accum-int8across")],
    (["--remat", "block"], "--remat apply to tunix: models"),
    (["--margin", "1.5"], "--margin is the share of the memory to leave free"),
    (["--full-depth"], "--full-depth: whole programs are the default; leave the flag out"),
    # Pods: each wrong --slices its own answer, GPU nodes said one way, replica across the slices or nodes.
    (["--slices", "0"], "--slices 0: the number of TPU slices joined over the data-center network, 1 or "
                        "more"),
    (["--topology", "h100:8", "--slices", "2"], "--slices 2 joins TPU slices; GPU nodes are in the topology: "
                                                "for 2 nodes of 8 GPUs, --topology h100:2x8"),
    (["--topology", "h100:8x2"], "h100:8x2 reads as 8 nodes of 2 GPUs, fewer than an H100 node's 8: did you "
                                 "mean h100:2x8? For nodes of 2 GPUs, say --gpus-per-node 2"),
    (["--topology", "h100:2x8", "--gpus-per-node", "4"], "--gpus-per-node 4 does not match h100:2x8"),
    (["--gpus-per-node", "8"], "--gpus-per-node is for GPU nodes; v6e:2x2 is a TPU slice"),
    (["--topology", "h100:2x8", "--mesh", "data=8,replica=2"],
     "--mesh data=8,replica=2: on 2 nodes, replica must be the outermost axis, its size the number of nodes; "
     "the devices are laid out in the mesh's order, so only then does it cross them: "
     "--mesh replica=2,data=8"),
    (["--slices", "2", "--mesh", "replica=4,data=2"], "on 2 slices, replica must be the outermost axis"),
    (["--mesh", "replica=2,data=2"], "--mesh replica=2,data=2: replica runs across TPU slices or GPU nodes, "
                                     "and this target is one"),
    # A builder of the user's own that raises: one line naming it and its exception.
    (["--model", f"{TOYS}:tiny_lm_that_raises"], f"the model builder {TOYS}:tiny_lm_that_raises raised "
                                                  "ValueError: vocab must be even, got 511 (num_layers=6) "
                                                  "(--traceback shows where)"),
])
def test_bad_inputs_exit_2_with_one_line(capsys, argv, words):
  args = ["--model", "tests.support.planner_toys:tiny_lm", "--topology", "v6e:2x2", *argv]
  assert main(args) == 2
  err = capsys.readouterr().err.strip()
  assert words in err and "\n" not in err


def test_a_model_module_not_on_the_path_says_which_folder_to_put_on_pythonpath(tmp_path, monkeypatch):
  from nnx_zero1_plan.models import model_source

  (tmp_path / "work" / "moe_pkg").mkdir(parents=True)
  (tmp_path / "work" / "moe_pkg" / "__init__.py").write_text("")
  monkeypatch.chdir(tmp_path)
  with pytest.raises(PlanError, match=re.escape(
      "unknown model moe_pkg.model:build: No module named 'moe_pkg'; the planner imports moe_pkg by name: "
      f"put the folder that holds moe_pkg/ (or moe_pkg.py) on PYTHONPATH (PYTHONPATH={tmp_path / 'work'})")):
    model_source("moe_pkg.model:build")
  # A missing import of the model's own module is the module's, not the path's: said as Python says it.
  (tmp_path / "needs.py").write_text("import not_installed_anywhere\ndef build(): pass\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  with pytest.raises(PlanError) as e:
    model_source("needs:build")
  assert "No module named 'not_installed_anywhere'" in str(e.value) and "PYTHONPATH" not in str(e.value)


def test_traceback_shows_where_a_builder_raised_above_its_one_line(capsys):
  assert main(["--model", f"{TOYS}:tiny_lm_that_raises", "--topology", "v6e:2x2", "--traceback"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err[0] == "Traceback (most recent call last):"
  assert 'raise ValueError(f"vocab must be even' in "\n".join(err)
  assert err[-1].startswith(f"nnx_zero1.plan: the model builder {TOYS}:tiny_lm_that_raises raised ValueError")


def test_the_default_micro_batch_splits_over_the_whole_pod_and_replica_crosses_it():
  from nnx_zero1_plan.mesh_axes import check_replica, micro_batch

  # At least 8 sequences, rounded up to a multiple of the unit (3 -> 9).
  assert [micro_batch(None, unit, "data") for unit in (1, 3, 4, 8, 12, 64)] == [8, 9, 8, 8, 12, 64]
  assert micro_batch(16, 8, "data") == 16
  with pytest.raises(PlanError, match=re.escape("--batch 8 does not split over the batch axes (replica x "
                                                "data = 64 devices): give a multiple of 64, or leave --batch "
                                                "out for 64")):
    micro_batch(8, 64, "replica x data")
  # The default mesh on a pod: replica outermost, one slice or node each; any other is refused, with the mesh
  # that would be.
  assert mesh_axes({}, ["tp"], devices=64, domains=8) == {"replica": 8, "data": 8, "tp": 1}
  for sizes, words in (({"data": 64}, "--mesh replica=8,data=8"),
                       ({"replica": 4, "data": 16}, "replica=8,data=8"),
                       ({"data": 8, "replica": 8}, "--mesh replica=8,data=8"),
                       ({"replica": 4, "data": 2, "fsdp": 8}, "replica=8,data=1,fsdp=8")):
    with pytest.raises(PlanError, match=re.escape(words)):
      mesh_axes(sizes, [], devices=64, domains=8)
  check_replica({"replica": 8, "data": 1, "fsdp": 8}, domains=8)  # HSDP: fsdp inside each node


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
    compilers.require("jax-cuda13-plugin")
  assert "nnx-zero1[" not in compilers.install_hint("0.12.0.1")  # not on the package index


@pytest.mark.parametrize("topology, words", [("v6e:2x2", 'pip install "./planner[aot]"'),
                                              ("h100:8", "pip install --no-deps jax-cuda13-plugin==")])
def test_the_command_without_its_compiler_exits_2_with_the_install_line(monkeypatch, capsys, topology, words):
  monkeypatch.setattr(compilers.importlib.util, "find_spec", lambda name: None)
  assert main(["--model", "tests.support.planner_toys:tiny_lm", "--topology", topology]) == 2
  err = capsys.readouterr().err.strip()
  assert words in err and "\n" not in err


def test_extrapolation_is_the_line_through_two_depths():
  assert extrapolate(110, 120, 1, 2, 28) == 380
  assert extrapolate(100, 140, 2, 4, 6) == 180
  ag = lambda count, n: {"per_step": {"all-gather": {"count": count, "bytes": n}}}
  r1 = Figures(temp_bytes_per_device=10, collectives=ag(1, 10))
  r2 = Figures(temp_bytes_per_device=14, peak_bytes_per_device=3, collectives=ag(3, 14))
  names = ("temp_bytes_per_device", "peak_bytes_per_device", "collectives")
  r = extrapolate_row(r1, r2, 2, 4, 8, names)
  assert r == Figures(temp_bytes_per_device=22, peak_bytes_per_device=None, collectives=ag(7, 22))
  ar = lambda n: Figures(collectives={"per_step": {"all-reduce": {"count": n, "bytes": 10 * n}}})  # noqa: E731
  counted = extrapolate_row(ar(3), ar(5), 1, 2, 4, ("collectives",)).collectives  # records, field by field
  assert counted.per_step == {"all-reduce": OpCount(count=9, bytes=90)}
  with pytest.raises(ValueError):
    extrapolate(1, 2, 4, 2, 8)


def test_depths_whose_temp_or_peak_fall_are_not_extrapolated():
  from nnx_zero1_plan.estimate import not_alike

  g = 2**30
  assert not_alike(3 * g, 2 * g, 2, 4) == "the temp fell from 3.00 GiB at 2 layers to 2.00 GiB at 4"
  # llama3p1_70b, Zero-1 across two v5p slices: the peaks at 2 and 4 layers (37.65, 37.26 GiB)
  assert not_alike(int(37.65 * g), int(37.26 * g), 2, 4, "peak").startswith("the peak fell from 37.65 GiB")
  assert not_alike(2 * g, 2 * g, 2, 4) is None and not_alike(None, g, 2, 4) is None


def _row(lever, peak, **kw):
  return make_row(lever, compiled_for="v5e:2x4", mesh={"data": 8}, opt_state_bytes_per_device=2**30,
                  argument_bytes_per_device=peak // 2, temp_bytes_per_device=peak // 2,
                  peak_bytes_per_device=peak,
                  fits=peak <= 16 * 2**30, compile_s=3.0, collectives={}, **kw)


def test_the_table_and_what_to_try_next_when_nothing_fits():
  from nnx_zero1_plan.estimate import estimate_mark

  mark = estimate_mark(28, [2, 4], ["peak_bytes_per_device"])
  estimated = _row("zero1", 17 * 2**30, made=Made(depth=28, depth_extrapolated_from=[2, 4], estimate=mark,
                                                   fits_estimate=False))
  estimated = dataclasses.replace(estimated, fits=None)
  rows = [_row("baseline", 20 * 2**30), estimated]
  lines = table(rows).splitlines()
  assert lines[0].split()[:3] == ["lever", "step", "compiled"]
  # Every figure of an estimate is marked, and its note says it decides nothing and how far off it has been.
  assert "~ ESTIMATE, extrapolated to 28 layers from 2/4: decides nothing" in lines[3] and "1.36x" in lines[3]
  assert lines[3].split()[6:10] == ["~8.50", "~8.50", "~17.00", "~-"] and "~NO" in lines[3].split()
  request = PlanRequest("tunix:qwen3_8b", "v5e:2x4", steps="one").resolved({"data": 8, "fsdp": 1}, 32)
  blocked = {"zero1-master": "float32 already", "zero1-pod": "one slice"}
  steps = next_steps(rows, request, list(LEVERS), blocked=blocked, remat="decoder", batch_unit=8,
                     named_axes=["fsdp"])
  at = "python -m nnx_zero1.plan --model tunix:qwen3_8b --topology v5e:2x4 --mesh data=8,fsdp=1 --batch"
  assert steps[0] == f"the lever zero1-accum: {at} 32 --seq-len 1024 --ga 1 --levers zero1-accum --steps one"
  assert not [s for s in steps if "zero1-master" in s]  # a lever that cannot apply is not offered
  # Nor one that adds memory (float32 masters), where it would apply: nothing fits, so only what makes room.
  bf16 = next_steps(rows, request, list(LEVERS), blocked={}, remat=None, batch_unit=8)
  offered = {s.split(":")[0].removeprefix("the lever ") for s in bf16 if s.startswith("the lever ")}
  masters = {"zero1-master", "zero1-pod-master-accum", "zero1-pod-master-accum-int8across"}
  assert offered and not offered & masters, offered
  # Nor the baseline where a Zero-1 lever was refused: it holds the whole state on every device.
  after_zero1 = next_steps([_row("zero1", 17 * 2**30)], request, list(LEVERS), blocked={}, remat=None,
                           batch_unit=8)
  assert after_zero1 and not [s for s in after_zero1 if s.startswith("the lever baseline")], after_zero1
  # Nor a lever that only narrows what crosses the slow network, where its plain twin was refused.
  after_accum = next_steps([_row("zero1-accum", 17 * 2**30)], request, list(LEVERS), blocked={}, remat=None,
                           batch_unit=8)
  assert not [s for s in after_accum if s.startswith("the lever zero1-accum-")], after_accum
  assert [s for s in after_accum if s.startswith("the lever zero2:")], after_accum
  assert steps[-3].startswith("zero1 comes closest, 1.00 GiB over") and "--mesh data=4,fsdp=2" in steps[-3]
  assert steps[-2].startswith("remat (recomputes") and steps[-2].endswith("--remat decoder")
  assert steps[-1].startswith("half the micro-batch") and f"{at} 16 --seq-len 1024 --ga 2" in steps[-1]
  # Half of 8 sequences does not split over 8 devices; a model with no --remat is not offered one.
  steps = next_steps(rows, dataclasses.replace(request, batch=8), list(LEVERS), blocked=blocked, remat=None,
                     batch_unit=8)
  assert not [s for s in steps if s.startswith(("half", "remat"))]
  # After the compiler refused every program: the smaller micro-batch still.
  refused = [make_row("baseline", fits=False, error="RESOURCE_EXHAUSTED")]
  steps = next_steps(refused, request, ["baseline"], blocked={}, remat=None, batch_unit=8)
  assert steps == ["half the micro-batch, twice the accumulation (the same tokens per step; the compiler "
                   f"refused every program at this micro-batch): {at} 16 --seq-len 1024 --ga 2 --levers "
                   "baseline --steps one"]
  assert next_steps([_row("zero1", 2**30)], request, list(LEVERS), blocked={}, remat=None, batch_unit=8) == []


def test_on_one_data_parallel_device_a_lever_that_only_splits_is_not_offered_and_says_why():
  """At data-parallel size 1 zero1, zero1-accum and zero2 split nothing: not offered as a way out (they save
  0.00 GiB), one line says why; offload and bf16 state still make room and are offered."""
  rows = [make_row("baseline", compiled_for="v5e:1x1", mesh={"data": 1}, opt_state_bytes_per_device=2**30,
                   peak_bytes_per_device=17 * 2**30, temp_bytes_per_device=8 * 2**30, fits=False)]
  request = PlanRequest("m.models:build", "v5e:1x1", steps="one").resolved({"data": 1}, 46)
  steps = next_steps(rows, request, list(LEVERS), blocked={}, remat=None, batch_unit=1)
  offered = {s.split(":")[0].removeprefix("the lever ") for s in steps if s.startswith("the lever ")}
  assert {"offload", "zero1-bf16state"} <= offered and not offered & {"zero1", "zero1-accum", "zero2"}, steps
  assert not [s for s in steps if "saves 0.00 GiB" in s]
  said = [s for s in steps if s.startswith("not offered: ")]
  named = said[0].removeprefix("not offered: ").split(" (")[0].split(", ")
  assert len(said) == 1 and {"zero1", "zero1-accum", "zero2"} <= set(named), said
  assert said[0].endswith("over axes of size 1 on this mesh: they save nothing here)")
  wide = PlanRequest("m.models:build", "v5e:2x2", steps="one").resolved({"data": 4}, 46)
  assert "zero1" in {s.split(":")[0].removeprefix("the lever ")
                     for s in next_steps(rows, wide, list(LEVERS), blocked={}, remat=None, batch_unit=4)}


def test_the_request_is_checked_once_normalised_and_crosses_as_json():
  from nnx_zero1_plan import PlanRequest

  request = PlanRequest("tunix:qwen3_0p6b", "v6e:2x2", levers="baseline, zero1", steps=["one"],
                        remat="none,block", overrides=None, search=True, margin=0.0)
  assert request.levers == ("baseline", "zero1") and request.steps == ("one",)
  assert request.policies == ("none", "block") and request.platform == "tpu"
  assert PlanRequest.from_json(request.to_json()) == request
  assert PlanRequest("maxtext:qwen3-0.6b", "v6e:2x2").steps == ("split",)
  refused = [({"batch": 0}, "--batch, --seq-len and --ga must be >= 1"), ({"margin": 1.0}, "--margin is the"),
             ({"gpu_memory_fraction": 0}, "in \\(0, 1\\]"), ({"optimizer": "adamx"}, "unknown optimizer"),
             ({"levers": "zero3"}, "unknown lever zero3"), ({"overrides": {"a": "b"}}, "apply to maxtext:"),
             ({"topology": "h999:8"}, "unknown topology"), ({"remat": "block"}, "builds its own")]
  for bad, words in refused:
    with pytest.raises(PlanError, match=words):
      PlanRequest(**{"model": f"{TOYS}:tiny_lm", "topology": "v6e:2x2", **bad})


def test_plan_from_python_refuses_in_this_process_and_raises_the_planning_processes_errors():
  import os

  from nnx_zero1_plan import plan

  environ = dict(os.environ)
  with pytest.raises(PlanError, match="unknown lever"):
    plan(f"{TOYS}:tiny_lm", "v6e:2x2", levers="zero3")  # the request's check: no process is started
  with pytest.raises(TypeError, match="needs a topology"):
    plan(f"{TOYS}:tiny_lm")
  # A float32 model cannot take float32 masters: found by the planning process from the model, raised here.
  lines: list[str] = []
  with pytest.raises(PlanError, match="zero1-master"):
    plan(f"{TOYS}:tiny_lm", "v6e:2x2", levers="zero1-master", steps="one", progress=lines.append)
  assert dict(os.environ) == environ


def test_the_reproduce_command_carries_every_setting_that_changes_the_plan():
  from nnx_zero1_plan import parse_args, request_of

  planned = PlanRequest("tunix:llama3p2_1b", "h100:4x4", mesh="replica=4,data=4", batch=16, levers="zero1",
                        steps="one", gpus_per_node=4, tunix_sharding='{"act_btd": [["data"], null, "tp"]}')
  line = command_line(planned)
  assert "--gpus-per-node 4" in line and "--tunix-sharding" in line
  request = request_of(parse_args(shlex.split(line)[3:]))  # what it reproduces is what was planned
  assert request == planned
  # A MaxText override's value with a space or a bracket is quoted, so the shell hands it over whole.
  maxtext = PlanRequest("maxtext:qwen3-0.6b", "v5e:2x4", mesh="data=8", batch=8, steps="split",
                        overrides={"run_name": "my run", "remat_policy": "minimal"})
  line = command_line(maxtext)
  assert line.endswith(" 'run_name=my run' remat_policy=minimal")
  assert request_of(parse_args(shlex.split(line)[3:])) == maxtext


def test_a_rows_note_says_what_its_layout_splits_and_what_an_accum_lever_holds_more():
  from nnx_zero1_plan.cells import accumulation_note, split_words
  from nnx_zero1_plan.row import StateSplit

  assert (split_words("zero1-pod", StateSplit(["replica", "data"], {"data": 0.998, "none": 0.002}))
          == "splits 0% of the state over replica,data, 99.8% over data only")
  assert split_words("zero1", StateSplit(["data"], {"data": 0.999, "none": 0.001})) is None

  def row(lever, peak, temp):
    f = Figures(peak_bytes_per_device=peak * 2**30, temp_bytes_per_device=temp * 2**30)
    return Row(lever, "one", "v5e:2x4", "TPU", {"data": 8}, "m", 16, f, Made(depth=2), 1, 1, True)

  rows = [row("zero1", 14.75, 4.5), row("zero1-accum", 19.0, 8.75)]
  assert accumulation_note(rows[1], rows) == (
      "needs 4.25 GiB more than zero1 at this micro-batch: its temporaries +4.25 GiB (the gradients it "
      "reduces once per step, held across the micro-batch loop: with one micro-batch, plan zero1)")
  assert accumulation_note(rows[0], rows) is None


def test_a_pods_table_has_each_networks_bytes_and_time_before_the_note():
  """A pod's rows (``network_per_step``) add two columns before the note, in plan.md's table and the
  terminal's: each network's name, MiB per step and its estimated time; other plans have neither."""
  nets = lambda fast, slow: {"fast": {"network": "ICI", "bytes": fast * 2**20, "estimate_ms": 0.5},
                             "slow": {"network": "DCN", "bytes": slow * 2**20, "estimate_ms": None},
                             "source": None}
  rows = [_row("baseline", 8 * 2**30, made=Made(depth=2, network_per_step=nets(3, 2))),
          _row("zero1-pod", 6 * 2**30, made=Made(depth=2, network_per_step=nets(4, 1.5)))]
  wide = table(rows).splitlines()
  assert "inside slice/node per step, MiB (est.)  over the slow network per step, MiB (est.)" in wide[0]
  assert wide[0].split("  ")[-1].strip() == "note"
  assert re.search(r"ICI 3\.0 \(~0\.5 ms\)\s+DCN 2\.0$", wide[2]), wide[2]
  assert re.search(r"ICI 4\.0 \(~0\.5 ms\)\s+DCN 1\.5$", wide[3]), wide[3]
  compact = table(rows, wide=False).splitlines()
  assert "inside, MiB (est.)  across, MiB (est.)" in compact[1]
  assert re.search(r"ICI 4\.0 \(~0\.5 ms\)\s+DCN 1\.5\s+3$", compact[4]), compact[4]
  plain = [dataclasses.replace(r, made=Made(depth=2)) for r in rows]
  assert "MiB (est.)" not in table(plain) and "MiB (est.)" not in table(plain, wide=False)
  assert "DCN" not in table(plain)


def test_every_kept_plans_rows_read_into_typed_records_and_write_back_the_same_fields():
  kept = sorted((Path(__file__).resolve().parents[2] / "docs" / "data").glob("**/plan.json"))
  assert len(kept) >= 10
  notes = {f.name for f in dataclasses.fields(Made) if f.metadata.get("only_when_set")}
  for path in kept:
    record = json.loads(path.read_text())
    for row, written in zip(Plan.from_json(record).rows, record["rows"], strict=True):
      # A run measured before its memory figure was named for what it holds wrote it as peak_bytes.
      written = {**written, "measured": [{("held_bytes" if k == "peak_bytes" else k): v for k, v in m.items()}
                                         for m in written["measured"]]} if "measured" in written else written
      # A MaxText row planned before its depth was recorded says it in its config.
      assert row.made.depth or row.figures.maxtext_config.num_decoder_layers
      assert row.figures.peak_bytes_per_device == written["peak_bytes_per_device"]
      again = row.to_json()
      # Every field of the kept row comes back with its value (a note that says nothing is left out), and the
      # depth always: a row compiled whole says so (depth_extrapolated_from None).
      assert {k: v for k, v in written.items() if not (k in notes and v is None)} == {
          k: again[k] for k in written if k in again}, path
      assert again["depth"] == written["depth"] and again["depth_extrapolated_from"] is None
      # Byte for byte: the kept keys in their order, each typed record (collectives, state_split, hbm_oom,
      # maxtext_config, network_per_step, estimate) writing the object the kept plan holds.
      kept_keys = [k for k in written if k in again]
      assert json.dumps([again[k] for k in kept_keys]) == json.dumps([written[k] for k in kept_keys]), path
      f = row.figures
      typed = (f.collectives, f.state_split, f.hbm_oom, f.maxtext_config, row.made.network_per_step,
               row.made.estimate)
      assert not any(isinstance(record, dict) for record in typed), path
      assert Row.from_json(json.loads(json.dumps(again))) == row
  written = json.loads(kept[0].read_text())["rows"][0]
  with pytest.raises(KeyError, match="peak_gib"):  # a field no record has: another planner's plan.json
    Row.from_json({**written, "peak_gib": 1.0})


def test_every_kept_plans_meta_reads_into_its_record_and_writes_back_byte_for_byte():
  kept = sorted((Path(__file__).resolve().parents[2] / "docs" / "data").glob("**/plan.json"))
  absent = set()
  for path in kept:
    written = json.loads(path.read_text())["meta"]
    settings = PlanSettings.from_json(written)
    assert settings.request.batch == written["batch"] and settings.request.mesh_sizes == written["mesh"], path
    # The same keys in the same order, each value as it was: plan.json's meta written again is the same text.
    assert json.dumps(settings.to_json(), indent=1) == json.dumps(written, indent=1), path
    assert PlanSettings.from_json(json.loads(json.dumps(settings.to_json()))) == settings
    # A key an older planner did not write is said absent, not made up.
    assert settings.absent == set(ADDED_LATER) - set(written), path
    absent |= settings.absent
  assert absent == set(ADDED_LATER)  # each is absent from some kept plan: none is listed for nothing
  with pytest.raises(KeyError, match="peak_gib"):
    PlanSettings.from_json({**written, "peak_gib": 1.0})
  with pytest.raises(KeyError, match="usable_bytes"):  # only the keys added later may be missing
    PlanSettings.from_json({k: v for k, v in written.items() if k != "usable_bytes"})


def test_plan_json_is_written_from_typed_values_and_an_unexpected_value_raises(tmp_path):
  # No default=str: a kept plan writes back as it was read, and a value JSON has no type for (here the
  # parameters' dtypes as the model holds them, a set) is a TypeError, never a string in plan.json.
  kept = sorted((Path(__file__).resolve().parents[2] / "docs" / "data").glob("**/plan.json"))[0]
  record = json.loads(kept.read_text())
  plan = Plan.from_json(record)
  plan.write(str(tmp_path / "again"))
  assert Plan.from_json(json.loads((tmp_path / "again" / "plan.json").read_text())) == plan
  with pytest.raises(TypeError, match="frozenset"):
    untyped = dataclasses.replace(plan.meta, param_dtypes=frozenset({"bfloat16"}))
    dataclasses.replace(plan, meta=untyped).write(str(tmp_path / "untyped"))


def test_every_collective_the_one_reader_counts_has_a_table_cell():
  # A row's collectives hold whatever kind the one reader of a program counts (a zero2 step's
  # collective-permute among them), and the table names each; a kind without a name failed the whole plan.
  from nnx_zero1._src.hlo import COLLECTIVE_OPS
  from nnx_zero1_plan.cells import collective_cell

  kinds = (*COLLECTIVE_OPS, "to-host", "to-device")
  cell = collective_cell({op: {"count": 1, "bytes": 2**20} for op in kinds})
  assert cell == "AR 1x 1.000, RS 1x 1.000, AG 1x 1.000, A2A 1x 1.000, CP 1x 1.000, out 1x 1.000, in 1x 1.000"
  assert collective_cell({"all-reduce": {"count": 2, "bytes": 2**20}, "all-gather": {"count": 0, "bytes": 0}}
                         ) == "AR 2x 1.000"  # a kind that never ran is left out


def test_docs_say_what_every_field_of_a_plan_json_row_holds():
  # docs/planner.md's "What a row says" is where each field of a row is explained (the records point there):
  # every field a row writes has its line, and every name there is a field.
  from nnx_zero1_plan.row import Row, _keys
  from tests.support.docs_tables import table_under

  known = _keys(Row)
  named = {name for fields, _ in table_under("docs/planner.md", "| field |")
           for name in re.findall(r"`(\w+)`", fields)}
  assert named <= known, sorted(named - known)
  assert known <= named, sorted(known - named)


def test_docs_say_what_every_part_of_a_step_time_holds():
  from nnx_zero1_plan.row import StepTime
  from tests.support.docs_tables import table_under

  named = {name for fields, _ in table_under("docs/planner.md", "| `step_time` field |")
           for name in re.findall(r"`(\w+)`", fields)}
  assert named == {f.name for f in dataclasses.fields(StepTime)}


def test_docs_say_what_every_lever_is():
  # LEVERS holds how each lever is built; what each is for is docs/planner.md's --levers row alone.
  from tests.support.docs_tables import table_under

  (said,) = [words for flag, words in table_under("docs/planner.md", "| flag |") if flag == "`--levers`"]
  named = set(re.findall(r"`([\w-]+)`", said))
  assert set(LEVERS) <= named, set(LEVERS) - named
