"""Multi-process: 2 JAX processes x 2 virtual CPU devices on 127.0.0.1 (jax.distributed,
gloo collectives), the data axis spanning both, train like one process with 4 devices (and
bit-identically with the optimizer state offloaded to host memory), and their checkpoint
restores in a single process at another data-parallel size."""

import re
import subprocess
import sys

import numpy as np

from tests.support.subprocesses import children, load, reserved_port

STEPS = 3


def test_a_reserved_port_is_no_other_test_process_s_until_its_block_ends():
  """Two pytest-xdist workers each starting a coordinator never get one port: a port another process
  holds is skipped, and its claim ends with the process."""
  hold = ("from tests.support.subprocesses import reserved_port; import time\n"
          "with reserved_port() as port:\n  print(port, flush=True); time.sleep(60)")
  holder = subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout is not None
    held = int(holder.stdout.readline())
    with reserved_port() as mine, reserved_port() as another:
      assert held not in (mine, another) and mine != another
  finally:
    holder.kill()
    holder.wait(timeout=30)


def test_two_processes_match_one_and_their_checkpoint_restores_in_one(tmp_path):
  mp_dir, sp_dir = tmp_path / "two-processes", tmp_path / "one-process"
  with reserved_port() as port, reserved_port() as offload_port, children() as start:
    two_processes = ("--num-processes", "2", "--coordinator", f"127.0.0.1:{port}")
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
    offload = ("--coordinator", f"127.0.0.1:{offload_port}", "--offload-state-to-host")
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


def test_zero1_over_replica_and_data_with_replica_across_processes_trains_like_one_process(tmp_path):
  """The mesh ``(replica=2, data=2)``, ``replica`` across two processes (as it crosses TPU slices or
  GPU nodes), the state split over both axes: bit-identical to nnx.Optimizer on the same two processes
  and, in one process, to nnx.Optimizer there; two processes differ from one only where nnx.Optimizer's
  two do, in gloo's summation order."""
  out = {}
  with reserved_port() as zero1_port, reserved_port() as nnx_port, children() as start:
    for optimizer, port in (("zero1", zero1_port), ("nnx", nnx_port)):
      run = lambda name, *more, optimizer=optimizer: start(
          "--dir", str(tmp_path / name), "--steps", str(STEPS), "--replica", "2", "--optimizer", optimizer,
          "--out", str(tmp_path / f"{name}.npz"), *more)
      workers = [run(f"{optimizer}-two", "--devices", "2", "--num-processes", "2",
                     "--coordinator", f"127.0.0.1:{port}", "--process-id", str(i)) for i in range(2)]
      single = run(f"{optimizer}-one", "--devices", "4")
      printed = [w.finish() for w in workers]
      single.finish()
      assert all("replicas by process: [[0], [1]]" in text for text in printed)
      found = re.search(r"optimizer state: (\d+) bytes on one device of (\d+)", printed[1])
      on_device, whole = map(int, found.groups())
      # Zero-1: a quarter of the moments per device, the two 4-byte step counters whole; nnx.Optimizer: all
      assert on_device == ((whole - 8) // 4 + 8 if optimizer == "zero1" else whole), (optimizer, on_device)
      out[optimizer] = load(tmp_path / f"{optimizer}-two.npz"), load(tmp_path / f"{optimizer}-one.npz")

  (zero1_two, zero1_one), (nnx_two, nnx_one) = out["zero1"], out["nnx"]
  assert sorted(zero1_two) == sorted(nnx_two) == sorted(zero1_one) and int(zero1_two["opt['step']"]) == STEPS
  for key in zero1_two:
    np.testing.assert_array_equal(zero1_two[key], nnx_two[key], err_msg=key)
    np.testing.assert_array_equal(zero1_one[key], nnx_one[key], err_msg=key)
    np.testing.assert_allclose(zero1_two[key], zero1_one[key], rtol=1e-5, atol=1e-7, err_msg=key)
