"""Zero-1 training with orbax checkpoints: survives a crash, resumes at any data-parallel
size, and runs as several JAX processes (JAX's multi-controller runtime).

Every step saves a checkpoint asynchronously. Run the same command again after a crash
(or with another ``--devices``) and it resumes from the latest *complete* checkpoint:
orbax writes into a temporary directory and renames it only when it is finished, so a
half-written checkpoint is never picked up. ``abstract_state`` gives orbax the Zero-1
layout of the current mesh as the restore target, so the optimizer state is read
straight into its shards. The data of step n is a function of n, so a resumed run sees
exactly the batches an uninterrupted one would.

  python examples/train_with_checkpoints.py --dir /tmp/zero1-run --steps 6
  python examples/train_with_checkpoints.py --dir /tmp/zero1-run --steps 8 --devices 2

Two processes with two virtual CPU devices each, the data axis spanning both:

  python examples/train_with_checkpoints.py --dir /tmp/mp --num-processes 2 --process-id 0 \\
      --devices 2 --coordinator 127.0.0.1:12355 &
  python examples/train_with_checkpoints.py --dir /tmp/mp --num-processes 2 --process-id 1 \\
      --devices 2 --coordinator 127.0.0.1:12355

With ``--replica 2`` the mesh is ``(replica, data)``, ``replica`` across the processes as it would
cross TPU slices or GPU nodes, and Zero-1 splits the state over both axes
(``data_axis=("replica", "data")``).
"""

from __future__ import annotations

import argparse
import os
import tempfile


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--dir", default=None, help="checkpoint directory (default: a fresh temp dir)")
  parser.add_argument("--steps", type=int, default=6, help="train until this step")
  parser.add_argument("--devices", type=int, default=4, help="virtual CPU devices per process")
  parser.add_argument("--num-processes", type=int, default=1)
  parser.add_argument("--process-id", type=int, default=0)
  parser.add_argument("--coordinator", default="127.0.0.1:12355", help="host:port of process 0")
  parser.add_argument("--out", default=None, help="write the final model and optimizer state here (.npz)")
  parser.add_argument("--replica", type=int, default=1,
                      help="a replica axis of this size across processes; Zero-1 splits over it and data")
  parser.add_argument("--optimizer", choices=("zero1", "nnx"), default="zero1",
                      help="nnx: the same run with flax's nnx.Optimizer, for comparison")
  parser.add_argument("--offload-state-to-host", action="store_true",
                      help="keep the optimizer state's shards in host memory between steps")
  return parser.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None:  # before jax is imported: this process's own virtual devices
  os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={ARGS.devices}"
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from nnx_zero1 import Zero1Optimizer, abstract_state, restore_into  # noqa: E402

BATCH = 16


class MLP(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.l1 = nnx.Linear(16, 64, rngs=rngs)
    self.l2 = nnx.Linear(64, 4, rngs=rngs)

  def __call__(self, x):
    return self.l2(jax.nn.gelu(self.l1(x)))


def global_array(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
  """One global array from a value every process holds whole; each process fills its shards."""
  return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def batch(step: int, mesh) -> tuple[jax.Array, jax.Array]:
  """The batch of step ``step``: a function of the step only, split over every axis of the mesh."""
  rng = np.random.default_rng(step)
  x = rng.standard_normal((BATCH, 16), dtype=np.float32)
  y = rng.standard_normal((BATCH, 4), dtype=np.float32)
  shard = NamedSharding(mesh, P(mesh.axis_names))
  return global_array(x, shard), global_array(y, shard)


def make_mesh(replica: int) -> Mesh:
  """``("data",)`` over every device; with ``replica > 1``, ``("replica", "data")``, each replica's
  devices in one process (devices ordered by process), as a replica axis crosses slices or nodes."""
  if replica == 1:
    return jax.make_mesh((jax.device_count(),), ("data",))
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  return Mesh(np.array(devices).reshape(replica, -1), ("replica", "data"))


def build(mesh, offload_state_to_host: bool = False, optimizer: str = "zero1") -> tuple[MLP, nnx.Optimizer]:
  model = MLP(nnx.Rngs(0))  # the same values in every process; then placed on the global mesh
  replicated = NamedSharding(mesh, P())
  nnx.update(model, jax.tree.map(lambda x: global_array(np.asarray(x), replicated), nnx.state(model)))
  if optimizer == "nnx":
    return model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
  return model, Zero1Optimizer(model, optax.adamw(1e-2), mesh, data_axis=mesh.axis_names,
                               offload_state_to_host=offload_state_to_host)


@nnx.jit
def train_step(model, opt, x, y):
  loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
  opt.update(model, grads)
  return loss


def host_values(tree) -> dict[str, np.ndarray]:
  """Every leaf gathered whole to the host, keyed by its path."""
  flat = jax.tree_util.tree_flatten_with_path(nnx.as_pure(tree))[0]
  return {
      jax.tree_util.keystr(path): np.asarray(multihost_utils.process_allgather(x, tiled=True))
      for path, x in flat
  }


def bytes_on_one_device(tree) -> tuple[int, int]:
  """The bytes of ``tree``'s shards on this process's first device, and of the whole tree."""
  device, leaves = jax.local_devices()[0], jax.tree.leaves(nnx.as_pure(tree))
  return (sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.device == device),
          sum(x.nbytes for x in leaves))


def main(args: argparse.Namespace) -> None:
  if args.num_processes > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        args.coordinator, num_processes=args.num_processes, process_id=args.process_id,
        initialization_timeout=60,
    )
  mesh = make_mesh(args.replica)
  model, opt = build(mesh, args.offload_state_to_host, args.optimizer)
  directory = os.path.abspath(args.dir or tempfile.mkdtemp(prefix="zero1-ckpt-"))
  options = ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=True)
  with ocp.CheckpointManager(directory, options=options) as manager:
    step = manager.latest_step() or 0
    if step:
      target = {"model": abstract_state(model), "opt": abstract_state(opt)}
      restored = manager.restore(step, args=ocp.args.StandardRestore(target))
      restore_into(model, restored["model"])
      restore_into(opt, restored["opt"])
    print(f"start step {step} on {jax.device_count()} devices in {jax.process_count()} processes", flush=True)
    if args.replica > 1:
      by_process = [sorted({d.process_index for d in row}) for row in mesh.devices]
      print("replicas by process:", by_process, flush=True)
    while step < args.steps:
      loss = train_step(model, opt, *batch(step, mesh))
      step += 1
      manager.save(step, args=ocp.args.StandardSave({"model": nnx.state(model), "opt": nnx.state(opt)}))
      print(f"step {step} loss {float(loss.addressable_data(0)):.8f}", flush=True)
    manager.wait_until_finished()
  on_device, whole = bytes_on_one_device(nnx.state(opt))
  print(f"optimizer state: {on_device} bytes on one device of {whole}", flush=True)
  if args.out:
    values = {f"model{k}": v for k, v in host_values(nnx.state(model)).items()}
    values |= {f"opt{k}": v for k, v in host_values(nnx.state(opt)).items()}
    if jax.process_index() == 0:
      np.savez(args.out, **values)
  print(f"done at step {step}; checkpoints in {directory}", flush=True)


if __name__ == "__main__":
  main(ARGS)
