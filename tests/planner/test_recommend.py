"""The recommendation's order (pure: rows in, one configuration out), value by value."""

import dataclasses

import pytest

from nnx_zero1_plan.estimate import estimate_mark
from nnx_zero1_plan.inputs import PlanError, parse_model
from nnx_zero1_plan.printed_code import lever_code
from nnx_zero1_plan.recommend import ORDER, baseline_beats, recommend
from nnx_zero1_plan.request import PlanRequest, command_line
from nnx_zero1_plan.row import Made, Offloaded, Point, StateSplit
from tests.support.rows import G, make_row, searched

# The plan's request as resolved: its mesh and micro-batch set, as the recommendation reads it.
RATE_NOTE = "  # 1e-5: your learning rate (or an optax schedule)"  # the printed code says where the rate goes
REQUEST = PlanRequest("mymodels.models:build", "h100:4", mesh="data=4", batch=8)


def _row(lever, *, peak=8 * G, collective=0, max_micro_batch=None, offload_fraction=None, **extra):
  extra.setdefault("collectives", {"per_step": {"all-reduce": {"count": 1, "bytes": collective}}})
  if max_micro_batch is not None:
    extra["searched"] = searched(max_micro_batch)
  if offload_fraction is not None:
    extra["offloaded"] = Offloaded(offload_fraction, (), None)
  return make_row(lever, peak_bytes_per_device=peak, **extra)


def test_the_largest_micro_batch_wins_over_fewer_collective_bytes():
  rows = [_row("baseline", max_micro_batch=80, collective=1), _row("zero1", max_micro_batch=84, collective=2)]
  best = recommend(rows, REQUEST)
  assert (best.lever, best.micro_batch, best.step) == ("zero1", 84, "one")
  assert best.code.splitlines() == [
      "import jax, jax.numpy as jnp, optax", "from nnx_zero1 import Zero1Optimizer",
      "from jax.sharding import AxisType", "", "devices = jax.devices()",
      "mesh = jax.make_mesh((4,), ('data',), (AxisType.Auto,), devices=devices)", "with jax.set_mesh(mesh):",
      "  model = ...  # your model, built here: its parameters' sharding names the mesh's axes",
      "  optimizer = Zero1Optimizer(model, optax.adamw(1e-5), mesh)" + RATE_NOTE]
  assert best.cli == ("python -m nnx_zero1.plan --model mymodels.models:build --topology h100:4 "
                         "--mesh data=4 --batch 84 --seq-len 1024 --ga 1 --levers zero1 --steps one")
  assert best.order == ORDER and best.baseline_beats == ()


def test_at_one_micro_batch_fewer_collective_bytes_then_no_remat_then_the_lighter_lever_decide():
  assert recommend([_row("baseline", collective=2), _row("zero1", collective=1)], REQUEST).lever == "zero1"
  rows = [_row("baseline", remat="block"), _row("zero1", remat="none")]
  assert recommend(rows, dataclasses.replace(REQUEST, model="tunix:qwen3_8b")).lever == "zero1"
  assert recommend([_row("baseline"), _row("zero1")], REQUEST).lever == "baseline"


def test_at_one_micro_batch_and_equal_bytes_the_headroom_decides_and_is_said():
  rows = [_row("baseline", collective=100, headroom_bytes_per_device=G),
          _row("zero1", collective=100, headroom_bytes_per_device=5 * G)]
  best = recommend(rows, REQUEST)
  assert best.lever == "zero1"
  assert best.why == ("at micro-batch 8 zero1 leaves 5.00 GiB free and baseline 1.00 GiB; both send 0.00 "
                         "GiB of collectives per step: zero1 for its headroom",)
  # More bytes than 1% over the other's: the bytes decide, and the headroom given up is said.
  rows[1] = _row("zero1", collective=150, headroom_bytes_per_device=5 * G)
  best = recommend(rows, REQUEST)
  assert best.lever == "baseline" and best.why[0].endswith("baseline for its fewer collective bytes")


