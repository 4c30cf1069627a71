"""One lever's training step: ``one`` program, as Tunix's trainers and a user's own ``nnx.jit`` loop compile
it, or ``split`` in two, as MaxText's engine does (the gradients, then the update: the state donated)."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_zero1 import Zero1Optimizer, Zero1Options, value_and_grad_accumulated

# Not public (listed for the planner in nnx_zero1/_src/companion.py): a program boundary drops the metadata
# that says gradients are already on Zero-1's layout, and the split step's update program puts it back.
from nnx_zero1._src.companion import mark_zero1_grads
from nnx_zero1_plan.abstract import AbstractState, abstract_state
from nnx_zero1_plan.inputs import error_line
from nnx_zero1_plan.levers import Lever, state_axes, summed_over
from nnx_zero1_plan.mesh_axes import batch_axes
from nnx_zero1_plan.request import OPTIMIZER_MENU


@dataclasses.dataclass(frozen=True)
class StepShape:
  """What one compile of a step is for, besides the lever and the model."""

  batch: int  # the global micro-batch, in sequences
  seq_len: int  # tokens per sequence
  ga: int  # micro-batches per optimizer step
  optimizer: str  # the --optimizer name
  offload_fraction: float = 0.0  # the offload-fraction lever's share of the state in host memory


def _menu_transformation(name: str) -> Callable[..., optax.GradientTransformation]:
  rate, fixed = OPTIMIZER_MENU[name]
  return lambda learning_rate=float(rate), **options: getattr(optax, name)(learning_rate, **fixed, **options)


# The --optimizer menu as transformations, the planner's and the benchmarks': each takes the learning rate
# (and optax's options), by default the menu's, at which it is the code the recommendation prints.
OPTIMIZERS = {name: _menu_transformation(name) for name in OPTIMIZER_MENU}


def trained(model: Any) -> type[nnx.Param]:
  """The variables a step trains: ``nnx.LoRAParam`` where the model has any (a LoRA run), else every
  ``nnx.Param``, as Tunix's ``PeftTrainer`` decides (``tunix.sft.utils.is_lora_enabled``)."""
  lora = any(isinstance(v, nnx.LoRAParam) for _, v in nnx.iter_graph(model))
  return nnx.LoRAParam if lora else nnx.Param


def make_optimizer(lever: Lever, model: Any, tx: optax.GradientTransformation,
                   mesh: Mesh | None) -> nnx.Optimizer:
  """The lever's optimizer for ``model``'s :func:`trained` variables: ``nnx.Optimizer``, or ``Zero1Optimizer``
  built from a :class:`~nnx_zero1.Zero1Options` record of the lever's options."""
  wrt = trained(model)
  if not lever.zero1:
    return nnx.Optimizer(model, tx, wrt=wrt)
  return Zero1Optimizer(model, tx, mesh, options=Zero1Options(**lever.optimizer_options), wrt=wrt)


def scan_value_and_grad(loss_fn: Callable, model: nnx.Module, batches: Any,
                        wrt: Any = nnx.Param) -> tuple[jax.Array, Any]:
  """Mean loss and gradient over ``batches`` (dimension 0: micro-batches): a ``lax.scan`` of
  ``jax.value_and_grad`` over the ``wrt`` variables (a LoRA run's frozen weights stay constants), the
  reduction across replicas wherever XLA puts it."""
  graphdef, params, rest = nnx.split(model, wrt, ...)  # type: ignore[misc]  # flax types split as variadic
  grad_fn = jax.value_and_grad(lambda p, batch: loss_fn(nnx.merge(graphdef, p, rest), batch))

  def micro(total, batch):
    return jax.tree.map(jnp.add, total, grad_fn(params, batch)), None

  zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
  (loss, grads), _ = jax.lax.scan(micro, zero, batches)
  n = jax.tree.leaves(batches)[0].shape[0]
  return loss / n, jax.tree.map(lambda g: g / n, grads)


