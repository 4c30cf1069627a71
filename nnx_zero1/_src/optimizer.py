"""``Zero1Optimizer``: ``nnx.Optimizer`` with its state split over the data axis."""

from __future__ import annotations

from typing import Any, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax.nnx.training.optimizer import OptState
from jax.sharding import NamedSharding, PartitionSpec

from nnx_zero1._src.checks import check_grads, check_model, check_state
from nnx_zero1._src.compat import Filter
from nnx_zero1._src.construction import build_plan, init_masters, init_sharded_state, opt_state_init
from nnx_zero1._src.extra_args import partition_arrays, value_fn_at_home
from nnx_zero1._src.gather import gather_home
from nnx_zero1._src.layout_plan import Zero1Plan
from nnx_zero1._src.mesh import traced
from nnx_zero1._src.options import Zero1Options
from nnx_zero1._src.placement import current_sharding, off_mesh, place, place_tree
from nnx_zero1._src.specs import DataAxis, is_explicit
from nnx_zero1._src.storage import compute_shardings, load, store

__all__ = ["Zero1Optimizer", "mark_zero1_grads"]

M = TypeVar("M")

# Variable metadata on gradients that arrive already reduced onto the Zero-1 layout.
ON_ZERO1_LAYOUT = "zero1_layout"


def _grad_variables(grads: Any) -> list[nnx.Variable]:
  return [v for v in jax.tree.leaves(grads, is_leaf=lambda x: isinstance(x, nnx.Variable))
          if isinstance(v, nnx.Variable)]


def mark_zero1_grads(grads: nnx.State) -> nnx.State:
  """Marks gradients that are already on their optimizer's Zero-1 layout (reduce-scattered).

  ``Zero1Optimizer.update`` then does not pin them to their parameters' layout
  first (on an Auto mesh that pin would gather them back). Returns ``grads``.

  Example::

    >>> from flax import nnx
    >>> grads = nnx.state(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), nnx.Param)
    >>> _is_marked(mark_zero1_grads(grads))
    True
  """
  for var in _grad_variables(grads):
    var.set_metadata(**{ON_ZERO1_LAYOUT: True})
  return grads


def _is_marked(grads: Any) -> bool:
  variables = _grad_variables(grads)
  return bool(variables) and all(v.get_metadata().get(ON_ZERO1_LAYOUT, False) for v in variables)


def _only_record(options: Zero1Options, keywords: Zero1Options) -> Zero1Options:
  """``options``, refused when ``keywords`` (the keyword options beside it) asks for anything itself.

  Example::

    >>> _only_record(Zero1Options(strict=True), Zero1Options()).strict
    True
  """
  default = Zero1Options().keywords()
  clashing = sorted(name for name, value in keywords.keywords().items() if value != default[name])
  if clashing:
    raise TypeError(f"pass the options as options=Zero1Options(...) or as keywords, not both: "
                    f"{', '.join(clashing)} given beside options=")
  return options