def test_sent_bytes_are_the_basis_where_a_row_has_them():
  rows = [_row("baseline", collective=1, headroom_bytes_per_device=G),
          _row("zero1", collective=9, headroom_bytes_per_device=2 * G)]
  sent = {"per_step": {"all-reduce": {"count": 1, "bytes": 9}},
          "sent_per_step": {"reduce-scatter": {"count": 1, "bytes": 1}}}
  rows[1] = _row("zero1", headroom_bytes_per_device=2 * G, collectives=sent)
  assert recommend(rows, REQUEST).lever == "zero1"


def test_only_rows_that_fit_compete():
  rows = [_row("baseline", fits=False), _row("zero1", peak=14 * G)]
  assert recommend(rows, REQUEST).lever == "zero1"
  assert recommend([_row("baseline", peak=20 * G, fits=False)], REQUEST) is None


def test_only_rows_of_the_chosen_step_shape_compete():
  rows = [_row("baseline", step="split", max_micro_batch=96), _row("zero1", step="one", max_micro_batch=64)]
  assert recommend(rows, REQUEST).lever == "zero1"
  assert recommend(rows, REQUEST, step="split").lever == "baseline"
  maxtext = dataclasses.replace(REQUEST, model="maxtext:qwen3-0.6b")
  best = recommend(rows, maxtext)
  assert best.step == "split" and best.code == "MaxText's own MaxTextTrainingEngine"


def test_the_code_is_each_host_s_own_option():
  rows = [_row("offload", max_micro_batch=16)]
  assert recommend(rows, REQUEST).code.endswith(
      "Zero1Optimizer(model, optax.adamw(1e-5), mesh, offload_state_to_host=True)" + RATE_NOTE)
  specs = {"act_btd": [["data", "fsdp"], None, "tp"]}
  tunix = recommend(rows, dataclasses.replace(REQUEST, model="tunix:qwen3_8b"),
                    activation_sharding=specs).code.splitlines()
  assert tunix[1] == "from nnx_zero1.adapters.tunix import Zero1PeftTrainer, Zero1TrainingConfig"
  # The activations' specs the plan compiled, for the model's ShardingConfig; the batch over the data axes.
  assert "activation_sharding = {'act_btd': (('data', 'fsdp'), None, 'tp')}" in tunix
  assert tunix[-3:] == ["with mesh:  # Tunix reads its mesh from this context",
                        "  model = ...  # your model, built here", (
      "  trainer = Zero1PeftTrainer(model, optax.adamw(1e-5), Zero1TrainingConfig(..., "
      "data_sharding_axis=(('data',),), zero1_data_axis='data', zero1_offload_state_to_host=True))"
      + RATE_NOTE)]
  maxtext = recommend([_row("offload", step="split", max_micro_batch=16)],
                      dataclasses.replace(REQUEST, model="maxtext:x"))
  assert maxtext.code.endswith("subclassed with OFFLOAD_STATE_TO_HOST = True")


def test_when_the_baseline_fits_more_it_says_so_with_the_figures():
  base = _row("baseline", max_micro_batch=48, temp_bytes_per_device=12 * G, argument_bytes_per_device=3 * G)
  zero1 = _row("zero1", max_micro_batch=40, temp_bytes_per_device=14 * G, argument_bytes_per_device=G)
  (line,) = baseline_beats([base, zero1], 8)
  assert line.startswith("baseline fits micro-batch 48 where zero1 fits 40")
  assert "at micro-batch 8 (one step) zero1's temporaries are +2.00 GiB" in line
  assert line.endswith("and its arguments save 2.00 GiB")
  assert recommend([base, zero1], REQUEST).baseline_beats == (line,)
  assert baseline_beats([base, dataclasses.replace(zero1, searched=searched(48))], 8) == []


