"""What the bench's table says, under it: each column in a line, and the loss differences that come
from another summation order labelled where they are printed."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["SUM_ORDER", "legend", "loss_diff_cell"]

# Arms that sum the gradients in the order the first arm (baseline) does: their loss diff must be 0.
_BASELINE_ORDER = ("baseline", "zero1")
SUM_ORDER = "(sum order)"


def loss_diff_cell(row: dict) -> str:
  """The loss difference, labelled where it comes from another summation order, not from Zero-1.

  Example::

    >>> loss_diff_cell({"arm": "accum", "loss_diff": 4.77e-07})
    '4.77e-07 (sum order)'
  """
  cell = f"{row['loss_diff']:.3g}"
  return cell if row["loss_diff"] == 0 or row["arm"] in _BASELINE_ORDER else f"{cell} {SUM_ORDER}"


def legend(rows: Sequence[dict]) -> list[str]:
  """What the table's columns mean, in a few lines printed under it.

  Example::

    >>> legend([{"arm": "zero1", "loss_diff": 0.0}])[0].startswith("opt MiB/dev")
    True
  """
  lines = [
      "opt MiB/dev: optimizer state one device holds; x ideal: that / (baseline's / dp), 1.000 = 1/dp",
      "peak MiB/dev: the compiled step's arguments + outputs - donated + temporaries on one device",
      "step ms: median step; x plain: / baseline's at the same dp and ga; min ms: fastest step",
      "collectives: count x MiB per device per step (AR all-reduce, RS reduce-scatter, AG all-gather); "
      "AR 1x 0.000 is one all-reduce of scalars (the loss), no gradients",
      "loss diff: |final loss - baseline's|; 0 is bit-identical",
  ]
  if any(loss_diff_cell(r).endswith(SUM_ORDER) for r in rows):
    lines.append(f"{SUM_ORDER}: the arm adds the micro-batches before the replicas, another order than "
                 "baseline's, so its last bits may differ: not a broken bit-identity (that is checked "
                 "against accum in the goals below)")
  return lines
