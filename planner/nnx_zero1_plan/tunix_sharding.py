"""Tunix's activation constraints, applied while tracing: Tunix's ``shard`` constrains only where the first
device is not a CPU (google-tunix 0.1.7), and the planner traces on jax's CPU backend."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from nnx_zero1_plan.inputs import PlanError

TUNIX_SHARDING = ("default", "none")  # --tunix-sharding's names; anything else is JSON of act_* fields
DATA_AXES = ("replica", "data")  # what a Tunix user adds to the batch entry, in the batch's own order


def _axes(entry: Any) -> tuple[str, ...]:
  return tuple(a for a in (entry if isinstance(entry, tuple | list) else (entry,)) if a is not None)


def _entry(axes: Sequence[str]) -> str | tuple[str, ...] | None:
  # as nnx_zero1._src.specs.axes_entry, which this module would import jax for
  return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def activation_fields(shd_config: Any) -> dict[str, tuple]:
  """The ``act_*`` fields of a Tunix ``ShardingConfig``: the specs its ``shard`` calls apply."""
  values = ((f.name, getattr(shd_config, f.name)) for f in dataclasses.fields(shd_config))
  return {f: tuple(v) for f, v in values if f.startswith("act_") and v is not None}


def activation_specs(specs: Mapping[str, Sequence[Any]], axes: Iterable[str],
                     add_data_axes: bool = True) -> dict[str, tuple]:
  """Tunix activation ``specs`` (``ShardingConfig`` field -> spec, entry 0 the batch's) as they apply on a
  mesh with ``axes``: every axis the mesh lacks dropped and, with ``add_data_axes``, the mesh's data axes
  (:data:`DATA_AXES`) put in front of each batch entry (without them each data replica computes its ``fsdp``
  group's whole batch)."""
  on_mesh = tuple(axes)
  result = {}
  for field, spec in specs.items():
    entries = [[a for a in _axes(e) if a in on_mesh] for e in spec]
    if add_data_axes and entries:
      entries[0] = [a for a in DATA_AXES if a in on_mesh and a not in entries[0]] + entries[0]
    result[field] = tuple(_entry(e) for e in entries)
  return result


def _given(option: str, known: Iterable[str]) -> dict[str, tuple]:
  """A JSON ``--tunix-sharding``: ``act_*`` field -> spec (entries null, an axis, or a list of axes)."""
  try:
    given = json.loads(option)
  except json.JSONDecodeError:
    given = None
  is_entry = lambda e: e is None or isinstance(e, str) or (isinstance(e, list) and
                                                          all(isinstance(a, str) for a in e))
  is_spec = lambda s: isinstance(s, list) and all(map(is_entry, s))
  if not isinstance(given, dict) or not all(map(is_spec, given.values())):
    raise PlanError(f"--tunix-sharding {option!r}: {' or '.join(TUNIX_SHARDING)}, or a JSON object of "
                    'ShardingConfig act_* fields, e.g. {"act_btd": [["data", "fsdp"], null, "tp"]}')
  unknown = sorted(set(given) - set(known))
  if unknown:
    raise PlanError(f"--tunix-sharding names {', '.join(unknown)}; this model's activation fields: "
                    f"{', '.join(sorted(known))}")
  return {f: tuple(tuple(e) if isinstance(e, list) else e for e in s) for f, s in given.items()}


def specs_for(defaults: Mapping[str, tuple], option: str, axes: Iterable[str]) -> dict[str, tuple] | None:
  """The activation specs ``--tunix-sharding`` (``option``: ``default``, ``none`` or a JSON object of
  ``act_*`` fields) applies on a mesh with ``axes``, over the model's own (``defaults``); None for ``none``.

  Raises:
    PlanError: an option neither name nor such a JSON object, or a field the model does not have.
  """
  if option == "none":
    return None
  if option == "default":
    return activation_specs(defaults, axes)
  return activation_specs({**defaults, **_given(option, defaults)}, axes, add_data_axes=False)


def constrain(x: Any, spec: Sequence[Any], eager: bool = False) -> Any:
  """Tunix's ``shard`` as it runs on the chips: ``x`` constrained to ``spec`` on the abstract mesh in context,
  less its manual axes (inside the ``*-accum`` levers' ``shard_map`` they cannot be named). ``eager``
  (``device_put``) means the same thing in a traced program."""
  import jax
  from jax.sharding import PartitionSpec as P

  del eager
  mesh = jax.sharding.get_abstract_mesh()
  auto = [a for a in mesh.axis_names if a not in mesh.manual_axes]
  if mesh.empty or not auto:
    return x
  kept = P(*(_entry([a for a in _axes(e) if a in auto]) for e in spec))
  return jax.lax.with_sharding_constraint(x, kept)


@contextlib.contextmanager
def tunix_constraints(modules: Iterable[Any]) -> Iterator[None]:
  """Within: each module's ``shard`` is :func:`constrain`; restored after.

  Making Tunix's check for a CPU see a TPU would mean changing jax's backend or jax itself, for the whole
  process; swapping Tunix's one-line function for one that does what its last line does touches Tunix
  only, and only while the model is traced (the planner traces in one thread).
  """
  saved = [(m, m.shard) for m in modules if callable(getattr(m, "shard", None))]
  for module, _ in saved:
    module.shard = constrain
  try:
    yield
  finally:
    for module, shard in saved:
      module.shard = shard

