"""Eight virtual CPU devices for every test and doctest; XLA_FLAGS must be set before jax is imported."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

assert jax.device_count() == 8, "tests need 8 virtual CPU devices; import jax after conftest"

import importlib.util  # noqa: E402

# MaxText's engine needs Python >= 3.12 and maxtext; elsewhere its adapter module is not collected
# (tests/test_maxtext_engine.py says why it skips).
collect_ignore = [] if importlib.util.find_spec("maxtext") else ["adapters/maxtext_engine.py"]
