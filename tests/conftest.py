"""Test-wide settings.

- Strict dtype promotion, so that a silent float64/float32 or int/float mix in library code
  fails loudly here instead of slowing or skewing a user's run.
- Compile time dominates a suite of tiny programs, so: XLA's CPU backend at optimisation level
  0 (the programs' semantics are the same; only LLVM's code generation is cheaper — benchmarks
  never use this), and a compilation cache shared by the test processes, so that identical
  programs (the same small GPT built by several tests) compile once; the subprocesses that
  tests start use it too, through JAX's environment variables. Set
  `FUSEDPC_TEST_FAST_COMPILE=0` / `FUSEDPC_TEST_COMPILE_CACHE=none` to turn them off.
"""

import os
import tempfile

if os.environ.get("FUSEDPC_TEST_FAST_COMPILE", "1") != "0":
    # set before jax starts its backend; subprocesses started by tests inherit it
    _flags = os.environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" not in _flags:
        os.environ["XLA_FLAGS"] = (_flags + " --xla_backend_optimization_level=0").strip()

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")

_CACHE = os.environ.get("FUSEDPC_TEST_COMPILE_CACHE") or os.path.join(
    tempfile.gettempdir(), f"fusedpc-test-compile-cache-{os.getuid()}"
)
if _CACHE != "none":
    jax.config.update("jax_compilation_cache_dir", _CACHE)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    # the same for the interpreters that tests start (sharding workers, default-level parity
    # checks, scripts' smoke runs): JAX reads its settings from these variables too
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")


@pytest.fixture
def key() -> jax.Array:
    """A fixed PRNG key: every test is deterministic."""
    return jax.random.key(0)
