"""Eight virtual CPU devices for every test and doctest; XLA_FLAGS must be set before jax is imported."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

assert jax.device_count() == 8, "tests need 8 virtual CPU devices; import jax after conftest"

# Never collected for doctests: importing it imports maxtext (Python >= 3.12), which changes
# process-wide settings (flax_always_shard_variable=False, wrapped jax.lax functions) for every test
# collected after it. tests/test_maxtext_engine.py imports it itself and puts those settings back.
collect_ignore = ["adapters/maxtext_engine.py"]
