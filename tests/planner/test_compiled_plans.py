"""``python -m nnx_zero1.plan`` with the real compilers: a tiny model planned for a TPU slice and for
8 H100s (CI lane 2, which installs libtpu and XLA's GPU compiler; a lane without one skips each test
with the reason)."""


import importlib.util
import json
import math
import pathlib
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from nnx_zero1 import zero1_sharding
from tests.support.compiled_plans import (
  HAS_GPU_COMPILER,
  HAS_LIBTPU,
  HAS_MAXTEXT,
  TOY,
  TOYS,
  planner_env,
  run_plan,
)
from tests.support.planner_toys import tiny_lm


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
    assert r["fits"] == (r["peak_bytes_per_device"] <= r["usable_bytes"])
    assert r["headroom_bytes_per_device"] == r["usable_bytes"] - r["peak_bytes_per_device"]
    assert set(r["collectives"]) == {"per_step", "per_micro_batch", "sent_per_step"}
    assert (r["update_peak_bytes_per_device"] is None) == (r["step"] == "one")
  return rows


@pytest.mark.skipif(not HAS_LIBTPU, reason="needs libtpu: ./planner[aot], Python >= 3.12 (CI lane 2)")
def test_tpu_plan_saves_what_the_layout_rule_predicts_and_marks_an_estimate(tmp_path):
  full = run_plan(tmp_path / "full", "--topology", "v6e:2x2", "--steps", "one,split")  # whole: the default
  rows = _check_rule_and_fits(full, data=4)
  assert full["meta"]["hbm_bytes"] == 33_543_694_581  # v6e: 31.24G, as the TPU compiler words it
  # The split step's update program: Zero-1 updates a quarter of each moment and parameter per chip.
  flops = [rows[lever, "split"]["update_flops_per_device"] for lever in ("baseline", "zero1")]
  assert 0 < flops[1] < flops[0] / 2
  # Every compiled row says how fast: the TPU compiler's cycles, walked; tokens per second follow from it.
  for r in full["rows"]:
    t = r["step_time"]
    assert r["predicted_step_s"] > t["compute_s"] > 0 and t["source"].startswith("the TPU compiler's")
    assert r["tokens_per_s_per_device"] == pytest.approx(8 * 64 / 4 / r["predicted_step_s"])
    assert 0 < r["mfu"] < 1 and t["fast_s"] > 0 and t["unestimated_ops"] == 0
  reduced = run_plan(tmp_path / "reduced", "--topology", "v6e:2x2", "--steps", "one", "--estimate")
  assert reduced["recommendation"] is None  # nothing is recommended from an estimate
  one_program = [r for r in full["rows"] if r["step"] == "one"]
  for a, b in zip(one_program, reduced["rows"], strict=True):
    assert b["depth_extrapolated_from"] == [2, 4] and b["depth"] == 6
    assert b["estimate"]["method"] == "extrapolated to 6 layers from 2/4" and "peak_bytes_per_device" in (
        b["estimate"]["figures"])
    assert b["fits"] is None and b["fits_estimate"] == a["fits"]
    assert b["argument_bytes_per_device"] == a["argument_bytes_per_device"]  # parameters are linear in depth
    error = abs(b["peak_bytes_per_device"] - a["peak_bytes_per_device"]) / a["peak_bytes_per_device"]
    print(f"{a['lever']}: extrapolated peak {b['peak_bytes_per_device']:,} B, "
          f"compiled {a['peak_bytes_per_device']:,} B ({error:.2%})")
    assert error < 0.05