class Zero1Optimizer(nnx.Optimizer[M]):
  """An ``nnx.Optimizer`` whose state is split over the data-parallel axis (ZeRO-1).

  Each of the N data-parallel replicas holds 1/N of every parameter-shaped
  optimizer leaf. ``update`` puts the gradients and parameters on that layout,
  runs ``tx`` on the slices and all-gathers the new parameters back to the
  layout they came in with. For elementwise optimizers the results are
  bit-identical to ``nnx.Optimizer``; ``nnx.state(opt)`` has the same tree, so
  checkpoints cross both ways.

  Example::

    >>> import jax, optax
    >>> from flax import nnx
    >>> from nnx_zero1 import Zero1Optimizer
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    >>> opt = Zero1Optimizer(model, optax.adamw(1e-3), mesh)
    >>> isinstance(opt, nnx.Optimizer)
    True

  Args:
    model: the NNX module whose ``wrt`` variables are optimised.
    tx: any optax transformation.
    mesh: the device mesh; defaults to the one set by ``jax.set_mesh`` (or a
      legacy ``with mesh:`` block), else the mesh the parameters' ``NamedSharding``
      names. The parameters must be on it already (built under ``jax.set_mesh``, or
      placed by their named sharding); one left on one device of a larger mesh is
      refused. With no mesh at all and the model on one device, the data-parallel
      size is 1: nothing is split and the optimizer behaves exactly as
      ``nnx.Optimizer`` (``report`` says so).
    wrt: which variables to optimise, as for ``nnx.Optimizer``.
    data_axis: the mesh axis (or tuple of axes) that data parallelism runs over.
    graph: passed through as for ``nnx.Optimizer``.
    strict: raise ``Zero1Error`` when some parameter-shaped leaf cannot be split
      (and, in ``value_and_grad_accumulated``, when the gradient reduction cannot
      be deferred), or when there is no mesh and the model is on one device.
    pin_gradients: on Auto meshes, hold traced gradients on their parameters'
      layout before slicing them, so the backward pass compiles as it would for
      ``nnx.Optimizer`` (bit-identical). ``False`` lets XLA turn the gradient
      all-reduce into a reduce-scatter at the price of reordered sums. Gradients
      that arrive reduce-scattered already (from ``value_and_grad_accumulated``
      or the engines, which mark them so) are never pinned.
    offload_state_to_host: keep the state's Zero-1 shards in host memory
      (``pinned_host``) between steps: no optimizer state in device memory
      outside ``update``, at the price of a host-to-device and a device-to-host
      copy of the 1/N shards every step. A fraction ``f`` in (0, 1) offloads only
      that share of the state's bytes per device, whole leaves, the largest first
      (device memory keeps at most ``1 - f`` of them, less by under one leaf), so
      only those are copied; master copies stay on device unless ``True``.
      ``report`` says where each leaf lives. Bit-identical to the state kept on
      device; the checkpoint tree is unchanged. The step count stays on device.
    state_dtype: store every floating, parameter-tied state leaf (Adam's ``mu``
      and ``nu``, momentum) in this dtype between steps, e.g. ``jnp.bfloat16``:
      half the state's bytes. ``update`` computes in the dtype ``tx`` creates the
      state in (float32 for float32 parameters) and narrows the result; scalars
      (the count) are untouched. The checkpoint holds the stored dtype.
    state_rounding: how ``state_dtype`` narrows: ``"stochastic"`` (the default;
      unbiased, float32 to bfloat16 only) or ``"nearest"``, which cannot record a
      change smaller than half a bfloat16 spacing (Adam's ``nu`` then never decays).
    master_dtype: for a bfloat16 (or float16) model, keep a copy of every
      parameter in this dtype (``jnp.float32``) on its Zero-1 layout, 1/N per
      device, as ``opt.master_params`` (checkpointed with ``nnx.state(opt)``):
      ``tx`` runs on the master slices and the gradient slices cast to it, and the
      model gets the new masters cast to its dtype through an all-gather in that
      dtype (half the bytes of a float32 one).
    params_across_dtype: on a pod (``data_axis=("replica", "data")``), with ``master_dtype``:
      the new parameters' all-gather over the slow data axes (all but the last listed) in
      ``jnp.int8`` (blocks of at most 256 values, a float32 scale each: a quarter of float32's
      bytes and the scales) or a narrower float; inside each slice at the model's precision.
      Every replica gets the same rounded parameters, the masters the exact ones (float32
      masters of a float32 model are allowed with it). Not bit-identical; one slice rounds nothing.
    options: every option above as one :class:`Zero1Options` record, passed on whole (as
      ``zero1_optimizers`` and the engines pass theirs); the keyword options are then left at
      their defaults.

  Raises:
    Zero1Error: before any state exists, when the mesh lacks the data axes,
      ``wrt`` selects no parameter, a parameter lives off the mesh (on other devices, or
      left on one device of it), optax's state
      cannot be tied to any parameter, ``strict`` finds a leaf that cannot be split,
      or ``offload_state_to_host`` finds no mesh or a device without host memory;
      a ``state_dtype`` that is not floating; a ``master_dtype`` that is not
      floating, for a model already in it (unless ``params_across_dtype``) or with a parameter
      that is not floating; either with no mesh; a ``params_across_dtype`` neither floating nor
      int8, without ``master_dtype``, with one data axis, or (floating) no narrower than the model.
    TypeError: ``options`` together with a keyword option away from its default.
  """

  def __init__(
      self,
      model: M,
      tx: optax.GradientTransformation,
      mesh: jax.sharding.Mesh | None = None,
      *,
      wrt: Filter = nnx.Param,
      data_axis: DataAxis = Zero1Options.data_axis,  # each option's default is the record's
      graph: bool | None = None,
      strict: bool = Zero1Options.strict,
      pin_gradients: bool = Zero1Options.pin_gradients,
      offload_state_to_host: bool | float = Zero1Options.offload_state_to_host,
      state_dtype: Any = Zero1Options.state_dtype,
      state_rounding: str = Zero1Options.state_rounding,
      master_dtype: Any = Zero1Options.master_dtype,
      params_across_dtype: Any = Zero1Options.params_across_dtype,
      options: Zero1Options | None = None,
  ):
    given = Zero1Options(data_axis=data_axis, strict=strict, pin_gradients=pin_gradients,
                         offload_state_to_host=offload_state_to_host, state_dtype=state_dtype,
                         state_rounding=state_rounding, master_dtype=master_dtype,
                         params_across_dtype=params_across_dtype)
    self._zero1_build(model, tx, mesh, wrt, graph, given if options is None else _only_record(options, given))

  def _zero1_build(self, model: Any, tx: optax.GradientTransformation, mesh: jax.sharding.Mesh | None,
                   wrt: Filter, graph: bool | None, options: Zero1Options) -> None:
    """Builds the optimizer from the checked options (what every constructor runs)."""
    param_state = nnx.state(model, wrt, graph=graph)
    plan = build_plan(tx, param_state, mesh, options, wrt)
    self.graph = graph
    self.tx = tx
    if plan.single_device:  # exactly nnx.Optimizer's state
      self.step = OptState(jnp.array(0, dtype=jnp.uint32))
      self.opt_state = nnx.data(opt_state_init(tx)(param_state))
    else:
      # The step count lives on the mesh from the start, replicated, as a jitted step returns
      # it: a trainer that does not re-place its optimizer before jit compiles once, not twice.
      self.step = OptState(place(jnp.array(0, dtype=jnp.uint32), NamedSharding(plan.mesh, PartitionSpec())))
      self.opt_state = nnx.data(init_sharded_state(tx, param_state, plan))
      if plan.master_dtype is not None:
        self.master_params = nnx.data(init_masters(param_state, plan))
    self.wrt = wrt
    self._zero1_plan = plan
    self.pin_gradients = options.pin_gradients
    self.strict = options.strict

  @property
  def zero1_plan(self) -> Zero1Plan:
    """Where every optimizer leaf lives, worked out once at construction (read-only).

    A frozen record: ``mesh`` and ``data_axis``; the parameters' treedef,
    shapes, their shardings as they were placed (``param_shardings``) and on
    the Zero-1 layout (``zero1_param_shardings``); one ``state_leaves`` entry per
    leaf of ``opt_state`` in tree-leaf order, with its ``path``, ``shape``,
    ``dtype``, ``sharding`` (memory kind included) and the ``reason`` it is not
    split (None when it is); ``single_device`` (no mesh, one device: nothing is
    placed) and ``offload_state``. ``report(opt)`` shows it as a table.
    """
    return self._zero1_plan

  @property
  def mesh(self) -> jax.sharding.Mesh:
    """The mesh the optimizer state is laid out on."""
    return self.zero1_plan.mesh

  @property
  def data_axis(self) -> tuple[str, ...]:
    """The data-parallel mesh axes the state is split over."""
    return self.zero1_plan.data_axis

  def update(self, model: M, grads, /, **kwargs) -> optax.Updates:
    """Applies one optimizer step, exactly as ``nnx.Optimizer.update`` does.

    Four phases: read and check; gradients, parameters and state onto the
    Zero-1 layout; ``tx.update`` on the slices; the new parameters back to the
    sharding they came in with (an all-gather), the state kept on its layout.

    Args:
      model: the model whose ``wrt`` parameters are updated in place.
      grads: the gradients, as ``nnx.grad`` returns them (an ``nnx.State``).
      **kwargs: passed to ``tx.update`` (``value=``, ``grad=``, ``value_fn=`` for
        optax's line searches; ``value_fn`` sees whole parameters).

    Returns:
      The updates, on the parameters' layout.

    Raises:
      Zero1Error: the model, gradients or state do not match what the optimizer
        was built for (tree, shapes, devices, mesh); nothing is changed.

    Example::

      >>> import jax, jax.numpy as jnp, optax
      >>> from flax import nnx
      >>> from nnx_zero1 import Zero1Optimizer
      >>> model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
      >>> opt = Zero1Optimizer(model, optax.sgd(0.1), jax.make_mesh((1,), ("data",)))
      >>> grads = nnx.grad(lambda m: m(jnp.ones((1, 2))).sum())(model)
      >>> _ = opt.update(model, grads)
      >>> int(opt.step[...])
      1
    """
    params, pure_grads, stored = _read_checked(self, model, grads)
    if self.zero1_plan.single_device:  # data-parallel size 1: nothing to split or move
      return super().update(model, grads, **kwargs)
    plan = self.zero1_plan
    pin = self.pin_gradients and not _is_marked(grads)
    homes, sliced = _onto_zero1_layout(plan, params, pure_grads, pin=pin)
    state, masters = load(plan, stored, _stored_masters(self))
    new_params, new_state, updates = _run_on_slices(self.tx, plan, _on_masters(sliced, masters), state, homes,
                                                    kwargs)
    new_state, new_masters = store(plan, new_state, new_params, step=self.step[...])
    if new_masters is not None:  # the model gets the masters in its own dtype: a narrower all-gather
      nnx.update(self.master_params, nnx.state(new_masters, graph=self.graph))
      new_params, updates = optax.tree.cast_like(new_params, params), optax.tree.cast_like(updates, params)
      if traced(new_params):  # the cast stays before the all-gather: the TPU compiler moves it after
        new_params = jax.lax.optimization_barrier(new_params)
    nnx.update(model, _over_old_parameters(gather_home(new_params, homes, plan), params, plan.mesh))
    nnx.update(self.opt_state, nnx.state(new_state, graph=self.graph))
    self.step[...] += 1
    return place_tree(updates, homes)


