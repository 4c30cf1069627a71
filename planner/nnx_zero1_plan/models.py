"""The models the planner builds, abstractly: Tunix's named configurations (``tunix:CONFIG``, of the family
the name starts with) and the user's own function (docs/planner.md's "Your own model")."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pathlib
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from nnx_zero1_plan.inputs import (
  LORA_ALPHA,
  TUNIX_FAMILIES,
  ModelRef,
  PlanError,
  lora_modules,
  parse_model,
  shortened,
  tunix_family,
)
from nnx_zero1_plan.tunix_sharding import activation_fields, specs_for, tunix_constraints


@dataclasses.dataclass(frozen=True)
class ModelSource:
  """How to build one model abstractly, at full or reduced depth, and score it."""

  name: str
  build: Callable[[int | None], Any]  # depth (None: full) -> nnx.Module; called under nnx.eval_shape
  full_depth: int | None  # layers at full depth; None: depth cannot be reduced
  loss_fn: Callable[[Any, jax.Array], jax.Array]
  # mesh axes -> the activation specs applied, or "none"; None: not a tunix: model
  activation_sharding: Callable[[Iterable[str]], dict[str, tuple] | str] | None = None


def next_token_loss(logits: jax.Array, tokens: jax.Array) -> jax.Array:
  """Mean cross-entropy of ``logits`` (for ``tokens[:, :-1]``) against ``tokens[:, 1:]``."""
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tokens[:, 1:]).mean()


def tunix_loss(model: Any, tokens: jax.Array) -> jax.Array:
  """Next-token loss of a Tunix decoder: causal mask and positions as Tunix's trainers pass them."""
  inputs = tokens[:, :-1]
  rows, length = inputs.shape
  positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (rows, length))
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((length, length), jnp.bool_)), (rows, length, length))
  logits, _ = model(inputs, positions, None, mask)
  return next_token_loss(logits, tokens)


def with_lora(model: Any, rank: int, module_path: str, alpha: float = LORA_ALPHA) -> Any:
  """``model`` with qwix's LoRA adapters (``nnx.LoRAParam`` s of ``rank``) on the modules ``module_path``
  matches, applied as Tunix applies them (``qwix.apply_lora_to_model`` on the model's own sample input): under
  ``nnx.eval_shape`` the adapters are shapes, their sharding the weights'."""
  from flax import nnx

  try:
    import qwix
  except ImportError as e:
    raise PlanError(f"--lora applies qwix's LoRA, as Tunix does: pip install qwix ({e})") from e
  provider = qwix.LoraProvider(module_path=module_path, rank=rank, alpha=alpha)
  adapted = qwix.apply_lora_to_model(model, provider, **model.get_model_input(), rngs=nnx.Rngs(1))
  if not any(isinstance(v, nnx.LoRAParam) for _, v in nnx.iter_graph(adapted)):
    raise PlanError(f"--lora: qwix adapted none of {type(model).__name__}'s modules ({module_path})")
  return adapted


def _tunix_family(name: str) -> tuple[Any, Any]:
  family = tunix_family(name)
  if family is None:
    raise PlanError(f"unknown model tunix:{name}; Tunix families: {', '.join(TUNIX_FAMILIES)} "
                    f"(e.g. tunix:qwen3_8b, tunix:llama3p1_8b, tunix:gemma3_4b_pt)")
  import flax

  always_shard = flax.config.flax_always_shard_variable
  try:
    module = importlib.import_module(f"tunix.models.{family}.model")
  except ImportError as e:
    raise PlanError(f"tunix:{name} needs Tunix: pip install \".[tunix]\" ({e})") from e
  finally:  # Tunix's import turns flax's flag off for the whole process; the build scopes it instead
    flax.config.update("flax_always_shard_variable", always_shard)
  return module, getattr(module, family.capitalize())


def _tunix_source(ref: ModelRef, param_dtype: str | None, compute_dtype: str | None, remat: str | None,
                  tunix_sharding: str, lora: int | None) -> ModelSource:
  module, cls = _tunix_family(ref.name)
  make_config = getattr(module.ModelConfig, ref.name, None)
  if make_config is None:
    known = sorted(n for n, v in vars(module.ModelConfig).items() if isinstance(v, classmethod))
    raise PlanError(f"unknown model {ref}; {module.__name__}.ModelConfig has {', '.join(known)}")
  config = make_config()
  changes: dict[str, Any] = {}
  for field, value in (("param_dtype", param_dtype), ("dtype", compute_dtype)):
    if value is not None and hasattr(config, field):
      changes[field] = jnp.dtype(value)
  # A family without a param_dtype field (llama3) gets its parameters cast after the build; one
  # without a dtype field (llama3, gemma3) computes in its parameters' dtype.
  cast_to = None if param_dtype is None or hasattr(config, "param_dtype") else jnp.dtype(param_dtype)
  computes_in = changes.get("param_dtype", cast_to)
  if compute_dtype is not None and not hasattr(config, "dtype") and jnp.dtype(compute_dtype) != computes_in:
    raise PlanError(f"{ref} computes in its parameters' dtype (its ModelConfig has no dtype): give "
                    f"--param-dtype {compute_dtype}, or leave --compute-dtype out")
  if remat is not None:
    options = [m.name.lower() for m in module.RematConfig]
    if remat.lower() not in options:
      raise PlanError(f"--remat {remat!r} is not one of {ref}'s {', '.join(options)}")
    changes["remat_config"] = module.RematConfig[remat.upper()]
  config = dataclasses.replace(config, **changes)
  defaults = activation_fields(config.shd_config)
  specs_on = lambda axes: specs_for(defaults, tunix_sharding, axes)
  specs_on(())  # a malformed --tunix-sharding is refused before any compile

  def described(axes: Iterable[str]) -> dict[str, tuple] | str:
    specs = specs_on(axes)
    return "none" if specs is None else specs

  def build(depth: int | None) -> Any:
    from flax import nnx

    # The activation specs name only the axes of the mesh the model is built on (none outside one).
    specs = specs_on(jax.sharding.get_abstract_mesh().axis_names)
    shd_config = config.shd_config if specs is None else dataclasses.replace(config.shd_config, **specs)
    with nnx.use_eager_sharding(False):  # shardings stay metadata; the plan reads them from there
      model = cls(dataclasses.replace(config, num_layers=depth or config.num_layers, shd_config=shd_config),
                  rngs=nnx.Rngs(0))
    model = model if cast_to is None else cast_params(model, cast_to)
    # After the cast: qwix gives each adapter its weight's dtype, as on a model loaded in that dtype.
    return model if lora is None else with_lora(model, lora, lora_modules(ref.name))

  # gemma3 calls tunix.utils.sharding_utils.shard; llama3, qwen2 and qwen3 their own module's shard.
  shard_modules = [m for m in (module, getattr(module, "sharding_utils", None)) if m is not None]

  def constrained_loss(model: Any, tokens: jax.Array) -> jax.Array:
    with tunix_constraints(shard_modules):
      return tunix_loss(model, tokens)

  return ModelSource(str(ref), build, config.num_layers,
                     tunix_loss if tunix_sharding == "none" else constrained_loss, described)


