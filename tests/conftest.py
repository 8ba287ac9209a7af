"""Test set-up: 8 simulated CPU devices and strict dtype promotion, fixed before JAX is imported."""

import os

# Must happen before the first `import jax` anywhere in the test session.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
# XLA's CPU backend compiles without LLVM's optimisations: the suite's time is mostly compiling small programs
# it runs a few times (a third less for an SPMD pipeline test), and a test compares programs compiled alike.
# The HLO passes (sharding, collectives, buffer assignment, memory_analysis) are the same at every level.
# Subprocess workers (``multiproc``, notebooks, the CLI) inherit it with their own device count.
if "xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = _flags.strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# no test reads or writes the user's plan cache (``autoshard.cache``), and no test finds a plan another test
# cached: the cache's own tests point it at their tmp_path; subprocess workers inherit this
os.environ["AUTOSHARD_CACHE_DIR"] = "off"

import jax  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")