def abstract_batch(lever: Lever, mesh: Mesh, batch: int, seq_len: int, ga: int) -> jax.ShapeDtypeStruct:
  """One step's token ids: ``(ga * batch, seq_len + 1)`` rows over the batch axes for a deferred
  reduction (``value_and_grad_accumulated`` splits them), else ``(ga, batch, seq_len + 1)``."""
  axes = batch_axes(mesh.axis_names)
  rows, spec = ((ga * batch,), P(axes)) if lever.deferred else ((ga, batch), P(None, axes))
  return jax.ShapeDtypeStruct((*rows, seq_len + 1), jnp.int32, sharding=NamedSharding(mesh, spec))


def _gradients(model: Any, optimizer: Any, lever: Lever, loss_fn: Callable, batch: Any, ga: int) -> Any:
  if lever.deferred:
    # On an Auto mesh the batch's layout is not in its traced type: the axes are named. The mesh is the
    # one the step is traced under (a plain optimizer has none of its own).
    axes = summed_over(jax.sharding.get_abstract_mesh().axis_names, state_axes(lever))
    return value_and_grad_accumulated(loss_fn, model, batch, micro_batches=ga, optimizer=optimizer,
                                      data_axis=axes, **lever.accumulate_options)
  return scan_value_and_grad(loss_fn, model, batch, optimizer.wrt)


def _built(lever: Lever, build_model: Callable[[], Any], optimizer: str, mesh: Mesh) -> tuple[Any, Any]:
  model = build_model()
  return model, make_optimizer(lever, model, OPTIMIZERS[optimizer](), mesh)


def lever_state(lever: Lever, build_model: Callable[[], Any], optimizer: str, mesh: Mesh) -> AbstractState:
  """The lever's model and optimizer, abstract, on ``mesh``."""
  return abstract_state(lambda: _built(lever, build_model, optimizer, mesh), mesh)


def step_jit(graphdef: Any, shardings: Any, batch_sharding: NamedSharding, lever: Lever, loss_fn: Callable,
             ga: int) -> Any:
  """The one-program step, jitted, ``(state, batch) -> (state, loss)``: the state donated and kept on
  ``shardings``, the loss replicated."""

  def step(state, batch):
    model, optimizer = nnx.merge(graphdef, state)
    loss, grads = _gradients(model, optimizer, lever, loss_fn, batch, ga)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), loss

  replicated = NamedSharding(batch_sharding.mesh, P())
  return jax.jit(step, in_shardings=(shardings, batch_sharding), out_shardings=(shardings, replicated),
                 donate_argnums=0)


def compile_step(lever: Lever, state: AbstractState, loss_fn: Callable, mesh: Mesh, batch: int, seq_len: int,
                 ga: int, compiler_options: Mapping[str, Any] | None = None) -> tuple[Any, float]:
  """Compiles the lever's one-program step for the mesh's devices (``compiler_options``: the compiler's, e.g.
  what makes XLA's GPU compiler write its schedule); returns (compiled, seconds). The compiler's refusal
  (e.g. the program does not fit) is jax's ``JaxRuntimeError``."""
  tokens = abstract_batch(lever, mesh, batch, seq_len, ga)
  step = step_jit(state.graphdef, state.shardings, tokens.sharding, lever, loss_fn, ga)
  start = time.perf_counter()
  with jax.set_mesh(mesh):
    compiled = step.lower(state.state, tokens).compile(compiler_options)
  return compiled, time.perf_counter() - start


