"""The recommendation's order (pure: rows in, one configuration out), value by value."""

from nnx_zero1_plan.inputs import command_line
from nnx_zero1_plan.recommend import ORDER, baseline_beats, lever_code, recommend

G = 2**30
META = {"model": "mymodels.models:build", "topology": "h100:4", "mesh": {"data": 4}, "batch": 8,
        "seq_len": 1024, "ga": 1}


def _row(lever, *, peak=8 * G, fits=True, step="one", collective=0, **extra):
  return {"lever": lever, "step": step, "fits": fits, "peak_bytes_per_device": peak, "hbm_bytes": 16 * G,
          "collectives": {"per_step": {"all-reduce": {"count": 1, "bytes": collective}}}, **extra}


def test_the_largest_micro_batch_wins_over_fewer_collective_bytes():
  rows = [_row("baseline", max_micro_batch=80, collective=1), _row("zero1", max_micro_batch=84, collective=2)]
  best = recommend(rows, META)
  assert (best["lever"], best["micro_batch"], best["step"]) == ("zero1", 84, "one")
  assert best["code"] == "Zero1Optimizer(model, tx, mesh)"
  assert best["cli"] == ("python -m nnx_zero1.plan --model mymodels.models:build --topology h100:4 "
                         "--mesh data=4 --batch 84 --seq-len 1024 --ga 1 --levers zero1 --steps one")
  assert best["order"] == list(ORDER) and best["baseline_beats"] == []


def test_at_one_micro_batch_fewer_collective_bytes_then_no_remat_then_the_lighter_lever_decide():
  assert recommend([_row("baseline", collective=2), _row("zero1", collective=1)], META)["lever"] == "zero1"
  rows = [_row("baseline", remat="block"), _row("zero1", remat="none")]
  assert recommend(rows, META)["lever"] == "zero1"
  assert recommend([_row("baseline"), _row("zero1")], META)["lever"] == "baseline"


def test_the_margin_decides_what_fits():
  rows = [_row("baseline", peak=int(15.5 * G)), _row("zero1", peak=14 * G)]
  assert recommend(rows, META, margin=0.05)["lever"] == "zero1"  # 15.5 > 0.95 * 16
  assert recommend(rows, META, margin=0.0)["lever"] == "baseline"
  assert recommend([_row("baseline", peak=20 * G, fits=False)], META) is None


def test_only_rows_of_the_chosen_step_shape_compete():
  rows = [_row("baseline", step="split", max_micro_batch=96), _row("zero1", step="one", max_micro_batch=64)]
  assert recommend(rows, META)["lever"] == "zero1"
  assert recommend(rows, META, step="split")["lever"] == "baseline"
  maxtext = dict(META, model="maxtext:qwen3-0.6b")
  best = recommend(rows, maxtext)
  assert best["step"] == "split" and best["code"] == "MaxText's own MaxTextTrainingEngine"


def test_the_code_is_each_host_s_own_option():
  rows = [_row("offload", max_micro_batch=16)]
  assert recommend(rows, META)["code"] == "Zero1Optimizer(model, tx, mesh, offload_state_to_host=True)"
  tunix = recommend(rows, dict(META, model="tunix:qwen3_8b"))["code"]
  assert tunix == ("Zero1PeftTrainer (nnx_zero1.adapters.tunix) with "
                   "Zero1TrainingConfig(..., zero1_offload_state_to_host=True)")
  maxtext = recommend([_row("offload", step="split", max_micro_batch=16)], dict(META, model="maxtext:x"))
  assert maxtext["code"].endswith("subclassed with OFFLOAD_STATE_TO_HOST = True")


def test_when_the_baseline_fits_more_it_says_so_with_the_figures():
  base = _row("baseline", max_micro_batch=48, temp_bytes_per_device=12 * G, argument_bytes_per_device=3 * G)
  zero1 = _row("zero1", max_micro_batch=40, temp_bytes_per_device=14 * G, argument_bytes_per_device=G)
  (line,) = baseline_beats([base, zero1], 8, 0.05)
  assert line.startswith("baseline fits micro-batch 48 where zero1 fits 40")
  assert "at micro-batch 8 (one step) zero1's temporaries are +2.00 GiB" in line
  assert line.endswith("and its arguments save 2.00 GiB")
  assert recommend([base, zero1], META)["baseline_beats"] == [line]
  assert baseline_beats([base, dict(zero1, max_micro_batch=48)], 8, 0.05) == []


def test_the_command_line_reproduces_the_settings_that_matter():
  meta = dict(META, param_dtype="bfloat16", optimizer="lion", overrides={"scan_layers": "false"})
  cli = command_line(meta, levers=["zero1"], steps=["split"], batch=32, remat="block")
  assert cli.startswith("python -m nnx_zero1.plan --model mymodels.models:build --topology h100:4 "
                        "--mesh data=4")
  assert cli.endswith("--levers zero1 --steps split --param-dtype bfloat16 --remat block --optimizer lion "
                      "scan_layers=false")


def test_a_zero1_row_the_compiler_refused_is_said_so_not_given_figures():
  base = _row("baseline", temp_bytes_per_device=12 * G, argument_bytes_per_device=3 * G)
  refused = _row("zero1", fits=False, peak=None, temp_bytes_per_device=None, argument_bytes_per_device=None,
                 error="JaxRuntimeError: RESOURCE_EXHAUSTED: CompileTimeHbmOom")
  (line,) = baseline_beats([base, refused], 8, 0.05)
  assert line == ("baseline fits micro-batch 8 where zero1 fits none: at micro-batch 8 (one step) the "
                  "compiler refused zero1: JaxRuntimeError: RESOURCE_EXHAUSTED: CompileTimeHbmOom")


def test_the_code_is_written_from_the_lever_table():
  assert lever_code("baseline", "my_pkg.models:build") == "nnx.Optimizer(model, tx, wrt=nnx.Param)"
  assert lever_code("zero1-master", "m:f") == "Zero1Optimizer(model, tx, mesh, master_dtype=jnp.float32)"
  assert lever_code("zero2-offload", "m:f") == (
      "Zero1Optimizer(model, tx, mesh, offload_state_to_host=True); grads from value_and_grad_accumulated("
      "loss_fn, model, batch, micro_batches=GA, optimizer=optimizer, shard_accumulator=True)")
  assert lever_code("zero2", "maxtext:qwen3-0.6b").endswith("subclassed with SHARD_ACCUMULATOR = True")
  assert lever_code("baseline", "tunix:qwen3_8b") == "Tunix's PeftTrainer with its TrainingConfig, as it is"