@pytest.mark.skipif(not HAS_LIBTPU, reason="needs libtpu: ./planner[aot], Python >= 3.12 (CI lane 2)")
def test_a_global_batch_is_split_into_the_micro_batch_and_ga_that_fit_and_train_fastest(tmp_path):
  # 32 sequences a step on v5e:2x2 (a unit of 4): 32 fits the toy; a smaller split is compiled only while
  # faster. The row says its split; the recommendation's command reproduces it and its code says it.
  without_batch = [a for a in TOY if a not in ("--batch", "8")]
  result = run_plan(tmp_path, "--topology", "v5e:2x2", "--global-batch", "32", "--levers", "zero1", "--steps",
                    "one", toy=without_batch)
  (row,) = result["rows"]
  assert row["batch"] * row["ga"] == 32 and row["batch"] % 4 == 0 and row["fits"]
  best = result["recommendation"]
  assert best["micro_batch"] == row["batch"]
  assert f"--batch {row['batch']} --seq-len 64 --ga {row['ga']}" in best["cli"]
  assert f"# micro-batch {row['batch']} x GA {row['ga']} = 32 sequences a step" in best["code"]
  assert result["meta"]["global_batch"] == 32

@pytest.mark.skipif(not HAS_GPU_COMPILER, reason="needs XLA's GPU compiler: pip install --no-deps "
                    "jax-cuda13-plugin==0.12.0.1 jax-cuda13-pjrt==0.12.0.1 (Python >= 3.12), CI lane 2")
def test_gpu_plan_saves_what_the_layout_rule_predicts(tmp_path):
  result = run_plan(tmp_path, "--topology", "h100:8", "--steps", "one,split")
  rows = _check_rule_and_fits(result, data=8)
  assert rows["zero1", "split"]["update_flops_per_device"] is None  # XLA's GPU compiler has no cost analysis
  # ... so a step's compute is its matmuls counted from the HLO: per GPU, one sequence of 64 tokens through 7
  # square 512 x 512 matmuls (6 layers and the head), forward and twice that backward.
  for lever in ("baseline", "zero1"):
    assert rows[lever, "one"]["flops_source"] == rows[lever, "split"]["flops_source"] == "hlo_dots"
    assert rows[lever, "one"]["flops_per_device"] == rows[lever, "split"]["flops_per_device"] == (
        3 * 2 * 64 * 512 * 512 * 7)
  assert result["rows"][0]["device_kind"] == "NVIDIA H100 80GB HBM3"
  # A GPU row's time: XLA's GPU scheduler's own estimates where it scheduled the program (one with
  # collectives); the baseline's split update has none to schedule, and says so.
  for r in result["rows"]:
    if (r["lever"], r["step"]) == ("baseline", "split"):
      assert "dumped no estimates" in r["time_absent"] and r["step_time"] is None
      assert r["predicted_step_s"] is None
    else:
      assert r["predicted_step_s"] >= r["step_time"]["compute_s"] > 0 and r["time_absent"] is None, r["lever"]
      assert r["step_time"]["source"].startswith("XLA's GPU cost model")
  # jax's GPU pool at its default 0.75 of what the CUDA context leaves, less the GPU's 256 MiB reserve
  assert result["meta"]["hbm_bytes"] == int(0.75 * (84_929_347_584 - 643_476_139))
  assert result["meta"]["usable_bytes"] == result["meta"]["hbm_bytes"] - 256 * 2**20


_MATMULS = """
import json, tempfile
from nnx_zero1_plan import compilers
compilers.start_cpu_jax()
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from nnx_zero1_plan.gpu_matmuls import bfloat16_result_seconds, float32_result_matmuls, tensor_core_priced
from nnx_zero1_plan.gpu_schedule import dump_options, scheduled_seconds
from nnx_zero1_plan.program_record import ProgramRecord
from nnx_zero1_plan.targets import make_target

devices = make_target("h100:8").devices
mesh = Mesh(np.array(devices), ("data",))
a = jax.ShapeDtypeStruct((8, 2048, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))
b = jax.ShapeDtypeStruct((8, 1024, 2048), jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))
step = lambda x, y: jnp.einsum("bmk,bkn->bmn", x, y, preferred_element_type=jnp.float32).sum()
with tempfile.TemporaryDirectory() as folder:
  record = ProgramRecord.read(jax.jit(step).lower(a, b).compile(dump_options(folder)).as_text())
  scheduled = scheduled_seconds(folder)
(name, matmul), = float32_result_matmuls(record).items()
priced = tensor_core_priced(scheduled, [record], devices)
print("RESULT " + json.dumps({"matmul": matmul, "scheduled": scheduled[record.module][name],
                              "priced": priced[record.module][name],
                              "bf16": bfloat16_result_seconds(matmul, tuple(devices))}))
"""