def test_the_command_line_reproduces_the_settings_that_matter():
  request = PlanRequest("maxtext:qwen3-0.6b", "v6e:2x2", mesh="data=4", batch=8, param_dtype="bfloat16",
                        optimizer="lion", overrides={"scan_layers": "false"})
  cli = command_line(request, levers=["zero1"], steps=["split"], batch=32, remat="block")
  assert cli.startswith("python -m nnx_zero1.plan --model maxtext:qwen3-0.6b --topology v6e:2x2 "
                        "--mesh data=4 --batch 32")
  assert cli.endswith("--levers zero1 --steps split --optimizer lion --param-dtype bfloat16 --remat block "
                      "scan_layers=false")
  # The margin and the GPU pool are part of what a row was compiled and judged against (the pool on GPUs).
  cli = command_line(dataclasses.replace(REQUEST, margin=0.0, gpu_memory_fraction=0.9), levers=["zero1"],
                     steps=["one"])
  assert "--gpu-memory-fraction 0.9 --margin 0.0" in cli
  assert "--gpu-memory-fraction" not in command_line(dataclasses.replace(request, gpu_memory_fraction=0.9))
  # A change is made on the request, so it is checked as the request was: no command the planner refuses.
  with pytest.raises(PlanError, match="--steps split"):
    command_line(request, steps=["one"])


def test_a_zero1_row_the_compiler_refused_is_said_so_not_given_figures():
  base = _row("baseline", temp_bytes_per_device=12 * G, argument_bytes_per_device=3 * G)
  refused = _row("zero1", fits=False, peak=None, temp_bytes_per_device=None, argument_bytes_per_device=None,
                 error="JaxRuntimeError: RESOURCE_EXHAUSTED: CompileTimeHbmOom")
  (line,) = baseline_beats([base, refused], 8)
  assert line == ("baseline fits micro-batch 8 where zero1 fits none: at micro-batch 8 (one step) the "
                  "compiler refused zero1: JaxRuntimeError: RESOURCE_EXHAUSTED: CompileTimeHbmOom")


def test_the_code_is_written_from_the_lever_table():
  assert lever_code("baseline", parse_model("my_pkg.models:build")).endswith(
      "  optimizer = nnx.Optimizer(model, optax.adamw(1e-5), wrt=nnx.Param)" + RATE_NOTE)
  # The rate is the optax call's first argument, whatever follows it.
  assert lever_code("baseline", parse_model("m:f"), optimizer="sgd").endswith(
      "optax.sgd(1e-3, momentum=0.9), wrt=nnx.Param)  # 1e-3: your learning rate (or an optax schedule)")
  assert lever_code("zero1-master", parse_model("m:f")).endswith(
      "Zero1Optimizer(model, optax.adamw(1e-5), mesh, master_dtype=jnp.float32)" + RATE_NOTE)
  code = lever_code("zero2-offload", parse_model("m:f")).splitlines()
  assert code[1] == "from nnx_zero1 import Zero1Optimizer, value_and_grad_accumulated"
  assert code[-2:] == ["  optimizer = Zero1Optimizer(model, optax.adamw(1e-5), mesh, "
                       "offload_state_to_host=True)" + RATE_NOTE,
                       "  # each step: loss, grads = value_and_grad_accumulated(loss_fn, model, batch, "
                       "micro_batches=GA, optimizer=optimizer, shard_accumulator=True)"]


def test_the_code_pastes_and_runs():
  """The recommendation's own-loop code, run as written with a model in place of ``model = ...`` (on this
  machine's devices; tests/planner/test_printed_code.py runs it on each compile-only topology's)."""
  import jax
  from flax import nnx

  for lever in ("baseline", "zero1", "zero2"):
    code = lever_code(lever, parse_model("m:f"), mesh={"data": jax.device_count()})
    namespace = {"nnx": nnx}
    exec(code.replace("model = ...", "model = nnx.Linear(8, 8, rngs=nnx.Rngs(0))"), namespace)
    assert namespace["mesh"].axis_names == ("data",)
    assert type(namespace["optimizer"]).__name__ == ("Optimizer" if lever == "baseline" else "Zero1Optimizer")
  assert lever_code("zero2", parse_model("maxtext:qwen3-0.6b")).endswith(
      "subclassed with SHARD_ACCUMULATOR = True")
  tunix = lever_code("baseline", parse_model("tunix:qwen3_8b"), mesh={"data": 8})
  assert tunix.splitlines()[-1] == ("  trainer = PeftTrainer(model, optax.adamw(1e-5), TrainingConfig(..., "
                                    "data_sharding_axis=(('data',),)))" + RATE_NOTE)
  pod = lever_code("zero1-pod", parse_model("tunix:qwen3_8b"), mesh={"replica": 2, "data": 4}, domains=2)
  for code in (tunix, pod):
    compile(code, "tunix", "exec")  # Python as written; Tunix's trainer is not built here


