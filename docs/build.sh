#!/usr/bin/env bash
# Builds the docs with warnings as errors (broken internal links and references included), then
# runs the code of the getting-started and custom-loop pages as doctests. No network needed.
set -euo pipefail
cd "$(dirname "$0")/.."
export JAX_PLATFORMS=cpu
export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=8"
python -m sphinx -W --keep-going -q -b html docs docs/_build/html
# The root conftest.py sets up 8 virtual CPU devices for pytest, as for the test suite.
python -m pytest -q --doctest-glob="*.md" docs/getting_started.md docs/custom_loops.md