class _Slices(NamedTuple):
  """Gradients and parameters on the Zero-1 layout."""

  grads: Any
  params: Any


def _read_checked(opt: Zero1Optimizer, model: Any, grads: Any) -> tuple[Any, Any, Any]:
  """Read and check: the pure parameters, gradients and state, or ``Zero1Error`` before any change."""
  plan = opt.zero1_plan
  params = nnx.as_pure(nnx.state(model, opt.wrt, graph=opt.graph))
  pure_grads = nnx.as_pure(nnx.state(grads, opt.wrt, graph=opt.graph))
  check_model(params, plan)
  check_grads(pure_grads, params, plan)
  state = nnx.as_pure(opt.opt_state)
  check_state(state, plan)
  return params, pure_grads, state


def _onto_zero1_layout(plan: Zero1Plan, params: Any, grads: Any, *, pin: bool) -> tuple[list, _Slices]:
  """Onto the Zero-1 layout: the parameters' current layouts (where they go back to) and the slices.

  Arrays left on one device (a model built outside the mesh) first join the
  mesh on the layout recorded for them, where ``nnx.Optimizer``'s eager
  arithmetic under the mesh leaves them too.
  """
  params = place_tree(params, plan.param_shardings, only=off_mesh)
  grads = place_tree(grads, plan.param_shardings, only=off_mesh)
  homes = [current_sharding(x, s) for x, s in zip(jax.tree.leaves(params), plan.param_shardings)]
  if pin:
    # Pinned where they are (on an Auto mesh under jit: their parameters' layout), the
    # gradients keep XLA's sharding propagation from carrying the Zero-1 layout back
    # into the backward pass, where it would reorder sums. A no-op on Explicit meshes.
    pins = [current_sharding(g, s) for g, s in zip(jax.tree.leaves(grads), plan.param_shardings)]
    grads = place_tree(grads, pins)
  return homes, _Slices(
      grads=place_tree(grads, plan.zero1_param_shardings),
      params=place_tree(params, plan.zero1_param_shardings),
  )


