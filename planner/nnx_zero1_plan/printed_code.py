"""The code a plan prints for the lever it recommends, as its users paste it in its three homes: their own
loop's ``Zero1Optimizer``, Tunix's trainer and its config, MaxText's engine attributes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nnx_zero1_plan.inputs import BACKENDS, LORA_ALPHA, Backend, ModelRef, lora_modules
from nnx_zero1_plan.levers import Lever, engine_attributes, state_axes, summed_over, with_offload
from nnx_zero1_plan.mesh_axes import batch_axes
from nnx_zero1_plan.request import DEFAULT_OPTIMIZER, OPTIMIZER_CODE


def _spelled(value: Any) -> str:
  """An option's value as code: a dtype's name (the levers hold them as strings) is ``jnp``'s."""
  return f"jnp.{value}" if isinstance(value, str) else repr(value)


def mesh_code(mesh: Mapping[str, int] | None, backend: Backend = BACKENDS["tpu"], domains: int = 1
              ) -> list[str]:
  """The lines that build the mesh a plan compiled (None: one ``data`` axis of size 1), ``replica`` outermost
  across the ``domains`` slices or nodes, every axis Auto: the imports, a blank line, then ``mesh = ...``.

  One slice or node: ``jax.make_mesh``, which refuses devices of several slices. TPU slices:
  ``mesh_utils.create_hybrid_device_mesh``. GPU nodes: the devices ordered node by node, then shaped (XLA
  numbers a GPU cluster's hosts as slices, a compile-only topology's nodes by ``process_index``)."""
  axes = dict(mesh or {"data": 1})
  names, sizes = repr(tuple(axes)), repr(tuple(axes.values()))
  types = "(AxisType.Auto,)" + (f" * {len(axes)}" if len(axes) > 1 else "")
  pod = domains > 1 and axes.get("replica") == domains
  if pod and backend.domain == "slices":
    inside = tuple(1 if k == "replica" else v for k, v in axes.items())
    across = tuple(domains if k == "replica" else 1 for k in axes)
    return ["from jax.experimental import mesh_utils", "from jax.sharding import AxisType, Mesh", "",
            "devices = jax.devices()",
            f"# replica across the {domains} slices (the data-center network), the other axes inside each "
            "slice",
            f"mesh = Mesh(mesh_utils.create_hybrid_device_mesh({inside}, {across}, devices, "
            "allow_split_physical_axes=True),",
            f"            {names}, axis_types={types})"]
  if pod:
    return ["import numpy as np", "from jax.sharding import AxisType, Mesh", "",
            "devices = jax.devices()",
            f"# replica across the {domains} nodes, outermost: the devices node by node (XLA numbers a "
            "cluster's hosts as",
            "# slices, which jax.make_mesh refuses; a compile-only topology numbers its nodes as processes)",
            "by_node = sorted(devices, key=lambda d: (getattr(d, 'slice_index', 0), d.process_index, d.id))",
            f"mesh = Mesh(np.array(by_node).reshape{sizes}, {names}, axis_types={types})"]
  return ["from jax.sharding import AxisType", "", "devices = jax.devices()",
          f"mesh = jax.make_mesh({sizes}, {names}, {types}, devices=devices)"]


def _tuples(value: Any) -> Any:
  """A JSON value with its lists as tuples: activation specs as ``ShardingConfig`` spells them."""
  return tuple(_tuples(v) for v in value) if isinstance(value, list | tuple) else value


def _lora_lines(model: ModelRef, rank: int) -> list[str]:
  """The lines that apply ``--lora``'s adapters to a ``tunix:`` model as planned, after ``model = ...``."""
  provider = (f"qwix.LoraProvider(module_path={lora_modules(model.name)!r}, rank={rank}, "
              f"alpha={LORA_ALPHA})")
  return ["  # LoRA as planned: the trainer sees nnx.LoRAParam s and trains only them (wrt=nnx.LoRAParam)",
          f"  model = qwix.apply_lora_to_model(model, {provider},",
          "                                    **model.get_model_input(), rngs=nnx.Rngs(1))"]


