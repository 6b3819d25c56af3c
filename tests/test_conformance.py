"""One conformance suite that every part type passes (cases: `helpers.CONFORMANCE_CASES`).

Per case: output shapes; jit and no-jit forward+backward agree; the hand-written backward
equals `jax.vjp` of the forward (through `fusedpc.check_backward` and directly); a pipeline
step keeps the state's structure, shapes and dtypes; a second step does not retrace.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    CONFORMANCE_CASES,
    assert_tree_allclose,
    normal,
    shapes_and_dtypes,
)

import fusedpc

CASES = sorted(CONFORMANCE_CASES)


def _build(name):
    part, x = CONFORMANCE_CASES[name]()
    assert isinstance(part, fusedpc.AbstractPart), f"{name}: the factory must return a part"
    core = part.compile("")
    state = part.init_state(jax.random.key(0))
    return part, x, core, state


def _is_float(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def _output_error(y: jax.Array) -> jax.Array:
    return normal(999, y.shape).astype(y.dtype)


@pytest.mark.parametrize("name", CASES)
def test_output_shapes(name):
    part, x, core, state = _build(name)
    y, cache = core.forward(state, x)
    abstract_y, _ = jax.eval_shape(core.forward, state, x)
    assert (y.shape, y.dtype) == (abstract_y.shape, abstract_y.dtype)
    # Every leading axis is a row: rows in, rows out (token ids: every axis is a row).
    rows = x.shape[:-1] if _is_float(x) else x.shape
    assert y.shape[:-1] == rows, f"{name}: output {y.shape} for input {x.shape}"
    assert y.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(y)))
    input_error, new_state, _ = core.backward(state, cache, _output_error(y))
    if _is_float(x):
        assert input_error.shape == x.shape and input_error.dtype == x.dtype
    assert shapes_and_dtypes(new_state) == shapes_and_dtypes(state)
    pipeline_out = fusedpc.FusedPipeline(part).check(x, jnp.zeros_like(y))
    assert (pipeline_out.shape, pipeline_out.dtype) == (y.shape, y.dtype)


@pytest.mark.parametrize("name", CASES)
def test_jit_and_no_jit_agree(name):
    _, x, core, state = _build(name)

    def forward_backward(state, x, error):
        y, cache = core.forward(state, x)
        input_error, new_state, metrics = core.backward(state, cache, error)
        return y, input_error, new_state, metrics

    error = _output_error(jax.eval_shape(core.forward, state, x)[0])
    eager = forward_backward(state, x, error)
    jitted = jax.jit(forward_backward)(state, x, error)
    # Fusion under jit reorders float32 arithmetic: agreement to a few ulps, not bitwise.
    assert_tree_allclose(jitted, eager, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", CASES)
def test_backward_matches_vjp(name):
    part, x, core, state = _build(name)
    if not _is_float(x):
        pytest.skip("integer inputs (token ids) have no input error to compare")
    y, cache = core.forward(state, x)
    error = _output_error(y)

    worst = fusedpc.check_backward(part, x, error=error, state=state)
    assert worst <= 1e-5, f"{name}: check_backward reports {worst:.2e}"

    input_error, _, _ = core.backward(state, cache, error)
    _, vjp = jax.vjp(lambda inp: core.forward(state, inp)[0], x)
    (reference,) = vjp(error)
    # atol: entries that cancel to ~0 carry float32 rounding of O(1) terms.
    assert_tree_allclose(input_error, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", CASES)
def test_step_keeps_state_structure(name):
    part, x, _, _ = _build(name)
    pipeline = fusedpc.FusedPipeline(part)
    before = shapes_and_dtypes(pipeline.state)
    y, input_error = pipeline.step(x, jnp.zeros_like(pipeline.predict(x)))
    assert shapes_and_dtypes(pipeline.state) == before
    assert bool(pipeline.last_metrics.committed)
    if _is_float(x):
        assert input_error.shape == x.shape
    merged = pipeline.merge()
    assert type(merged) is type(part)
    assert shapes_and_dtypes(merged.init_state(jax.random.key(0))) == before
    np.testing.assert_array_equal(np.asarray(pipeline.predict(x)), np.asarray(merged_predict(merged, x)))


def merged_predict(merged, x):
    core = merged.compile("")
    return core.forward(merged.init_state(jax.random.key(0)), x)[0]


@pytest.mark.parametrize("name", CASES)
def test_second_step_does_not_retrace(name):
    part, x, _, _ = _build(name)
    pipeline = fusedpc.FusedPipeline(part)
    target = jnp.zeros_like(pipeline.predict(x))
    pipeline.step(x, target)
    x2 = x + 0.5 if _is_float(x) else x
    pipeline.step(x2, target + 1.0)
    assert pipeline.trace_counts["step"] == 1
