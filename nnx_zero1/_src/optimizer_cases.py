"""The optax transformations this project runs, in one list.

The tests compare each against ``nnx.Optimizer`` (``tests/core/test_optimizer_coverage.py``,
whose results ``scripts/coverage_table.py`` turns into the docs' coverage table; the
bit-identity tests in ``tests/core/test_optimizer.py``); the benchmark's ``--optimizer``
choices (``benchmarks/settings.py``) are entries of it at a training learning rate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import optax

__all__ = ["CASES", "ELEMENTWISE_CONTRACT", "FROZEN", "OptimizerCase"]

FROZEN = "l1"  # the masked / multi_transform cases freeze the parameters whose path names this


def _frozen(params: Any) -> Any:
  return jax.tree_util.tree_map_with_path(lambda path, _: FROZEN in jax.tree_util.keystr(path), params)


def _trainable(params: Any) -> Any:
  return jax.tree.map(lambda frozen: not frozen, _frozen(params))


@dataclasses.dataclass(frozen=True)
class OptimizerCase:
  """One transformation: how to build it and what Zero-1 promises for it.

  Attributes:
    make: builds the transformation from a learning rate.
    learning_rate: the tests' rate, large so a few steps move the parameters;
      ``None`` for a line search.
    elementwise: ``True``: bit-identical to ``nnx.Optimizer`` by contract;
      ``False``: it reduces (norms, trust ratios), equal to float precision.
    freezes: leaves the parameters whose path names :data:`FROZEN` as they were.
    line_search: driven through ``update(model, grads, value=, grad=, value_fn=)``.

  Example::

    >>> case = CASES["adamw"]
    >>> case.elementwise, type(case.build()).__name__
    (True, 'GradientTransformationExtraArgs')
  """

  make: Callable[[Any], optax.GradientTransformation]  # from a learning rate
  learning_rate: float | None  # the tests' rate, large so a few steps move the parameters; None: line search
  elementwise: bool  # True: bit-identical to nnx.Optimizer; False: reductions, equal to float precision
  freezes: bool = False  # leaves the parameters under FROZEN as they were
  line_search: bool = False  # driven through update(model, grads, value=, grad=, value_fn=)

  def build(self, learning_rate: float | None = None) -> optax.GradientTransformation:
    """The transformation at ``learning_rate``.

    Args:
      learning_rate: the rate to build with; ``None`` uses the case's own.

    Returns:
      An ``optax.GradientTransformation``.

    Example::

      >>> CASES["sgd"].build(0.5).init({"w": 0.0})
      (EmptyState(), EmptyState())
    """
    return self.make(self.learning_rate if learning_rate is None else learning_rate)


ELEMENTWISE, REDUCING = True, False
CASES: dict[str, OptimizerCase] = {
    "sgd": OptimizerCase(optax.sgd, 0.1, ELEMENTWISE),
    "momentum": OptimizerCase(lambda lr: optax.sgd(lr, momentum=0.9), 0.1, ELEMENTWISE),
    "nesterov": OptimizerCase(lambda lr: optax.sgd(lr, momentum=0.9, nesterov=True), 0.1, ELEMENTWISE),
    "adam": OptimizerCase(optax.adam, 1e-2, ELEMENTWISE),
    "adamw": OptimizerCase(lambda lr: optax.adamw(lr, weight_decay=0.1), 1e-2, ELEMENTWISE),
    "adamax": OptimizerCase(optax.adamax, 1e-2, ELEMENTWISE),
    "nadam": OptimizerCase(optax.nadam, 1e-2, ELEMENTWISE),
    "amsgrad": OptimizerCase(optax.amsgrad, 1e-2, ELEMENTWISE),
    "lion": OptimizerCase(optax.lion, 1e-3, ELEMENTWISE),
    "rmsprop": OptimizerCase(optax.rmsprop, 1e-2, ELEMENTWISE),
    "adagrad": OptimizerCase(optax.adagrad, 1e-2, ELEMENTWISE),
    "adadelta": OptimizerCase(optax.adadelta, 1.0, ELEMENTWISE),
    "adabelief": OptimizerCase(optax.adabelief, 1e-2, ELEMENTWISE),
    "yogi": OptimizerCase(optax.yogi, 1e-2, ELEMENTWISE),
    "novograd": OptimizerCase(optax.novograd, 1e-2, REDUCING),
    "lamb": OptimizerCase(optax.lamb, 1e-2, REDUCING),
    "lars": OptimizerCase(optax.lars, 1e-2, REDUCING),
    "adafactor": OptimizerCase(lambda lr: optax.adafactor(lr, min_dim_size_to_factor=8), 1e-2, REDUCING),
    # memory_size=4 (default 10): lbfgs's many small all-reduces are the heaviest programs here
    "lbfgs": OptimizerCase(lambda lr: optax.lbfgs(lr, memory_size=4), None, REDUCING, line_search=True),
    "lbfgs(linesearch=None)": OptimizerCase(
        lambda lr: optax.lbfgs(lr, memory_size=4, linesearch=None), 0.1, REDUCING
    ),
    "contrib.muon": OptimizerCase(optax.contrib.muon, 1e-2, REDUCING),
    "contrib.adopt": OptimizerCase(optax.contrib.adopt, 1e-2, ELEMENTWISE),
    "contrib.ademamix": OptimizerCase(optax.contrib.ademamix, 1e-2, ELEMENTWISE),
    "contrib.madgrad": OptimizerCase(optax.contrib.madgrad, 1e-2, ELEMENTWISE),
    "contrib.prodigy": OptimizerCase(optax.contrib.prodigy, 1.0, REDUCING),  # 1.0: prodigy's default
    "contrib.momo": OptimizerCase(optax.contrib.momo, 1.0, REDUCING, line_search=True),  # momo's default
    "polyak_sgd": OptimizerCase(optax.polyak_sgd, 1.0, REDUCING, line_search=True),  # its default max rate
    "contrib.schedule_free_adamw": OptimizerCase(optax.contrib.schedule_free_adamw, 1e-2, ELEMENTWISE),
    "MultiSteps(adam, k=2)": OptimizerCase(
        lambda lr: optax.MultiSteps(optax.adam(lr), every_k_schedule=2), 1e-2, ELEMENTWISE
    ),
    "inject_hyperparams(adam)": OptimizerCase(
        lambda lr: optax.inject_hyperparams(optax.adam)(learning_rate=optax.linear_schedule(lr, lr / 10, 4)),
        1e-2, ELEMENTWISE,
    ),
    "chain(clip_by_global_norm, adamw)": OptimizerCase(
        lambda lr: optax.chain(optax.clip_by_global_norm(0.1), optax.adamw(lr)), 1e-2, REDUCING
    ),
    "chain(clip, sgd)": OptimizerCase(
        lambda lr: optax.chain(optax.clip(0.01), optax.sgd(lr)), 0.1, ELEMENTWISE
    ),
    "chain(add_decayed_weights, sgd)": OptimizerCase(
        lambda lr: optax.chain(optax.add_decayed_weights(1e-2), optax.sgd(lr)), 0.1, ELEMENTWISE
    ),
    "chain(ema, scale)": OptimizerCase(
        lambda lr: optax.chain(optax.ema(0.9), optax.scale(-lr)), 0.1, ELEMENTWISE
    ),
    "masked(adam) + masked(set_to_zero)": OptimizerCase(
        lambda lr: optax.chain(
            optax.masked(optax.adam(lr), _trainable), optax.masked(optax.set_to_zero(), _frozen)
        ),
        1e-2, ELEMENTWISE, freezes=True,
    ),
    "multi_transform(adam, set_to_zero)": OptimizerCase(
        lambda lr: optax.multi_transform(
            {"train": optax.adam(lr), "frozen": optax.set_to_zero()},
            lambda p: jax.tree.map(lambda f: "frozen" if f else "train", _frozen(p)),
        ),
        1e-2, ELEMENTWISE, freezes=True,
    ),
}

# The elementwise optimizers: bit-identical to nnx.Optimizer by contract (README, how_it_works.md).
ELEMENTWISE_CONTRACT = ("sgd", "momentum", "adam", "adamw", "lion", "rmsprop", "adagrad")
