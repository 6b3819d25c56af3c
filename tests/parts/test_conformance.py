"""One conformance suite that every part type passes (cases: `helpers.CONFORMANCE_CASES`, plus
the attention options defined below).

Per case: output shapes; jit and no-jit forward+backward agree; the hand-written backward
equals `jax.vjp` of the forward (through `fusedpc.check_backward` and directly; for a GPT,
whose input is ids, the error at its embedding output against the vjp with respect to its
token and position tables); a pipeline step keeps the state's structure, shapes and dtypes;
a second step does not retrace.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from _autodiff_cases import CASES as AUTODIFF_CASES
from _conv_cases import CASES as CONV_CASES
from _conv_cases import RESHAPING
from _iterative_cases import CASES as ITERATIVE_CASES
from _transformer_cases import CASES as TRANSFORMER_CASES
from helpers import (
    CONFORMANCE_CASES,
    assert_tree_allclose,
    normal,
    shapes_and_dtypes,
)

import fusedpc

CTX = fusedpc.core.StepContext()  # the plain step context, for cores run by hand


def _attention_dot_product_mixing() -> tuple[fusedpc.AbstractPart, jax.Array]:
    """The fused learning attention case with `mixing="dot_product_attention"` (its
    backward recomputes the weights from the log-sum-exp of `jax.nn.dot_product_attention`)."""
    part, x = CONFORMANCE_CASES["attention_fused_learning_qkv"]()
    assert isinstance(part, fusedpc.MultiHeadAttention)
    mixed = fusedpc.MultiHeadAttention(
        wqkv=part.wqkv, wo=part.wo, n_heads=part.n_heads, mixing="dot_product_attention"
    )
    return mixed, x


FACTORIES = {
    **CONFORMANCE_CASES,
    "attention_dot_product_mixing": _attention_dot_product_mixing,
    **AUTODIFF_CASES,
    **CONV_CASES,
    **ITERATIVE_CASES,
    **TRANSFORMER_CASES,
}
CASES = sorted(FACTORIES)
GPU_PARITY_CASES = (
    "linear", "attention_fused_learning_qkv", "transformer_block", "learning_network",
    "repeat_scanned", "gpt",
)
"""The matrix-heavy cases whose backward against `jax.vjp` is also a GPU parity test
(`gpu_parity`: scripts/gpu_check.py runs them on the GPU)."""
assert set(GPU_PARITY_CASES) <= set(CASES), sorted(set(GPU_PARITY_CASES) - set(CASES))


class Reference(NamedTuple):
    part: fusedpc.AbstractPart
    x: jax.Array
    core: fusedpc.Core
    state: Any
    error: jax.Array  # a random descent error at the output
    y: jax.Array  # eager (no-jit) forward and backward:
    input_error: Any
    new_state: Any
    metrics: Any


@functools.cache
def _reference(name: str) -> Reference:
    """Build a case and run its forward and backward once without jit (shared by the checks)."""
    part, x = FACTORIES[name]()
    assert isinstance(part, fusedpc.AbstractPart), f"{name}: the factory must return a part"
    core = part.compile("")
    state = part.init_state(jax.random.key(0))
    y, cache = core.forward(state, x, CTX)
    error = normal(999, y.shape).astype(y.dtype)
    input_error, new_state, metrics = core.backward(state, cache, error, CTX)
    return Reference(part, x, core, state, error, y, input_error, new_state, metrics)


def _is_float(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.slow
def test_output_shapes(name):
    ref = _reference(name)
    x, y = ref.x, ref.y
    abstract_y, _ = jax.eval_shape(lambda s, x: ref.core.forward(s, x, CTX), ref.state, x)
    assert (y.shape, y.dtype) == (abstract_y.shape, abstract_y.dtype)
    # Every leading axis is a row: rows in, rows out (token ids: every axis is a row). An
    # image's rows are the axes before (height, width, channels): parts that pool, stride or
    # flatten keep only the batch axis.
    rows = x.shape[:-1] if _is_float(x) else x.shape
    if name in RESHAPING:
        assert y.shape[0] == x.shape[0], f"{name}: output {y.shape} for input {x.shape}"
    else:
        assert y.shape[:-1] == rows, f"{name}: output {y.shape} for input {x.shape}"
    assert y.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(y)))
    if _is_float(x):
        assert (ref.input_error.shape, ref.input_error.dtype) == (x.shape, x.dtype)
    elif ref.input_error is not None:  # ids in: the error at the embedding output, (*ids, D)
        assert ref.input_error.shape[:-1] == x.shape, f"{name}: {ref.input_error.shape}"
        assert ref.input_error.dtype == jnp.float32
    assert shapes_and_dtypes(ref.new_state) == shapes_and_dtypes(ref.state)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.slow
def test_jit_and_no_jit_agree(name):
    ref = _reference(name)
    core = ref.core

    def forward_backward(state, x, error):
        y, cache = core.forward(state, x, CTX)
        input_error, new_state, metrics = core.backward(state, cache, error, CTX)
        return y, input_error, new_state, metrics

    jitted = jax.jit(forward_backward)(ref.state, ref.x, ref.error)
    eager = (ref.y, ref.input_error, ref.new_state, ref.metrics)
    # Fusion under jit reorders float32 arithmetic: agreement to a few ulps, not bitwise.
    assert_tree_allclose(jitted, eager, rtol=1e-5, atol=1e-6)


def _check_embedding_output_error(name: str, ref: Reference) -> None:
    """A part taking ids (a GPT) returns the error $E$ at its embedding output `(B, T, D)`.

    Its token and position tables enter the forward as $h_0 = T[\\mathrm{ids}] + P[0{:}T]$,
    so the vjp of the forward with respect to them is $\\partial L/\\partial T_v =
    \\sum_{(b,t): \\mathrm{ids}_{bt} = v} E_{bt}$ and $\\partial L/\\partial P_t = \\sum_b E_{bt}$.
    """
    assert isinstance(ref.part, fusedpc.GPTPart), (
        f"{name}: integer input with an input error; only GPTPart is known to do that"
    )
    ids, seq = ref.x, ref.x.shape[1]

    def forward(token_table, position_table):
        state = eqx.tree_at(lambda s: s.token.table, ref.state, token_table)
        if position_table is not None:  # a GPT with rotary positions has no position table
            state = eqx.tree_at(lambda s: s.position.table, state, position_table)
        return ref.core.forward(state, ids, CTX)[0]

    position = None if ref.state.position is None else ref.state.position.table
    _, vjp = jax.vjp(forward, ref.state.token.table, position)
    d_token, d_position = vjp(ref.error)
    e = ref.input_error
    assert float(jnp.max(jnp.abs(e))) > 0.0, f"{name}: the input error is all zero"
    # atol: entries that cancel to ~0 carry the float32 rounding of O(1) terms.
    want_token = jnp.zeros_like(d_token).at[ids.reshape(-1)].add(e.reshape(-1, e.shape[-1]))
    assert_tree_allclose(want_token, d_token, rtol=1e-5, atol=1e-6)
    if position is not None:
        assert_tree_allclose(jnp.sum(e, axis=0), d_position[:seq], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.gpu_parity) if name in GPU_PARITY_CASES else name
    for name in CASES
])
@pytest.mark.slow
def test_backward_matches_vjp(name):
    ref = _reference(name)
    if not _is_float(ref.x):
        if ref.input_error is None:
            pytest.skip("integer inputs (token ids) have no input error to compare")
        _check_embedding_output_error(name, ref)
        return

    worst = fusedpc.check_backward(ref.part, ref.x, error=ref.error, state=ref.state)
    assert worst <= 1e-5, f"{name}: check_backward reports {worst:.2e}"

    _, vjp = jax.vjp(lambda inp: ref.core.forward(ref.state, inp, CTX)[0], ref.x)
    (reference,) = vjp(ref.error)
    # atol: entries that cancel to ~0 carry the float32 rounding of O(1) terms.
    assert_tree_allclose(ref.input_error, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.slow
def test_pipeline_step_keeps_state_and_does_not_retrace(name):
    ref = _reference(name)
    pipeline = fusedpc.FusedPipeline(ref.part)
    before = shapes_and_dtypes(pipeline.state)
    target = jnp.zeros_like(ref.y)

    y, input_error = pipeline.step(ref.x, target)
    assert shapes_and_dtypes(pipeline.state) == before
    assert bool(pipeline.last_metrics.committed)
    assert (y.shape, y.dtype) == (ref.y.shape, ref.y.dtype)
    if _is_float(ref.x):
        assert input_error.shape == ref.x.shape
    elif ref.input_error is not None:
        assert input_error.shape == ref.input_error.shape

    x2 = ref.x + 0.5 if _is_float(ref.x) else ref.x
    pipeline.step(x2, target + 1.0)
    assert pipeline.trace_counts["step"] == 1
    assert shapes_and_dtypes(pipeline.state) == before

    merged = pipeline.merge()
    assert type(merged) is type(ref.part)
    assert shapes_and_dtypes(merged.init_state(jax.random.key(0))) == before


@pytest.mark.parametrize("name", CASES)
def test_children_round_trip_and_export_either_works_or_names_the_path(name):
    """`replace_children(children())` rebuilds an equal part; every child's name is the path
    that `compile` gives it (its report rows start with it); `export_arrays` returns records
    or raises a `TypeError` that starts with the path."""
    part = _reference(name).part
    children = part.children()
    rebuilt = part.replace_children([child for _, child in children])
    assert bool(eqx.tree_equal(rebuilt, part))
    assert bool(eqx.tree_equal(part.unrolled().init_state(jax.random.key(0)),
                               part.init_state(jax.random.key(0))))
    rows = fusedpc.core.report_rows(_reference(name).metrics)
    names = [n for n, _ in children]
    for row in rows:
        if names:
            assert any(row["part"].startswith(n) for n in names), (row["part"], names)
    try:
        records = part.export_arrays("slot")
    except TypeError as err:
        assert str(err).startswith("slot"), str(err)
    else:
        assert all(isinstance(r, fusedpc.core.ExportRecord) for r in records)
