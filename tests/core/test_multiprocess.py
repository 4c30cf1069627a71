"""Multi-process: 2 JAX processes x 2 virtual CPU devices on 127.0.0.1 (jax.distributed,
gloo collectives), the data axis spanning both, train like one process with 4 devices (and
bit-identically with the optimizer state offloaded to host memory), and their checkpoint
restores in a single process at another data-parallel size."""

import numpy as np

from tests.support.subprocesses import children, free_port, load

STEPS = 3


def test_two_processes_match_one_and_their_checkpoint_restores_in_one(tmp_path):
  mp_dir, sp_dir = tmp_path / "two-processes", tmp_path / "one-process"
  two_processes = ("--num-processes", "2", "--coordinator", f"127.0.0.1:{free_port()}")
  with children() as start:
    run = lambda directory, devices, out, *more: start(
        "--dir", str(directory), "--steps", str(STEPS), "--devices", str(devices),
        "--out", str(tmp_path / out), *more,
    )
    workers = [run(mp_dir, 2, "two.npz", *two_processes, "--process-id", str(i)) for i in range(2)]
    single = run(sp_dir, 4, "one.npz")
    outputs = [w.finish() for w in workers]
    single.finish()
    assert all("on 4 devices in 2 processes" in out for out in outputs)
    # The optimizer state in host memory, across two processes: bit-identical to it on device.
    offload = ("--coordinator", f"127.0.0.1:{free_port()}", "--offload-state-to-host")
    workers = [run(tmp_path / "offloaded", 2, "off.npz", *two_processes[:2], *offload, "--process-id", str(i))
               for i in range(2)]
    for w in workers:
      w.finish()

    output = run(mp_dir, 2, "r.npz").finish()
  assert f"start step {STEPS} on 2 devices in 1 processes" in output

  two, one, back = load(tmp_path / "two.npz"), load(tmp_path / "one.npz"), load(tmp_path / "r.npz")
  offloaded = load(tmp_path / "off.npz")
  assert sorted(offloaded) == sorted(two)
  for key in two:
    np.testing.assert_array_equal(offloaded[key], two[key], err_msg=key)
  assert sorted(two) == sorted(one) == sorted(back) and any(k.startswith("opt") for k in two)
  assert int(two["opt['step']"]) == STEPS
  for key in two:
    # cross-process reductions may round differently from in-process ones in the last bits
    np.testing.assert_allclose(two[key], one[key], rtol=1e-6, atol=1e-6, err_msg=key)
    np.testing.assert_array_equal(back[key], two[key], err_msg=key)
