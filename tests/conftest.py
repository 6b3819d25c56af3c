"""Test-wide settings: strict dtype promotion, so that a silent float64/float32 or int/float
mix in library code fails loudly here instead of slowing or skewing a user's run."""

import jax
import pytest

jax.config.update("jax_numpy_dtype_promotion", "strict")


@pytest.fixture
def key() -> jax.Array:
    """A fixed PRNG key: every test is deterministic."""
    return jax.random.key(0)