def compile_split(lever: Lever, state: AbstractState, loss_fn: Callable, mesh: Mesh, batch: int, seq_len: int,
                  ga: int, compiler_options: Mapping[str, Any] | None = None) -> tuple[Any, Any, float]:
  """Compiles the lever's step as two programs (:func:`compile_step`'s options for both); returns (gradient
  program, update program, seconds). The update program takes the gradients as the first leaves them (its
  output shardings), as a loop calling one after the other passes them."""
  graphdef, tokens = state.graphdef, abstract_batch(lever, mesh, batch, seq_len, ga)

  def grads(state, batch):
    model, optimizer = nnx.merge(graphdef, state)
    loss, g = _gradients(model, optimizer, lever, loss_fn, batch, ga)
    return g, loss

  def update(state, grads):
    model, optimizer = nnx.merge(graphdef, state)
    if lever.zero1 and lever.deferred:  # reduce-scattered; the mark is metadata no program boundary keeps
      grads = mark_zero1_grads(grads)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer))

  # Any, as step_jit's: jax types compile()'s options narrower than the options a caller passes.
  grads_jit: Any = jax.jit(grads, in_shardings=(state.shardings, tokens.sharding))
  update_jit: Any = jax.jit(update, out_shardings=state.shardings, donate_argnums=0)
  start = time.perf_counter()
  with jax.set_mesh(mesh):
    grads_compiled = grads_jit.lower(state.state, tokens).compile(compiler_options)
    shapes, _ = jax.eval_shape(grads_jit, state.state, tokens)
    left = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes,
                        grads_compiled.output_shardings[0])
    update_compiled = update_jit.lower(state.state, left).compile(compiler_options)
  return grads_compiled, update_compiled, time.perf_counter() - start


def placed_state(lever: Lever, build_model: Callable[[], Any], optimizer: str, mesh: Mesh,
                 abstract: AbstractState | None = None) -> tuple[AbstractState, Any]:
  """The lever's model and optimizer built for real and placed on the mesh's devices, as a run starts:
  ``(abstract, state)``, the :class:`~nnx_zero1_plan.abstract.AbstractState` a step was compiled for
  (``abstract``, or :func:`lever_state`'s) and the state's arrays on its shardings."""
  abstract = abstract or lever_state(lever, build_model, optimizer, mesh)
  with jax.set_mesh(mesh):
    state = nnx.state(_built(lever, build_model, optimizer, mesh))
  return abstract, jax.device_put(state, abstract.shardings)


def placed_batch(lever: Lever, mesh: Mesh, batch: int, seq_len: int, ga: int) -> jax.Array:
  """One step's token ids for a run (:func:`abstract_batch`'s shape and layout), drawn at random, seed 0."""
  spec = abstract_batch(lever, mesh, batch, seq_len, ga)
  ids = np.random.default_rng(0).integers(0, 1000, spec.shape, dtype=np.int32)
  return jax.device_put(ids, spec.sharding)


@dataclasses.dataclass(frozen=True)
class StepRuns:
  """What :func:`run_steps` measured. ``held_bytes`` is the allocator's ``bytes_in_use`` on the first device
  after the steps: the state and what the runtime kept, not the program's temporaries (a TPU's are outside it:
  the program's peak is the compiler's figure, which the chip enforces); None where the backend has none."""

  step_s: float | None  # the median of the timed steps, in seconds (None: none ran)
  times_s: tuple[float, ...]  # every step's seconds, the warm-up steps first
  held_bytes: int | None
  loss: float | None  # the last step's loss (None: none ran)
  error: str | None  # why the steps stopped, in one line (None: every step ran)


def run_steps(compiled: Callable[[Any, Any], tuple[Any, Any]], state: Any, batch: Any, *, warmup: int = 2,
              timed: int = 8) -> tuple[Any, StepRuns]:
  """Runs a compiled step (:func:`step_jit`'s, the state donated) ``warmup + timed`` times on its devices and
  times each to its loss being ready; returns the state after the last step that ran, and :class:`StepRuns`.

  The warm-up steps carry the allocator's growth and the program's first load, so only the ``timed`` ones
  count, by their median. An error (the allocator's out-of-memory) stops the steps and is kept in one line,
  not raised: a measurement says what ran."""
  times: list[float] = []
  loss, error = None, None
  try:
    for _ in range(warmup + timed):
      start = time.perf_counter()
      state, loss = compiled(state, batch)
      loss.block_until_ready()
      times.append(time.perf_counter() - start)
  except Exception as e:  # the allocator's out-of-memory is a JaxRuntimeError; any error is the run's answer
    error = error_line(e)
  counted = times[warmup:] or times
  first = min(jax.tree.leaves(batch)[0].devices(), key=lambda d: d.id)
  held = (first.memory_stats() or {}).get("bytes_in_use")
  return state, StepRuns(statistics.median(counted) if counted else None, tuple(times),
                         None if held is None else int(held), None if loss is None else float(loss), error)
