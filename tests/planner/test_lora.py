"""``--lora RANK``: a ``tunix:`` model planned as a LoRA run (qwix's adapters, only they trained), the option
refused where it cannot apply, and the one line a plan says where Zero-1 saves little (LoRA's small state).
Lane 1: a tiny Tunix Llama3 on 2 CPU devices, no TPU compiler."""

import dataclasses
import importlib.util

import jax
import numpy as np
import pytest
from flax import nnx

from nnx_zero1_plan.cli import parse_args, request_of
from nnx_zero1_plan.inputs import PlanError
from nnx_zero1_plan.recommend import recommend, saves_little
from nnx_zero1_plan.request import PlanRequest, command_line
from nnx_zero1_plan.settings import PlanSettings
from tests.support.rows import G, make_row, searched

HAS_TUNIX = importlib.util.find_spec("tunix") is not None and importlib.util.find_spec("qwix") is not None
LORA_REQUEST = PlanRequest("tunix:llama3p2_1b", "v5e:2x4", mesh="data=8,fsdp=1", batch=16, lora=16,
                           steps="one").resolved({"data": 8, "fsdp": 1}, 16)


def test_the_option_is_parsed_printed_back_and_kept_in_the_meta():
  args = parse_args(["--model", "tunix:llama3p2_1b", "--topology", "v5e:2x4", "--lora", "16"])
  assert request_of(args).lora == 16
  assert parse_args(["--model", "tunix:llama3p2_1b", "--topology", "v5e:2x4"]).lora is None  # full
  assert command_line(LORA_REQUEST).endswith("--levers baseline,zero1 --steps one --lora 16")
  settings = PlanSettings(LORA_REQUEST, layers=16, device_kind="TPU v5 lite", batch_default=None,
                          param_dtypes=["bfloat16"], compiler="libtpu", jax="0.12.0", hbm_bytes=16 * G,
                          hbm_source="the compiler", usable_bytes=16 * G, peak_source="the compiler",
                          depth_extrapolated_from=None, batch_unit=8, domains=1, activation_sharding=None)
  meta = settings.to_json()
  assert meta["lora"] == 16 and PlanSettings.from_json(meta) == settings
  old = {k: v for k, v in meta.items() if k != "lora"}  # a plan.json from before the option: full
  assert PlanSettings.from_json(old).request.lora is None


@pytest.mark.parametrize(("model", "rank", "words"), [
    ("tests.support.planner_toys:tiny_lm", 16, "--lora applies LoRA to tunix: models; "
     "tests.support.planner_toys:tiny_lm applies its own: call qwix.apply_lora_to_model in your function"),
    ("maxtext:qwen3-0.6b", 16, "--lora applies LoRA to tunix: models"),
    ("tunix:llama3p2_1b", 0, "--lora is the LoRA rank, >= 1; got 0"),
])
def test_the_option_is_refused_in_one_line(model, rank, words):
  with pytest.raises(PlanError, match="^" + words.replace("(", r"\(").replace(")", r"\)")) as refused:
    PlanRequest(model, "v5e:2x4", lora=rank, steps="split")
  assert "\n" not in str(refused.value)


def _tiny_llama(monkeypatch):
  """Tunix's own Llama3 class at a tiny configuration, registered as ``tunix:llama3_tiny``."""
  from tunix.models.llama3 import model as llama3

  tiny = lambda cls: dataclasses.replace(cls.llama3p2_1b(), num_layers=2, vocab_size=256, embed_dim=128,
                                         hidden_dim=256, num_heads=4, head_dim=32, num_kv_heads=2)
  monkeypatch.setattr(llama3.ModelConfig, "llama3_tiny", classmethod(tiny), raising=False)


