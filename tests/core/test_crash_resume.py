"""Crash-safe resume: the training script (Zero1Optimizer + orbax CheckpointManager with
asynchronous saves) is SIGKILLed mid-run, resumed from the latest complete checkpoint,
and ends bit-identical to an uninterrupted run. A partly written checkpoint is never
picked up."""

import shutil

import numpy as np
import orbax.checkpoint as ocp

from tests.support.subprocesses import children, load

STEPS = 12  # the kill lands long before the end: every save waits for the previous one
KILL_AFTER = 3


def finalized_steps(directory):
  return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def test_sigkill_then_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path):
  ref_dir, crash_dir = tmp_path / "uninterrupted", tmp_path / "crashed"
  with children() as start:
    reference = start("--dir", str(ref_dir), "--steps", str(STEPS), "--out", str(tmp_path / "ref.npz"))
    crashed = start("--dir", str(crash_dir), "--steps", str(STEPS))
    crashed.wait_for_line(f"step {KILL_AFTER} ")
    crashed.kill()
    assert crashed.proc.returncode == -9
    reference.finish()

    # A save may have been cut off half-way; plant one more, newer, half-written checkpoint
    # the way orbax writes them (a temporary directory, renamed only when complete).
    complete = finalized_steps(crash_dir)
    assert complete and 2 <= complete[-1] < STEPS  # save(3) waited for save(2) to finish
    partial = crash_dir / f"{complete[-1] + 100}.orbax-checkpoint-tmp-1764000000"
    shutil.copytree(crash_dir / str(complete[-1]), partial)
    for f in list(partial.rglob("*"))[::2]:
      if f.is_file():
        f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 2])
    with ocp.CheckpointManager(crash_dir, options=ocp.CheckpointManagerOptions(read_only=True)) as manager:
      assert manager.latest_step() == complete[-1]
      assert list(manager.all_steps()) == complete

    resumed = start("--dir", str(crash_dir), "--steps", str(STEPS), "--out", str(tmp_path / "resumed.npz"))
    output = resumed.finish()
  assert f"start step {complete[-1]} on 4 devices" in output
  assert f"done at step {STEPS}" in output
  ref, res = load(tmp_path / "ref.npz"), load(tmp_path / "resumed.npz")
  assert sorted(ref) == sorted(res) and any(k.startswith("opt") for k in ref)
  for key in ref:
    np.testing.assert_array_equal(res[key], ref[key], err_msg=key)
  assert int(res["opt['step']"]) == STEPS
