"""The one optimiser table that `fusedpc train` and `fusedpc bench` share."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest

from fusedpc.training import OPTIMISERS, make_optimiser


def _one_update(optimiser: optax.GradientTransformation):
    params = {"w": jnp.array([1.0, -2.0, 3.0])}
    grads = {"w": jnp.array([0.5, 0.25, -1.0])}
    with jax.numpy_dtype_promotion("standard"):  # optax mixes Python floats and int counts
        updates, _ = optimiser.update(grads, optimiser.init(params), params)
    return updates["w"]


@pytest.mark.parametrize(
    "name, want",
    [
        ("adam", optax.adam(1e-2)),
        ("adamw", optax.adamw(1e-2)),  # optax's default decay, as bench used
        ("sgd", optax.sgd(1e-2)),
    ],
)
def test_each_name_is_the_optax_optimiser(name, want):
    assert name in OPTIMISERS
    got = _one_update(make_optimiser(name, 1e-2))
    assert jnp.array_equal(got, _one_update(want))


def test_weight_decay_reaches_adamw():
    got = _one_update(make_optimiser("adamw", 1e-2, weight_decay=0.5))
    assert jnp.array_equal(got, _one_update(optax.adamw(1e-2, weight_decay=0.5)))
    assert not jnp.array_equal(got, _one_update(optax.adamw(1e-2)))


@pytest.mark.parametrize(
    "args, message",
    [
        (("lion", 1e-2), "optimiser must be one of"),
        (("adam", 0.0), "learning_rate must be a positive number, got 0.0"),
        (("adamw", 1e-2, -1.0), "weight_decay must be >= 0, got -1.0"),
    ],
)
def test_bad_arguments_are_named(args, message):
    with pytest.raises(ValueError, match=message):
        make_optimiser(*args)


def test_the_table_names_the_three_optimisers():
    assert OPTIMISERS == ("adam", "adamw", "sgd")
