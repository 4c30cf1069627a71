"""``benchmarks.across``'s real text: the standard library's source as bytes, windows drawn from a step,
and the final loss its figures are read from."""

import numpy as np

from benchmarks.across import ARMS, final_loss, stdlib_bytes, windows


def test_the_corpus_is_the_standard_librarys_source_and_a_steps_windows_are_its_bytes():
  text = stdlib_bytes()
  assert text.dtype == np.uint8 and text.size > 10_000_000  # CPython's Lib/ is tens of MB of Python
  assert b"def " in text[:200_000].tobytes()
  batch = windows(text, 16, 64, 7)
  assert batch.shape == (16, 65) and batch.dtype == np.int32
  np.testing.assert_array_equal(batch, windows(text, 16, 64, 7))  # the step decides the windows
  assert not np.array_equal(batch, windows(text, 16, 64, 8))
  row = batch[0].astype(np.uint8).tobytes()
  assert text.tobytes().find(row) >= 0  # each row is a window of the corpus, as it stands


def test_the_final_loss_is_the_mean_of_the_last_hundred_steps():
  assert final_loss([9.0] * 900 + [1.0] * 100) == 1.0
  assert final_loss([9.0] * 400 + [1.0] * 100) == 1.0  # a fifth of a shorter run
  assert final_loss([3.0]) == 3.0
  assert ARMS == {"exact": None, "bf16across": "bfloat16", "int8across": "int8"}