def _tunix_code(lever: Lever, options: list[str], mesh_lines: list[str], mesh: Mapping[str, int] | None,
                tx: str, activation_sharding: Any, lora: list[str]) -> list[str]:
  """Tunix's trainer on the plan's mesh: the batch over its data axes, Zero-1's options as the config's."""
  batch = batch_axes(mesh or {"data": 1})
  config = [f"data_sharding_axis=({batch!r},)"]
  if lever.zero1:
    named = "data_axis" in lever.optimizer_options
    config += [*([] if named else ["zero1_data_axis='data'"]), *(f"zero1_{o}" for o in options)]
  trainer = ("Zero1PeftTrainer", "Zero1TrainingConfig") if lever.zero1 else ("PeftTrainer", "TrainingConfig")
  imports = ("from nnx_zero1.adapters.tunix import Zero1PeftTrainer, Zero1TrainingConfig" if lever.zero1
             else "from tunix.sft.peft_trainer import PeftTrainer, TrainingConfig")
  lines = ["import jax, jax.numpy as jnp, optax" + (", qwix\nfrom flax import nnx" if lora else ""), imports,
           *mesh_lines]
  if isinstance(activation_sharding, dict):
    specs = {k: _tuples(v) for k, v in activation_sharding.items()}
    lines += ["# the activations' sharding the plan compiled (ShardingConfig act_* fields, the data axes in "
              "each batch entry):",
              "# build the model with "
              "shd_config=dataclasses.replace(config.shd_config, **activation_sharding)",
              f"activation_sharding = {specs!r}"]
  return lines + ["with mesh:  # Tunix reads its mesh from this context",
                  "  model = ...  # your model, built here", *lora,
                  f"  trainer = {trainer[0]}(model, {tx}, {trainer[1]}(..., {', '.join(config)}))"
                  + _rate_note(tx)]


def lever_code(name: str, model: ModelRef, offload_fraction: float | None = None,
               mesh: Mapping[str, int] | None = None, optimizer: str = DEFAULT_OPTIMIZER, *,
               backend: Backend = BACKENDS["tpu"], domains: int = 1, activation_sharding: Any = None,
               lora: int | None = None) -> str:
  """The code that turns lever ``name`` on where ``model``'s users train, as they paste it, written from the
  lever table (a new lever needs no entry here): Python source whose ``model = ...`` is the user's own line,
  or for an engine one sentence. The other arguments are the plan's (``offload_fraction``: the share of the
  state it offloads; ``activation_sharding``: a ``tunix:`` plan's specs; ``lora``: ``--lora``'s rank)."""
  tx = OPTIMIZER_CODE[optimizer]
  lever = with_offload(name, offload_fraction)
  options = [f"{k}={_spelled(v)}" for k, v in lever.optimizer_options.items()]
  if model.kind.engine:
    attributes = engine_attributes(name, lever)
    if attributes is None:
      return "MaxText's own MaxTextTrainingEngine"
    spelled = "; ".join(f"{k} = {_spelled(v)}" for k, v in attributes.items())
    return "Zero1MaxTextTrainingEngine (nnx_zero1.adapters.maxtext)" + (f" subclassed with {spelled}"
                                                                      if spelled else "")
  mesh_lines = mesh_code(mesh, backend, domains)
  if model.kind.trainer:
    adapters = [] if lora is None else _lora_lines(model, lora)
    lines = _tunix_code(lever, options, mesh_lines, mesh, tx, activation_sharding, adapters)
    if lever.deferred:  # Tunix's trainer accumulates with optax.MultiSteps, reduced every micro-batch
      lines[1] += "\nfrom nnx_zero1 import value_and_grad_accumulated"
      lines += ["  # this lever's gradients are value_and_grad_accumulated's, in your own nnx.jit step "
                "(Tunix's trainer computes its own):", _accumulate_line(lever, mesh, "trainer.optimizer")]
    return "\n".join(lines)
  if not lever.zero1:
    built = f"optimizer = nnx.Optimizer(model, {tx}, wrt=nnx.{'Param' if lora is None else 'LoRAParam'})"
    imports = ["import jax, optax", "from flax import nnx"]
  else:
    wrt = [] if lora is None else ["wrt=nnx.LoRAParam"]
    built = f"optimizer = Zero1Optimizer({', '.join(['model', tx, 'mesh', *options, *wrt])})"
    imports = ["import jax, jax.numpy as jnp, optax", "from nnx_zero1 import Zero1Optimizer"]
  lines = [*imports, *mesh_lines, "with jax.set_mesh(mesh):",
           "  model = ...  # your model, built here: its parameters' sharding names the mesh's axes",
           f"  {built}{_rate_note(tx)}"]
  if lever.deferred:
    lines[1] += ", value_and_grad_accumulated"
    lines.append(_accumulate_line(lever, mesh, "optimizer"))
  return "\n".join(lines)


def _rate_note(tx: str) -> str:
  """The comment that says where the learning rate goes in ``tx``, an optax call (its first argument)."""
  rate = tx[tx.index("(") + 1:].split(",")[0].removesuffix(")")
  return f"  # {rate}: your learning rate (or an optax schedule)"


def _accumulate_line(lever: Lever, mesh: Mapping[str, int] | None, optimizer: str) -> str:
  """The comment that gives a deferred lever's gradient call, its options and the axes it sums over."""
  accumulate = "".join(f", {k}={_spelled(v)}" for k, v in lever.accumulate_options.items())
  own = state_axes(lever)
  summed = summed_over(tuple(mesh or {}), own)
  if summed != own:  # a pod's batch is split over replica too: the gradients are summed over it
    accumulate += f", data_axis={summed!r}"
  return ("  # each step: loss, grads = value_and_grad_accumulated(loss_fn, model, batch, "
          f"micro_batches=GA, optimizer={optimizer}{accumulate})")