def cast_params(model: Any, dtype: Any) -> Any:
  """``model`` with every floating ``nnx.Param`` cast to ``dtype`` (its metadata kept)."""
  from flax import nnx

  params = nnx.state(model, nnx.Param)
  floating = lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
  nnx.update(model, jax.tree.map(floating, params))
  return model


def _raised(what: str, e: Exception) -> PlanError:
  """A user's code's exception as one line naming it (``--traceback`` shows where)."""
  first = next(iter(str(e).strip().splitlines()), "")
  return PlanError(f"{what} raised {type(e).__name__}" + (f": {shortened(first, 300)}" if first else "") +
                   " (--traceback shows where)")


def _where_to_find(module_name: str, error: ImportError) -> str:
  """What to do about a model module Python cannot find: the folder that holds it (here, two levels deep at
  most) to put on ``PYTHONPATH``. Empty when what is missing is one of the module's imports."""
  top = module_name.split(".")[0]
  if not isinstance(error, ModuleNotFoundError) or error.name != top:
    return ""
  root = pathlib.Path.cwd()
  patterns = (f"{top}.py", f"{top}/__init__.py", f"*/{top}.py", f"*/{top}/__init__.py", f"*/*/{top}.py")
  found = sorted({str(c.parent) for pattern in patterns for c in root.glob(pattern)})
  folder = found[0].removesuffix(f"/{top}") if found else None
  where = f" (PYTHONPATH={folder})" if folder else ""
  return (f"; the planner imports {top} by name: put the folder that holds {top}/ (or {top}.py) on "
          f"PYTHONPATH{where}")


def _function_source(ref: ModelRef, *settings: Any) -> ModelSource:
  """The user's own function's model (``settings``: those its kind takes, none)."""
  try:
    function = getattr(importlib.import_module(ref.source), ref.name)
  except ImportError as e:
    raise PlanError(f"unknown model {ref}: {e}{_where_to_find(ref.source, e)}") from e
  except AttributeError as e:
    raise PlanError(f"unknown model {ref}: {e}") from e
  except Exception as e:  # the module's own code, run on import
    raise _raised(f"importing {ref.source}", e) from e
  depth_parameter = inspect.signature(function).parameters.get("num_layers")
  full_depth = getattr(depth_parameter, "default", None)
  full_depth = full_depth if isinstance(full_depth, int) else None
  loss: list[Callable] = []

  def build(depth: int | None) -> Any:
    try:
      built = function(num_layers=depth) if depth is not None else function()
    except Exception as e:  # the user's builder: one line naming it, not the planner's traceback around it
      raise _raised(f"the model builder {ref}", e) from e
    model, *rest = built if isinstance(built, tuple) else (built,)
    loss[:] = rest[:1]
    return model

  def loss_fn(model: Any, tokens: jax.Array) -> jax.Array:
    return loss[0](model, tokens) if loss else next_token_loss(model(tokens[:, :-1]), tokens)

  return ModelSource(str(ref), build, full_depth, loss_fn)


def model_source(model: str | ModelRef, param_dtype: str | None = None, compute_dtype: str | None = None,
                 remat: str | None = None, tunix_sharding: str = "default",
                 lora: int | None = None) -> ModelSource:
  """The :class:`ModelSource` ``--model`` names, with the flags of the same names (``lora``: ``--lora``'s
  rank, None for full fine-tuning); an unknown model, or a flag it cannot take, refused."""
  ref = model if isinstance(model, ModelRef) else parse_model(model)
  ref.check_settings(param_dtype=param_dtype, compute_dtype=compute_dtype, remat=remat,
                     tunix_sharding=tunix_sharding, lora=lora)
  source = _SOURCES.get(ref.kind.name)
  if source is None:
    raise PlanError(f"{ref} is MaxText's engine, which builds its own model: plan it with plan() or the "
                    "command line")
  return source(ref, param_dtype, compute_dtype, remat, tunix_sharding, lora)


# The kinds whose models the planner builds (MODEL_KINDS), by name; an engine builds its own.
_SOURCES: dict[str, Callable[..., ModelSource]] = {"tunix": _tunix_source, "function": _function_source}