@pytest.mark.skipif(not HAS_TUNIX, reason="needs Tunix and qwix: pip install \".[tunix]\"")
def test_a_lora_plan_holds_the_adapters_moments_only_and_zero1_splits_them(monkeypatch):
  from nnx_zero1_plan import abstract_bytes_per_device, model_source
  from nnx_zero1_plan.abstract import bytes_by_dtype
  from nnx_zero1_plan.levers import LEVERS
  from nnx_zero1_plan.steps import compile_step, lever_state, scan_value_and_grad

  _tiny_llama(monkeypatch)
  mesh = jax.make_mesh((2, 1, 1), ("data", "fsdp", "tp"), (jax.sharding.AxisType.Auto,) * 3,
                       devices=jax.devices()[:2])
  full, lora = (model_source("tunix:llama3_tiny", lora=rank) for rank in (None, 4))
  state = {(rank, name): lever_state(LEVERS[name], lambda s=source: s.build(None), "adamw", mesh)
           for rank, source in ((None, full), (4, lora)) for name in ("baseline", "zero1")}
  model, optimizer = nnx.merge(state[4, "baseline"].graphdef, state[4, "baseline"].state)
  adapters = nnx.state(model, nnx.LoRAParam)
  assert optimizer.wrt is nnx.LoRAParam and jax.tree.leaves(adapters)
  moments = lambda key: sum(bytes_by_dtype(state[key].state[1]).values())  # the arrays: the step count left
  # adamw's two moments of the adapters, whole on each device: none of the frozen weights'.
  assert moments((4, "baseline")) == 2 * abstract_bytes_per_device(adapters)
  assert moments((4, "zero1")) == moments((4, "baseline")) // 2  # each moment split over data=2
  assert moments((None, "baseline")) > 10 * moments((4, "baseline"))
  # The step differentiates the adapters only, and compiles for the mesh's devices.
  for name in ("baseline", "zero1"):
    compiled, _ = compile_step(LEVERS[name], state[4, name], lora.loss_fn, mesh, 4, 16, 1)
    assert compiled.memory_analysis().argument_size_in_bytes > 0
  tokens = np.ones((1, 2, 17), np.int32)
  grads_of = lambda m, t: scan_value_and_grad(lora.loss_fn, m, t, optimizer.wrt)  # as the step calls it
  _, grads = jax.eval_shape(grads_of, model, tokens)
  shapes = lambda tree: [x.shape for x in jax.tree.leaves(tree)]
  assert shapes(grads) == shapes(adapters)  # the adapters' gradients, none of the frozen weights'
  assert len(shapes(adapters)) == 2 * 7 * 2  # lora_a and lora_b on the 7 projections of each of 2 layers


def test_where_zero1_saves_little_the_plan_says_so_in_one_line_and_recommends_the_baseline():
  peak = 4 * G
  rows = [make_row("baseline", opt_state_bytes_per_device=48 * 2**20, peak_bytes_per_device=peak,
                   mesh={"data": 8, "fsdp": 1}, compiled_for="v5e:2x4", batch=16),
          make_row("zero1", opt_state_bytes_per_device=6 * 2**20, peak_bytes_per_device=peak - 42 * 2**20,
                   mesh={"data": 8, "fsdp": 1}, compiled_for="v5e:2x4", batch=16)]
  best = recommend(rows, LORA_REQUEST)
  assert best.lever == "baseline"
  note, = [n for n in best.notes if "saves little" in n]
  assert note == saves_little(rows[1], rows) and "\n" not in note
  assert note.startswith("zero1 saves little here: 0.04 GiB of optimizer state per device, 1.0% of the "
                         "baseline's 4.00 GiB peak (under 1.5%")
  # The code is Tunix's trainer with the adapters applied as planned; the command keeps --lora.
  assert "qwix.apply_lora_to_model(model, qwix.LoraProvider(module_path='.*q_proj|" in best.code
  assert "PeftTrainer(model, optax.adamw(1e-5)" in best.code and best.cli.endswith("--lora 16")
  # A full fine-tuning's state (GiB of it) is no small saving: Zero-1 stays a candidate.
  big = [dataclasses.replace(r, figures=dataclasses.replace(
      r.figures, opt_state_bytes_per_device=r.figures.opt_state_bytes_per_device * 100)) for r in rows]
  assert saves_little(big[1], big) is None
  # Where the baseline does not fit, what Zero-1 saves is what fits: no note.
  assert saves_little(rows[1], [dataclasses.replace(rows[0], fits=False), rows[1]]) is None
  # Where a search found Zero-1 a larger micro-batch than the baseline's, its saving is what fits: no note.
  edged = [dataclasses.replace(row, searched=searched(edge)) for row, edge in zip(rows, (16, 24))]
  assert saves_little(edged[1], edged) is None
  assert saves_little(dataclasses.replace(edged[1], searched=searched(16)), edged) is not None