@pytest.mark.skipif(not HAS_GPU_COMPILER, reason="needs XLA's GPU compiler (CI lane 2)")
def test_a_bfloat16_matmul_with_a_float32_result_is_priced_as_the_tensor_cores_run_it():
  proc = subprocess.run([sys.executable, "-c", _MATMULS], env=planner_env(), capture_output=True, text=True,
                        timeout=400)
  assert proc.returncode == 0, proc.stderr[-3000:]
  (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
  got = json.loads(line[len("RESULT "):])
  # One GPU's share of the einsum (its batch of one squeezed away by the compiler).
  assert got["matmul"] == [[2048, 1024], [1024, 2048], [[[1], [0]], [[], []]]]
  flops = 2 * 2048 * 1024 * 2048
  # XLA's tables have no bf16 x bf16 -> f32 entry: the scheduler prices it far below a tensor core's rate,
  # and the same matmul with a bf16 result at one; that price replaces the other.
  assert flops / got["scheduled"] < 50e12 < 200e12 < flops / got["bf16"]
  assert got["priced"] == got["bf16"]


_ACCOUNTING = """
import json
from nnx_zero1_plan import compilers
compilers.start_cpu_jax()
import numpy as np
from jax.sharding import AxisType, Mesh
from nnx_zero1_plan.levers import LEVERS
from nnx_zero1_plan.models import model_source
from nnx_zero1_plan.request import PlanRequest
from nnx_zero1_plan.run import make_plan
from nnx_zero1_plan.steps import compile_step, lever_state
from nnx_zero1_plan.targets import make_target

plan = make_plan(PlanRequest("tests.support.planner_toys:tiny_lm", "v6e:2x2", batch=8, seq_len=64,
                             levers="zero1", steps="one"))
source = model_source("tests.support.planner_toys:tiny_lm")
mesh = Mesh(np.array(make_target("v6e:2x2").devices), ("data",), axis_types=(AxisType.Auto,))
state = lever_state(LEVERS["zero1"], lambda: source.build(None), "adamw", mesh)
stats = compile_step(LEVERS["zero1"], state, source.loss_fn, mesh, 8, 64, 1)[0].memory_analysis()
# A lone reduce-scatter of 64 MB over the four chips, as Zero-1's gradients take it: how the compiler runs it.
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
scatter = jax.jit(jax.shard_map(lambda x: jax.lax.psum_scatter(x.reshape(-1), "data", tiled=True), mesh=mesh,
                                in_specs=P("data"), out_specs=P("data"), check_vma=False))
lone = scatter.lower(jax.ShapeDtypeStruct((4, 2**24), jnp.float32, sharding=NamedSharding(mesh, P("data")))
                     ).compile().as_text()
print("RESULT " + json.dumps({"row": plan.rows[0].to_json(), "total": stats.total_allocation_bytes,
      "xla_peak": stats.peak_memory_in_bytes,
      "formula": stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
                 + stats.temp_size_in_bytes,
      "lone_scatter": [ln for ln in lone.splitlines() if "all-reduce(" in ln or "reduce-scatter(" in ln]},
      default=str))
"""


@pytest.mark.skipif(not HAS_LIBTPU, reason="needs libtpu: ./planner[aot], Python >= 3.12 (CI lane 2)")
def test_a_tpu_row_is_the_compilers_own_accounting():
  """Zero-1's row on v6e:2x2: its peak is the TPU compiler's ``total_allocation_bytes`` (what its own
  out-of-memory check weighs), the sum of arguments and temporaries kept beside it, and no reserve is
  taken off the HBM the compiler names."""
  proc = subprocess.run([sys.executable, "-c", _ACCOUNTING], env=planner_env(),
                        capture_output=True, text=True, timeout=400)
  assert proc.returncode == 0, proc.stderr[-3000:]
  (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
  out = json.loads(line[len("RESULT "):])
  row = out["row"]
  assert row["peak_bytes_per_device"] == out["total"] > 0
  assert row["formula_peak_bytes_per_device"] == out["formula"]
  assert row["usable_bytes"] == row["hbm_bytes"] == 33_543_694_581
  assert row["fits"] is True and row["flops_per_device"] > 0
  # jax 0.10.2 (a TPU VM's) has only peak_memory_in_bytes: the same program's within 0.1 GiB of the total.
  assert abs(out["xla_peak"] - out["total"]) < 0.1 * 2**30
  # The compiler runs a lone reduce-scatter as an all-reduce on two rings and a slice, no faster ring of its
  # own (docs/accuracy.md: what the seed's programs say of Zero-1's reduce-scatter and all-gather).
  (lone,) = out["lone_scatter"]
  assert " all-reduce(" in lone and "UniDirection1DRingStrategy{colors:2" in lone


ROOT = pathlib.Path(__file__).resolve().parents[2]
_TUNIX_CONSTRAINTS = """
import json
from nnx_zero1_plan import compilers
compilers.start_cpu_jax()
import flax
always = flax.config.flax_always_shard_variable
from tunix.models.llama3 import model as llama3
flax.config.update("flax_always_shard_variable", always)  # Tunix's import turns it off; the planner scopes it
llama3.ModelConfig.llama3_tiny = classmethod(lambda cls: cls(
    num_layers=2, vocab_size=512, embed_dim=128, hidden_dim=256, num_heads=4, head_dim=32, num_kv_heads=2,
    rope_theta=10_000, norm_eps=1e-5, weight_tying=True))
import jax
from nnx_zero1_plan.request import PlanRequest
from nnx_zero1_plan.run import make_plan
from nnx_zero1_plan.steps import abstract_batch, step_jit
import nnx_zero1_plan.row_compiler as row_compiler
import nnx_zero1_plan.steps as steps

lowered = {}
compile_step = steps.compile_step
def lower_too(lever, state, loss_fn, mesh, batch, seq_len, ga, compiler_options=None):  # each row's, lowered
  tokens = abstract_batch(lever, mesh, batch, seq_len, ga)
  with jax.set_mesh(mesh):
    text = step_jit(state.graphdef, state.shardings, tokens.sharding, lever, loss_fn, ga).lower(
        state.state, tokens).as_text()
  lowered.setdefault(option, []).append(sum('{"data", "fsdp"}' in line for line in text.splitlines()
                                            if "sharding_constraint" in line))
  return compile_step(lever, state, loss_fn, mesh, batch, seq_len, ga, compiler_options)
row_compiler.compile_step = lower_too  # where a row's compile looks it up
plans = {}
CALIBRATED_ON_ONE_CHIP = "%s/docs/data/device_v5e/run7/plan_calibrate/out/plan.json"
for option in ("default", "none"):
  # The second plan also carries the calibration kept from one v5e chip (run 7): it travels to a slice.
  plan = make_plan(PlanRequest("tunix:llama3_tiny", "v5e:2x2", mesh="data=2,fsdp=2", batch=8, seq_len=64,
                               levers="baseline,zero1", steps="one", tunix_sharding=option,
                               calibration=None if option == "default" else CALIBRATED_ON_ONE_CHIP))
  plans[option] = {"meta": plan.meta.activation_sharding, "said": str(plan),
                   "rows": [[r.activation_sharding, r.figures.error, r.figures.peak_bytes_per_device,
                             r.figures.predicted_step_s, r.figures.calibrated_step_s] for r in plan.rows]}
print("RESULT " + json.dumps({"plans": plans, "lowered": lowered}))
"""


@pytest.mark.skipif(not (HAS_LIBTPU and importlib.util.find_spec("tunix")),
                    reason="needs libtpu and Tunix (Python >= 3.12, CI lane 2)")
def test_a_tunix_plan_compiles_the_models_own_activation_constraints():
  """Tunix's models constrain their activations only off a CPU; a ``tunix:`` plan compiles them as on the
  chips (a 2-layer llama3 on v5e:2x2, data=2, fsdp=2): each lever's lowered program carries the
  constraints, batch entries over data and fsdp, and the rows and meta name the specs; ``none`` compiles
  XLA's own propagation and says so."""
  proc = subprocess.run([sys.executable, "-c", _TUNIX_CONSTRAINTS % ROOT], env=planner_env(),
                        capture_output=True, text=True, timeout=400)
  assert proc.returncode == 0, proc.stderr[-3000:]
  (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
  out = json.loads(line[len("RESULT "):])
  applied = {"act_btd": [["data", "fsdp"], None, "tp"], "act_btf": [["data", "fsdp"], None, "tp"],
             "act_btnh": [["data", "fsdp"], None, "tp", None]}
  default, none = out["plans"]["default"], out["plans"]["none"]
  assert default["meta"] == applied and none["meta"] == "none"
  assert [r[0] for r in default["rows"]] == [applied] * 2 and [r[0] for r in none["rows"]] == ["none"] * 2
  assert all(r[1] is None and r[2] > 0 for r in default["rows"] + none["rows"])
  # 5 constraints a layer (q, k, v, the attention's output, the embedding's), forward and backward
  assert min(out["lowered"]["default"]) >= 10 and out["lowered"]["none"] == [0, 0]
  # A calibration made on one v5e chip times a plan of a v5e slice made here (--calibration): each row has
  # its calibrated time beside the cost model's, and the plan says which versions each ran with.
  assert all(r[4] is None for r in default["rows"]) and all(0 < r[4] and r[3] > 0 for r in none["rows"])
  assert "step ms (calib.)" in none["said"] and "calibrated on one v5e chip from 1 run" in none["said"]
  assert "it ran jax 0.10.2" in none["said"]


_UNTOUCHED = """
import json, os, sys, tempfile
environ = dict(os.environ)
tmp, logs = tempfile.gettempdir(), "/tmp/tpu_logs"
listing = lambda d: sorted(os.listdir(d)) if os.path.isdir(d) else []
before = listing(tmp), listing(logs)
from nnx_zero1_plan import plan
lines = []
result = plan("tests.support.planner_toys:tiny_lm", "v6e:2x2", batch=8, seq_len=64, levers="zero1",
              steps="one", progress=lines.append)
after = listing(tmp), listing(logs)
print("RESULT " + json.dumps({"environ": dict(os.environ) == environ, "files": after == before,
      "jax": "jax" in sys.modules, "fits": result.rows[0].fits, "lines": lines,
      "table": str(result)}))
"""


@pytest.mark.skipif(not HAS_LIBTPU, reason="needs libtpu: ./planner[aot], Python >= 3.12 (CI lane 2)")
def test_plan_from_python_leaves_the_process_and_its_files_as_they_were(tmp_path):
  """A notebook's ``plan()``: the compiles happen in a planning process of their own; the caller's
  environment, its temporary folder and libtpu's log folder are as before, and it has not even imported
  jax (which sets libtpu's variables on import)."""
  env = {**planner_env(), "TMPDIR": str(tmp_path)}
  proc = subprocess.run([sys.executable, "-c", _UNTOUCHED], env=env, capture_output=True, text=True,
                        timeout=400)
  assert proc.returncode == 0, proc.stderr[-3000:]
  (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
  out = json.loads(line[len("RESULT "):])
  assert out["environ"] and out["files"] and not out["jax"]
  assert out["fits"] is True and any(ln.startswith("compiled zero1 (one)") for ln in out["lines"])
  assert out["table"].startswith("compiled for v6e:2x2, mesh data=4")  # the terminal's table, titled
  assert "\nlever " in out["table"] and "zero1" in out["table"]


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
  proc = subprocess.run([sys.executable, "-c", _TWO_NODES], env=planner_env(), capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.split()[:2] == ["16", "2"] and "NVIDIA H200" in proc.stdout


@pytest.mark.skipif(not HAS_GPU_COMPILER, reason="needs XLA's GPU compiler (CI lane 2)")
def test_gpu_plan_of_the_bfloat16_levers(tmp_path):
  """On 8x H100, a bfloat16 model: float32 master weights add 8P/dp bytes of arguments (masters
  4P/dp, float32 moments 4P/dp over bfloat16 ones) and all-gather exactly what pure bfloat16 Zero-1
  does, 2 bytes per parameter (bfloat16 state would change nothing there: the planner refuses it,
  tests above; what it halves on a float32 model, tests/core/test_state_dtype.py measures on CPU)."""
  params = sum(x.size for x in jax.tree.leaves(nnx.state(nnx.eval_shape(tiny_lm), nnx.Param)))
  argv = ["--model", "tests.support.planner_toys:tiny_lm_bf16", "--topology", "h100:8",
          "--levers", "zero1,zero1-master", "--steps", "one"]
  out = tmp_path / "bf16"
  proc = subprocess.run([sys.executable, "-m", "nnx_zero1.plan", *argv, *TOY[2:-2], "--out", str(out)],
                        env=planner_env(), capture_output=True, text=True, timeout=400)
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
  result = run_plan(tmp_path, "--topology", "h100:8", "--steps", "one", "--search", "--margin", "0.999",
                 "--levers", "zero1")
  usable = int(result["meta"]["hbm_bytes"] * 0.001)
  rows = {r["lever"]: r for r in result["rows"]}
  for r in rows.values():
    probes = {p["batch"]: p for p in r["search"]}
    edge, above = r["max_micro_batch"], r["above"]
    assert edge % 8 == 0 and edge >= 16 and above == edge + 8, (edge, above)
    assert probes[edge]["fits"] and probes[edge]["peak_bytes_per_device"] <= usable
    assert not probes[above]["fits"] and probes[above]["peak_bytes_per_device"] > usable
    assert r["refused_because"].startswith("peak ") and len(probes) <= 12 and r["search_unfinished"] is None
    assert all(p["fits"] for b, p in probes.items() if b <= edge)  # the edge lies below the first failure
    # Near the edge the compiler's peaks wobble by MiB; across the search they rise with the batch.
    assert probes[8]["peak_bytes_per_device"] < probes[edge]["peak_bytes_per_device"]
  # Every GPU point has a predicted time (XLA's GPU cost model): the recommendation is among the fastest
  # points that fit, per token.
  fitting = [p for p in rows["zero1"]["search"] if p["fits"]]
  assert all(p["predicted_step_s"] > 0 for p in fitting)
  best = result["recommendation"]
  fastest = max(p["tokens_per_s_per_device"] for p in fitting)
  chosen = next(p for p in fitting if p["batch"] == best["micro_batch"])
  assert best["lever"] == "zero1" and chosen["tokens_per_s_per_device"] >= 0.95 * fastest
  assert best["cli"].startswith(f"python -m nnx_zero1.plan --model {TOYS}:tiny_lm --topology h100")
  assert f"--batch {best['micro_batch']} " in best["cli"] and best["lever"] in rows


@pytest.mark.skipif(not (HAS_LIBTPU and HAS_MAXTEXT),
                    reason="needs libtpu and maxtext (extra aot + maxtext==0.2.5, Python >= 3.12), CI lane 2")
def test_maxtext_plan_compiles_maxtexts_engine_for_each_lever(tmp_path):
  """``maxtext:`` through MaxText's own ahead-of-time engine, a 2-layer decoder (MaxText's defaults and the
  toys' overrides) on v6e:2x2, GA 2: each Zero-1 lever is ``Zero1AbstractMaxTextEngine``, the rows are
  split steps, and a lever of this library's own accumulation is refused on its row."""
  from tests.support.maxtext_toys import TINY

  skip = ("model_name", "run_name", "per_device_batch_size", "max_target_length", "ici_data_parallelism",
          "ici_fsdp_parallelism", "opt_type", "base_output_directory")
  overrides = [f"{k}={v}" for k, v in TINY.items() if k not in skip]
  argv = ["--model", "maxtext:default", "--topology", "v6e:2x2", "--batch", "8", "--seq-len", "16",
          "--ga", "2", "--levers", "baseline,zero1,zero1-accum,offload", "--out", str(tmp_path), *overrides]
  proc = subprocess.run([sys.executable, "-m", "nnx_zero1.plan", *argv], env=planner_env(),
                        capture_output=True, text=True, timeout=400)
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
                          "h100:8"], env=planner_env(), capture_output=True, text=True, timeout=300)
    assert gpu.returncode == 2 and "for TPU slices only; h100:8 is a GPU target" in gpu.stderr


@pytest.mark.skipif(not (HAS_GPU_COMPILER and HAS_LIBTPU), reason="needs both compilers (CI lane 2)")
def test_with_the_compilers_installed_jax_platforms_cpu_imports_jax_quietly():
  """The documented environment for a user's own jax programs beside the planner's compilers
  (``JAX_PLATFORMS=cpu``), and the planner's own start in a process where it is not set
  (``compilers.start_cpu_jax``): jax on its CPU devices, and nothing on stderr. Asserted on what these
  processes print, not on what the compilers print without them (which a host with a GPU or TPU would not)."""
  script = "import jax; print(jax.devices())"
  ours = ("import os; from nnx_zero1_plan import compilers; compilers.start_cpu_jax(); import jax; "
          "print(os.environ['JAX_PLATFORMS'], jax.default_backend(), jax.devices())")
  env = {k: v for k, v in planner_env().items() if not k.startswith(("JAX_", "TPU_"))}
  quiet = subprocess.run([sys.executable, "-c", script], env={**env, "JAX_PLATFORMS": "cpu"},
                         capture_output=True, text=True, timeout=120)
  started = subprocess.run([sys.executable, "-c", ours], env=env, capture_output=True, text=True, timeout=120)
  assert quiet.returncode == 0 and "CpuDevice" in quiet.stdout and quiet.stderr == "", quiet.stderr[-2000:]
  assert started.returncode == 0 and started.stderr == "", started.stderr[-2000:]
  assert started.stdout.startswith("cpu cpu [CpuDevice(id=0)"), started.stdout


@pytest.mark.skipif(not HAS_GPU_COMPILER, reason="needs XLA's GPU compiler: pip install --no-deps "
                    "jax-cuda13-plugin==0.12.0.1 jax-cuda13-pjrt==0.12.0.1 (Python >= 3.12), CI lane 2")
def test_when_nothing_fits_the_first_change_that_fits_is_found_by_a_compile(tmp_path):
  # A margin that leaves ~70 MB of the pool: at micro-batch 64 x 256 tokens neither lever fits (the compiler
  # says ~0.09 GiB); a smaller micro-batch is the first change a user tries, and the compile decides.
  result = run_plan(tmp_path, "--topology", "h100:8", "--batch", "64", "--seq-len", "256", "--steps", "one",
                    "--margin", "0.9989")
  assert not any(r["fits"] for r in result["rows"]) and result["recommendation"] is None
  way_out = result["way_out"]
  found = way_out["found"]
  assert found is not None and found["fits"]
  assert found["peak_bytes_per_device"] <= result["meta"]["usable_bytes"]
  assert found == way_out["tried"][-1] and not any(t["fits"] for t in way_out["tried"][:-1])
  assert found["what"].startswith("micro-batch ") and "--levers zero1 " in found["command"]
  assert "optimizer = Zero1Optimizer(model, optax.adamw(1e-5), mesh)" in found["code"]  # its code
  # Its command reproduces it: the same change, planned alone, fits.
  words = found["command"].split()[3:]
  again = run_plan(tmp_path / "again", *words)
  assert [r["fits"] for r in again["rows"]] == [True]
  assert again["rows"][0]["peak_bytes_per_device"] == found["peak_bytes_per_device"]
  assert "Nothing fits as asked; compiled, the first change that fits" in (tmp_path / "plan.md").read_text()
