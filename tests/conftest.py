"""Test set-up: 8 simulated CPU devices and strict dtype promotion, fixed before JAX is imported."""

import os

# Must happen before the first `import jax` anywhere in the test session.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# no test reads or writes the user's plan cache (``autoshard.cache``), and no test finds a plan another test
# cached: the cache's own tests point it at their tmp_path; subprocess workers inherit this
os.environ["AUTOSHARD_CACHE_DIR"] = "off"

import jax  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")