def _stored_masters(opt: Zero1Optimizer) -> Any:
  """The master copies as stored (pure), or None when the optimizer keeps none."""
  return nnx.as_pure(opt.master_params) if opt.zero1_plan.master_dtype is not None else None


def _on_masters(sliced: _Slices, masters: Any) -> _Slices:
  """What ``tx`` runs on: the master copies and the gradient slices cast to them, as on a model in the
  master dtype; the slices as they are when there are no masters."""
  if masters is None:
    return sliced
  return _Slices(grads=optax.tree.cast_like(sliced.grads, masters), params=masters)


def _run_on_slices(
    tx: optax.GradientTransformation, plan: Zero1Plan, sliced: _Slices, state: Any, homes: list, kwargs: dict
) -> tuple[Any, Any, Any]:
  """Run the transformation on the slices: (new parameters, new state, updates), all still sliced."""
  kwargs = nnx.as_pure(kwargs)
  if callable(kwargs.get("value_fn")):  # optax's line searches evaluate it on the slices
    kwargs["value_fn"] = value_fn_at_home(kwargs["value_fn"], plan, homes)
  updates, new_state = _run_tx(tx, plan, sliced.grads, state, sliced.params, kwargs)
  new_params = optax.apply_updates(sliced.params, updates)
  return new_params, place_tree(new_state, compute_shardings(plan)), updates


