"""MaxText fixtures for the tests (and the benchmark's MaxText arms): a 2-layer decoder's config,
its mesh and synthetic micro-batches. Importing this needs no MaxText; calling ``tiny_config`` does
(Python >= 3.12)."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import jax
import numpy as np

__all__ = ["TINY", "tiny_config", "tiny_mesh", "tiny_batches"]

TINY = dict(
    model_name="default", run_name="nnx_zero1", base_emb_dim=32, base_num_query_heads=2, base_num_kv_heads=2,
    base_mlp_dim=64, base_num_decoder_layers=2, head_dim=16, vocab_size=128, max_target_length=16,
    per_device_batch_size=1, shard_mode="explicit", ici_data_parallelism=4, ici_fsdp_parallelism=1,
    attention="dot_product", dtype="float32", opt_type="adamw", dataset_type="synthetic",
    profiler_steps=0, skip_jax_distributed_system=True, enable_checkpointing=False, checkpoint_dir="",
    enable_goodput_recording=False, gradient_clipping_threshold=0, async_checkpointing=False,
    enable_tensorboard=False, base_output_directory=os.path.join(tempfile.gettempdir(), "nnx_zero1_maxtext"),
)


def tiny_config(**overrides: Any) -> Any:
  """A MaxText ``HyperParameters`` for a 2-layer, 32-wide decoder (MaxText's ``base.yml`` + overrides).

  Example::

    config = tiny_config(ici_data_parallelism=2, opt_type="sgd")
  """
  from nnx_zero1.adapters import _compat as _maxtext_compat

  _maxtext_compat.ensure_tunix_types()
  import maxtext
  from maxtext.configs import pyconfig

  base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
  args = {**TINY, **overrides}
  return pyconfig.initialize(["nnx_zero1", base] + [f"{k}={v}" for k, v in args.items()])


def tiny_mesh(config: Any) -> jax.sharding.Mesh:
  """MaxText's mesh for ``config`` on the first (data x fsdp x tensor) devices."""
  from maxtext.utils import maxtext_utils

  n = config.ici_data_parallelism * max(config.ici_fsdp_parallelism, 1) * config.ici_tensor_parallelism
  return maxtext_utils.get_mesh_from_config(config, jax.devices()[:n])


def tiny_batches(config: Any, count: int, seed: int = 0) -> list[dict]:
  """``count`` micro-batches of host arrays, one row per device, as MaxText's engine takes them."""
  rng = np.random.default_rng(seed)
  rows, length = int(config.micro_batch_size_to_train_on), config.max_target_length
  out = []
  for _ in range(count):
    x = rng.integers(0, config.vocab_size, (rows, length)).astype(np.int32)
    ones = np.ones((rows, length), np.int32)
    out.append(dict(inputs=x, targets=np.roll(x, -1, 1), inputs_segmentation=ones, targets_segmentation=ones,
                    inputs_position=np.tile(np.arange(length, dtype=np.int32), (rows, 1))))
  return out