def test_on_a_non_monotonic_bend_a_lever_stands_where_its_own_compile_fitted():
  # h100:4, the user's 266.9M float32 decoder at --margin 0: the baseline's search ran out of compiles with
  # every one fitting (edge 140, not confirmed); Zero-1 was refused at 132 (edge 128) but fitted at 136, 140
  # and 144. Both fit 140 by their own compiles: the bytes and the headroom there decide, not 140 > 128.
  points = lambda fitted, refused=(), room=None: (
      [Point(b, True, headroom_bytes_per_device=(room or {}).get(b, G // 4)) for b in fitted]
      + [Point(b, False) for b in refused])
  collectives = lambda: {"per_step": {"all-reduce": {"count": 1, "bytes": 100}}}
  base = _row("baseline", collectives=collectives(), searched=searched(
      140, points([8, 80, 120, 136, 140]), unfinished="the search's 12 compiles ran out"))
  zero1 = _row("zero1", collectives=collectives(), searched=searched(
      128, points([8, 80, 128, 136, 140, 144], refused=[132], room={140: G}),  # more room at 140
      fits_above=(136, 140, 144)))
  best = recommend([base, zero1], REQUEST)
  assert (best.lever, best.micro_batch) == ("zero1", 140)
  assert best.why[0].startswith("at micro-batch 140 zero1 leaves 1.00 GiB free and baseline 0.25 GiB")
  assert best.baseline_beats == ()  # never "baseline fits 140 where zero1 fits 128"
  assert best.notes == ("baseline's edge is not confirmed (the search's 12 compiles ran out): it fits at "
                           "least 140",)
  # A lever never compiled at the best micro-batch does not stand there: the larger edge wins.
  zero1 = dataclasses.replace(zero1, searched=searched(128, points([8, 80, 128], refused=[132])))
  assert recommend([base, zero1], REQUEST).lever == "baseline"


def test_a_zero1_lever_holding_the_baseline_s_state_is_never_recommended():
  # No leaf divisible by the state's axes: zero1-pod's layout split nothing, the baseline's state per chip.
  base = _row("baseline", opt_state_bytes_per_device=27 * G, collective=10, headroom_bytes_per_device=G)
  pod = _row("zero1-pod", opt_state_bytes_per_device=27 * G, collective=1, headroom_bytes_per_device=G,
             state_split=StateSplit(["replica", "data"], {"none": 1.0}))
  zero1 = _row("zero1", opt_state_bytes_per_device=7 * G, fits=False)
  best = recommend([base, pod, zero1], REQUEST)
  assert best.lever == "baseline"
  assert best.notes == ("zero1-pod holds the baseline's optimizer state per device (its layout splits "
                           "nothing): not a candidate",)
  # Offloaded state splits nothing but moves it off the device: it stays a candidate.
  offloaded = dataclasses.replace(pod, figures=dataclasses.replace(
      pod.figures, opt_state_bytes_by_memory_kind={"device": 27 * G, "pinned_host": G}))
  assert recommend([base, offloaded], REQUEST).lever == "zero1-pod"


def test_an_estimate_is_never_recommended():
  made = Made(depth=2, estimate=estimate_mark(28, [2, 4], ["peak_bytes_per_device"]), fits_estimate=True)
  estimate = _row("zero1", fits=None, made=made)
  assert recommend([estimate], REQUEST) is None
  from nnx_zero1_plan.closing_lines import recommendation_lines

  assert "without --estimate" in recommendation_lines(None, "a 5% margin", estimate=True)[1]


def test_the_usable_memory_is_said_by_the_users_margin_or_the_backends_reserve():
  from nnx_zero1_plan.closing_lines import limit_words

  assert limit_words(None, 2**34, 2**34 - 2**28) == "the backend's 0.25 GiB reserve"
  assert limit_words(0.05, 2**34, 2**34) == "a 5% margin"
  assert limit_words(None, 2**34, 2**34) == "the compiler's own check"


def test_at_one_micro_batch_and_equal_collectives_fewer_bytes_over_the_host_link_win_over_headroom():
  # offload moves the whole state to host memory and back every step; the fraction that fits, a third.
  rows = [_row("offload-fraction", collective=100, headroom_bytes_per_device=0, offload_fraction=0.29,
               host_argument_bytes_per_device=G // 3),
          _row("offload", collective=100, headroom_bytes_per_device=G, host_argument_bytes_per_device=G)]
  best = recommend(rows, REQUEST)
  assert best.lever == "offload-fraction"
  assert "offload_state_to_host=0.29" in best.code
  assert best.why == (
      "at micro-batch 8 offload-fraction leaves 0.00 GiB free and offload 1.00 GiB; both send 0.00 GiB of "
      "collectives per step; offload-fraction copies 0.67 GiB to and from host memory per step and offload "
      "2.00: offload-fraction for its fewer bytes over the host link",)


@pytest.mark.parametrize("dtype, spelled", [("bfloat16", "bfloat16"),
                                           ("int8", "int8 blocks with float32 scales")])
def test_a_pick_that_narrows_the_hop_across_says_it_is_not_bit_identical(dtype, spelled):
  """Half the float32 lever's bytes across (bfloat16), or a quarter and the scales (int8), win on a pod; the
  pick gives the option and says it is not bit-identical."""
  pod = dataclasses.replace(REQUEST, topology="h100:2x8", mesh="replica=2,data=8")
  across = lambda n: {"across_per_step": {"all-reduce": {"count": 1, "bytes": n}}}
  lever = "zero1-accum-bf16across" if dtype == "bfloat16" else "zero1-accum-int8across"
  rows = [_row("zero1-accum", collectives=across(4 * G)),
          _row(lever, collectives=across(2 * G if dtype == "bfloat16" else G + G // 64))]
  best = recommend(rows, pod)
  assert best.lever == lever
  assert f"across_dtype=jnp.{dtype}" in best.code
  assert [n for n in best.notes if "not bit-identical" in n] == [
      f"{lever} is not bit-identical: its gradients cross between slices or nodes in {spelled} "
      "(across_dtype; docs/pods.md measures the loss against the exact reduction)"]
  assert not [n for n in recommend(rows[:1], pod).notes if "not bit-identical" in n]


def test_a_pick_that_narrows_both_hops_across_gives_both_options_and_says_it_is_not_bit_identical():
  """zero1-pod-master-accum-int8across: the gradients and the new parameters across in int8 blocks, the
  float32 masters kept; its code passes all three options, its note names both hops."""
  pod = dataclasses.replace(REQUEST, topology="h100:2x8", mesh="replica=2,data=8")
  across = lambda n: {"across_per_step": {"all-gather": {"count": 1, "bytes": n}}}
  lever = "zero1-pod-master-accum-int8across"
  rows = [_row("zero1-pod-accum", collectives=across(4 * G)), _row(lever, collectives=across(G + G // 64))]
  best = recommend(rows, pod)
  assert best.lever == lever
  assert ("data_axis=('replica', 'data'), master_dtype=jnp.float32, params_across_dtype=jnp.int8)"
          in best.code and "across_dtype=jnp.int8" in best.code.split("value_and_grad_accumulated(")[-1])
  assert [n for n in best.notes if "not bit-identical" in n] == [
      f"{lever} is not bit-identical: its gradients and its new parameters (the masters exact) cross between "
      "slices or nodes in int8 blocks with float32 scales (across_dtype, params_across_dtype; docs/pods.md "
      "measures the loss against the exact reduction)"]


def test_on_a_pod_fewer_bytes_over_the_slow_network_decide_before_all_bytes_and_are_said():
  """Zero-1 over both axes sends more in all (a reduce-scatter per axis) and less between nodes: on a pod
  the slow network's bytes come first, and the sentence names them, not the total."""
  pod = dataclasses.replace(REQUEST, topology="h100:2x8", mesh="replica=2,data=8")
  ar = lambda n: {"all-reduce": {"count": 1, "bytes": n}}
  counted = lambda sent, across: {"per_step": ar(sent), "across_per_step": ar(across)}
  rows = [_row("zero1", collectives=counted(3 * G, G), headroom_bytes_per_device=2 * G),
          _row("zero1-pod", collectives=counted(4 * G, G // 2), headroom_bytes_per_device=G)]
  best = recommend(rows, pod)
  assert best.lever == "zero1-pod"
  assert best.why == ("at micro-batch 8 zero1-pod leaves 1.00 GiB free and zero1 2.00 GiB; zero1-pod "
                         "sends 0.50 GiB per step over the slow network and zero1 1.00: zero1-pod for its "
                         "fewer bytes between slices or nodes",)
  # Within 1% over the slow network: all the bytes decide again.
  rows[1] = _row("zero1-pod", collectives=counted(4 * G, G - G // 200), headroom_bytes_per_device=G)
  best = recommend(rows, pod)
  assert best.lever == "zero1" and best.why[0].endswith("zero1 for its fewer collective bytes")


def test_a_deferred_levers_code_for_a_tunix_model_gives_its_gradient_call():
  """Tunix's trainer reduces the gradients itself (optax.MultiSteps): a deferred lever's code says the
  gradients the plan compiled are value_and_grad_accumulated's, with the lever's options and axes."""
  code = lever_code("zero1-accum-bf16across", parse_model("tunix:qwen3_0p6b"), mesh={"replica": 2, "data": 4})
  assert "from nnx_zero1 import value_and_grad_accumulated" in code.splitlines()
  assert code.splitlines()[-1] == (
      "  # each step: loss, grads = value_and_grad_accumulated(loss_fn, model, batch, micro_batches=GA, "
      "optimizer=trainer.optimizer, across_dtype=jnp.bfloat16, data_axis=('replica', 'data'))")
  zero1 = lever_code("zero1", parse_model("tunix:qwen3_0p6b"), mesh={"data": 4})
  assert "value_and_grad_accumulated" not in zero1


def test_the_way_out_that_fits_comes_with_its_code_as_a_recommendation_does():
  from nnx_zero1_plan.closing_lines import way_out_lines
  from nnx_zero1_plan.recommend import plan_code
  from nnx_zero1_plan.way_out import Change, find_way_out

  asked = PlanRequest("my_pkg.models:build", "v5e:2x4", mesh="data=8", optimizer="lion", batch=16)
  changes = [Change("micro-batch 8", dataclasses.replace(asked, levers="zero1", batch=8), "micro-batch"),
             Change("the optimizer state in host memory", dataclasses.replace(asked, levers="offload"),
                    "host memory")]
  fits = lambda c: make_row(c.request.levers[0], fits=c.request.levers == ("offload",),
                            peak_bytes_per_device=1)
  out = find_way_out(changes, fits, lambda c: "python -m nnx_zero1.plan ...",
                     lambda c: plan_code(c.request, c.request.levers[0]))
  lines = way_out_lines(out)
  code = lines[lines.index("  code:") + 1:lines.index("  reproduce: python -m nnx_zero1.plan ...")]
  assert code[-1].strip() == ("optimizer = Zero1Optimizer(model, optax.lion(1e-6), mesh, "
                              "offload_state_to_host=True)" + RATE_NOTE.replace("1e-5", "1e-6"))
  assert code[0] == "    import jax, jax.numpy as jnp, optax" and "tried first: micro-batch 8" in lines[-1]
  assert out.found is not None and out.found.code and not out.tried[0].code


def test_a_pick_within_one_percent_of_the_usable_memory_is_marked_thin():
  thin = _row("zero1", peak=16 * G - G // 20, headroom_bytes_per_device=G // 20)
  (note,) = [n for n in recommend([thin], REQUEST).notes if n.startswith("thin:")]
  assert note.startswith("thin: zero1 at micro-batch 8 leaves 0.05 GiB of 16.00 GiB usable free (0.31%")
  roomy = _row("zero1", peak=15 * G, headroom_bytes_per_device=G)
  assert not [n for n in recommend([roomy], REQUEST).notes if n.startswith("thin:")]
