"""Composition: Sequential (forward in order, backward in reverse) and Residual
($y = x + \\mathrm{branch}(x)$, messages add), against plain-JAX twins; named state, paths,
write-back."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from helpers import (
    assert_tree_allclose,
    delta_linear,
    linear_params,
    mlp_reference,
    normal,
    shapes_and_dtypes,
)

import fusedpc
from fusedpc import frozen
from fusedpc.core import iter_metrics

CTX = fusedpc.core.StepContext()  # the plain step context, for cores run by hand


def _run(part, x, error):
    """Forward then backward, under one jit (eager vs jit agreement: test_conformance.py)."""
    core = part.compile("")
    state = part.init_state(jax.random.key(0))

    @jax.jit
    def forward_backward(state, x, error):
        y, cache = core.forward(state, x, CTX)
        return y, *core.backward(state, cache, error, CTX)

    return core, state, *forward_backward(state, x, error)


def test_sequential_forward_in_order_backward_in_reverse():
    weights = [linear_params(0, 4, 5), linear_params(1, 5, 5), linear_params(2, 5, 3)]
    tree = fusedpc.Sequential(
        [
            frozen.linear(*weights[0]),
            frozen.tanh(),
            frozen.linear(*weights[1]),
            frozen.tanh(),
            frozen.linear(*weights[2]),
        ]
    )
    x, error = normal(3, (2, 3, 4)), normal(4, (2, 3, 3))
    _, _, y, input_error, _, _ = _run(tree, x, error)
    # The twin is an independent plain-JAX MLP; its vjp is the reverse-order chain rule.
    reference, vjp = jax.vjp(lambda inp: mlp_reference(weights, inp), x)
    assert_tree_allclose(y, reference, rtol=1e-5, atol=1e-6)  # float32 rounding of matmuls
    assert_tree_allclose(input_error, vjp(error)[0], rtol=1e-5, atol=1e-6)


def test_sequential_order_matters():
    # A then B differs from B then A: the chain really runs in list order.
    a = frozen.linear(*linear_params(0, 3, 3))
    b = frozen.activation("silu")
    x = normal(1, (4, 3))
    ab = _run(fusedpc.Sequential([a, b]), x, jnp.ones((4, 3)))[2]
    ba = _run(fusedpc.Sequential([b, a]), x, jnp.ones((4, 3)))[2]
    assert_tree_allclose(ab, jax.nn.silu(x @ a.params.weight.T + a.params.bias), rtol=1e-5)
    assert not np.allclose(np.asarray(ab), np.asarray(ba))


def test_residual_adds_both_messages():
    w, b = linear_params(5, 4, 4)
    tree = fusedpc.Residual(frozen.linear(w, b))
    x, error = normal(6, (6, 4)), normal(7, (6, 4))
    _, state, y, input_error, new_state, metrics = _run(tree, x, error)
    assert_tree_allclose(y, x + (x @ w.T + b), rtol=1e-6, atol=1e-6)
    # dL/dx = E (straight through) + E W (through the branch).
    assert_tree_allclose(input_error, error + error @ w, rtol=1e-6, atol=1e-6)
    assert isinstance(state, fusedpc.ResidualState) and isinstance(
        state.branch, fusedpc.FrozenState
    )
    assert isinstance(metrics, fusedpc.core.Named) and metrics.names == ("branch",)
    assert isinstance(metrics.children[0], fusedpc.core.FiniteFlag)


def test_state_and_metrics_are_named_and_nested_paths_are_joined():
    tree = fusedpc.Sequential(
        [
            frozen.relu(),
            fusedpc.Residual(fusedpc.Sequential([frozen.tanh(), delta_linear(0, 4, 4)])),
            delta_linear(1, 4, 2, optax.adam(1e-3)),
        ]
    )
    x = normal(2, (6, 4))
    _, state, _, _, new_state, metrics = _run(tree, x, normal(3, (6, 2)))
    assert isinstance(state, fusedpc.SequentialState) and len(state.parts) == 3
    assert isinstance(state.parts[1].branch.parts[1].params["weight"], jax.Array)
    assert shapes_and_dtypes(new_state) == shapes_and_dtypes(state)
    assert [path for path, _ in iter_metrics(metrics)] == [
        "parts[0]",
        "parts[1].branch.parts[0]",
        "parts[1].branch.parts[1]",
        "parts[2]",
    ]
    assert metrics.names == ("parts",)
    assert isinstance(metrics.children[0][2], fusedpc.core.PartMetrics)


def test_sequential_accepts_any_iterable():
    tree = fusedpc.Sequential(p for p in (frozen.relu(), frozen.tanh()))
    assert isinstance(tree.parts, tuple) and len(tree.parts) == 2


def test_write_back_rebuilds_the_tree_from_a_state():
    tree = fusedpc.Sequential(
        [delta_linear(0, 4, 3), fusedpc.Residual(frozen.linear(*linear_params(1, 3, 3)))]
    )
    core, state, _, _, new_state, _ = _run(tree, normal(2, (6, 4)), normal(3, (6, 3)))
    rebuilt = core.write_back(new_state)
    assert isinstance(rebuilt, fusedpc.Sequential)
    assert isinstance(rebuilt.parts[1], fusedpc.Residual)
    np.testing.assert_array_equal(
        np.asarray(rebuilt.parts[0].weight), np.asarray(new_state.parts[0].params["weight"])
    )
    assert not np.array_equal(np.asarray(rebuilt.parts[0].weight), np.asarray(tree.parts[0].weight))
    assert rebuilt.parts[1].branch.params is new_state.parts[1].branch.params
    # Round trip: the rebuilt tree's initial state is the state it was written from.
    again = rebuilt.init_state(jax.random.key(0))
    assert_tree_allclose(again.parts[1], new_state.parts[1])
    assert_tree_allclose(again.parts[0].params, new_state.parts[0].params)


def test_nested_composites_jit():
    tree = fusedpc.Sequential(
        [
            fusedpc.Residual(fusedpc.Residual(frozen.tanh())),
            fusedpc.Sequential([frozen.layer_norm(width=4)]),
        ]
    )
    core = tree.compile("")
    state = tree.init_state(jax.random.key(0))
    x = normal(0, (6, 4))
    y = jax.jit(lambda s, v: core.forward(s, v, CTX)[0])(state, x)
    # Residual(Residual(tanh)): y = x + (x + tanh x); then a plain layer norm.
    h = 2.0 * x + jnp.tanh(x)
    h = (h - h.mean(-1, keepdims=True)) / jnp.sqrt(h.var(-1, keepdims=True) + 1e-5)
    assert_tree_allclose(y, h, rtol=1e-5, atol=1e-5)  # summation order of mean/var
