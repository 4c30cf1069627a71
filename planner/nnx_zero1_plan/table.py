"""The terminal's table: a plan's rows aligned in a width that fits a terminal (or every column, as plan.md
has them), with a search's edges and ``--measure``'s runs under it."""

from __future__ import annotations

from collections.abc import Sequence

from nnx_zero1_plan import cells
from nnx_zero1_plan.inputs import spelled_mesh
from nnx_zero1_plan.recommend import row_sent_bytes
from nnx_zero1_plan.row import Row


def _aligned(header: Sequence[str], body: Sequence[Sequence[str]], left: Sequence[int]) -> str:
  widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
  line = lambda row: "  ".join(c.ljust(w) if i in left else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths))).rstrip()
  return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, body)])


# The terminal's table: what a user decides by, in a width that fits a terminal; plan.md has every column.
COMPACT = ("lever", "step", "opt GiB", "state dtype", "args GiB", "temp GiB", "peak GiB", "usable GiB",
           "fits", "max micro-batch", "step ms (pred.)", cells.CALIBRATED, "tok/s/device",
           "sent GiB per step", *cells.POD_HEADER, "compile s", "note")


def _compact(rows: Sequence[Row]) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
  """:data:`COMPACT`'s columns of :func:`~nnx_zero1_plan.cells.row_cells` (a search's column only with a
  search, the pod's only on a pod), with the collective bytes each device sends per step on every network
  together."""
  full, body = cells.row_cells(rows)
  keep = [c for c in COMPACT if c in full or c == "sent GiB per step"]
  if not any(r.searched is not None for r in rows):
    keep.remove("max micro-batch")
  compact = []
  for r, row_cells in zip(rows, body, strict=True):
    by_name = dict(zip(full, row_cells, strict=True))
    by_name["sent GiB per step"] = ("~" if r.estimated else "") + cells.gib(row_sent_bytes(r) or None)
    compact.append(tuple(by_name[c] for c in keep))
  short = dict(zip(cells.POD_HEADER, ("inside, MiB (est.)", "across, MiB (est.)"), strict=True))
  return tuple(short.get(c, c) for c in keep), compact


def table(rows: Sequence[Row], wide: bool = True) -> str:
  """The rows as an aligned text table (GiB per device): every column (plan.md's), or ``wide=False`` the
  terminal's (:data:`COMPACT`, under a line naming the target and the mesh)."""
  head, body = cells.row_cells(rows) if wide else _compact(rows)
  text = _aligned(head, body, (*(range(4) if wide else range(2)), len(head) - 1))
  if not wide and rows:
    text = (f"compiled for {rows[0].compiled_for}, mesh {spelled_mesh(rows[0].mesh)}; GiB per device "
            f"(every column: plan.md)\n{text}")
  edges = cells.edge_cells(rows)
  if edges:
    text += "\n\nAt each lever's largest micro-batch (the compiler's figures):\n" + _aligned(
        cells.EDGE_HEADER, edges, (0, 1, len(cells.EDGE_HEADER) - 1))
  head, runs = cells.measured_cells(rows)
  if runs:
    text += f"\n\n{cells.MEASURED_TITLE}:\n" + _aligned(head, runs, (0, 1, len(head) - 1))
  return text
