"""Sphinx configuration of the nnx-zero1 documentation (MyST Markdown, autodoc, no network)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

# The API pages import nnx_zero1 (and so jax): eight virtual CPU devices, as the tests use.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  os.environ["XLA_FLAGS"] = flags.strip()
os.environ.setdefault("PJRT_NPROC", "32")  # threads to spare for eight devices' parts (docs/limitations.md)

DOCS = pathlib.Path(__file__).resolve().parent
ROOT = DOCS.parent

project = "nnx-zero1"
author = "nnx-zero1 authors"
copyright = "the nnx-zero1 authors"  # noqa: A001 (Sphinx's name)
release = "0.1.0"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx_copybutton",
]
# The copy button copies code without its prompts (and without doctest output lines), so a
# `pycon` block pastes into `python` as it is.
copybutton_prompt_text = r">>> |\.\.\. |\$ "
copybutton_prompt_is_regexp = True
copybutton_only_copy_prompt_lines = True
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
# coverage_table.md is included by coverage.md; data/ holds kept plans and their raw output, not pages.
exclude_patterns = ["_build", "coverage_table.md", "data"]
root_doc = "index"

# Internal links and cross-references are checked: with -W every broken one fails the build.
nitpicky = True
# Names outside this package (jax, flax, optax, Tunix, typing) have no target without
# intersphinx, which would need the network; private names (any part of the dotted path starting
# with "_", as ARCHITECTURE.md defines them) are not documented.
nitpick_ignore_regex = [
    (r"py:.*", r"(?!nnx_zero1\.).*"),
    (r"py:.*", r"nnx_zero1(\.\w+)*\._\w.*"),
]
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]
suppress_warnings = ["myst.header"]  # an included file (CHANGELOG.md) starts below level 1

napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
autodoc_typehints = "signature"
autodoc_typehints_format = "short"
python_use_unqualified_type_names = True
autodoc_member_order = "bysource"
autodoc_class_signature = "mixed"
# Zero1MaxTextTrainingEngine subclasses MaxText's engine (Python >= 3.12 only); the API page
# documents it with maxtext mocked, so the docs build anywhere the library installs.
autodoc_mock_imports = ["maxtext"]

html_theme = "sphinx_book_theme"
html_title = "nnx-zero1"
html_theme_options = {
    "show_toc_level": 2,
    "home_page_in_toc": True,
}
html_static_path: list[str] = []


def _cli_help() -> None:
  """The bench commands' ``--help``, written at build time so the pages never go stale."""
  out = DOCS / "_generated"
  out.mkdir(exist_ok=True)
  commands = [
      ("benchmarks.bench", "bench_help.txt"),
      ("benchmarks.maxtext_arms", "maxtext_arms_help.txt"),
  ]
  for module, name in commands:
    text = subprocess.run(
        [sys.executable, "-m", module, "--help"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout
    (out / name).write_text(text)


def _check_coverage_table() -> None:
  """The committed coverage table must list exactly ``nnx_zero1.testing.CASES``, in order.

  Its cells come from running the coverage tests, so it is generated and committed
  (``python scripts/coverage_table.py > docs/coverage_table.md``); this catches a case
  list that changed without regenerating it.
  """
  from nnx_zero1.testing import CASES

  text = (DOCS / "coverage_table.md").read_text()
  rows = re.findall(r"^\| `([^`]+)` \|", text, flags=re.M)
  if rows != list(CASES):
    raise RuntimeError(
        "docs/coverage_table.md is out of date with nnx_zero1.testing.CASES; regenerate it with "
        f"`python scripts/coverage_table.py > docs/coverage_table.md` (table: {rows}, CASES: {list(CASES)})"
    )


_cli_help()
_check_coverage_table()
