"""The docs' markdown tables, read by the tests that hold them to the code and the kept output."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def cells(line: str) -> list[str]:
  """A table line's cells, stripped: ``| a | b |`` is ``["a", "b"]``."""
  return [c.strip() for c in line.strip().strip("|").split("|")]


def table_under(doc: str, header: str) -> list[list[str]]:
  """The body rows of the table in ``doc`` (a path from the repository root) whose header line starts with
  ``header``."""
  lines = (ROOT / doc).read_text().splitlines()
  start = next(i for i, line in enumerate(lines) if line.startswith(header))
  body = []
  for line in lines[start + 2:]:
    if not line.startswith("|"):
      break
    body.append(cells(line))
  return body