def _run_tx(tx: optax.GradientTransformation, plan: Zero1Plan, grads, state, params, kwargs):
  """``tx.update`` on the slices. On an Explicit mesh the data axis is Auto inside it.

  optax code was written for arrays the data axis does not split; with Explicit
  sharding types some of it is then illegal (Muon's ``X @ X.T`` on a row-split
  ``X``). Inside ``auto_axes`` the compiler places the intermediates and the
  outputs land on the plan's layout; elementwise arithmetic is unchanged.
  Keyword arguments that are not arrays (a line search's ``value_fn``) are
  passed as they are, the arrays as inputs.
  """
  if not is_explicit(plan.mesh, plan.data_axis):
    return tx.update(grads, state, params, **kwargs)
  out_sharding = (
      jax.tree.unflatten(plan.param_treedef, plan.zero1_param_shardings),
      jax.tree.unflatten(jax.tree.structure(state), compute_shardings(plan)),
  )
  arrays, rebuild = partition_arrays(kwargs)
  run = lambda g, s, p, kw: tx.update(g, s, p, **rebuild(kw))
  return jax.sharding.auto_axes(run, axes=plan.data_axis, out_sharding=out_sharding)(
      grads, state, params, arrays
  )


def _over_old_parameters(new: Any, old: Any, mesh: Any) -> Any:
  """The gathered new parameters, written elementwise over the old ones when traced for TPUs.

  In one jitted step whose parameters are donated, the new parameters must land in
  the old parameters' buffers. ``nnx.Optimizer``'s come from an elementwise add that
  reads the old values and can write in place; Zero-1's come from an all-gather,
  which cannot, while the forward and backward passes still read the old values, so
  the TPU compiler gives those readers a copy of every parameter, live across the
  activation peak. A ``select`` on a predicate the compiler cannot fold (it passes an
  optimization barrier) reads the old parameters last and writes in place, as the
  add does; it always picks ``new``, so the values are unchanged to the bit. XLA's
  GPU compiler schedules the all-gathers into the donated buffers itself, and the
  ``select`` would cost it a gathered copy at the peak, so only a TPU mesh gets it.
  """
  if not traced(new):
    return new  # eager: every array is its own buffer already
  if _platform(mesh) != "tpu":
    return new
  take_new = jax.lax.optimization_barrier(jnp.ones((), dtype=bool))
  return jax.tree.map(lambda n, o: jnp.where(take_new, n, o), new, old)


def _platform(mesh: Any) -> str:
  """The platform of ``mesh``'s devices (jax's default backend for an abstract mesh)."""
  return mesh.devices.flat[0].platform if isinstance(mesh, jax.sharding.Mesh) else jax.default_backend()
