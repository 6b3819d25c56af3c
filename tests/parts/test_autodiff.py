"""Autodiff-backed frozen parts (`frozen.from_module`, `frozen.from_function`): values and
input errors against hand-derived parts and an autodiff twin written here, the cache holding
the vjp's residuals (no second forward), parameters that never learn, per-row mapping, integer
ids, stacking in a `Repeat`, and every construction error."""

from __future__ import annotations

import _autodiff_cases
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_allclose, host_leaves, normal

import fusedpc
from fusedpc import frozen
from fusedpc.core import LinearParams
from fusedpc.frozen import from_function, from_module
from fusedpc.parts import AutodiffCache, AutodiffFrozen

CTX = fusedpc.core.StepContext()  # the plain step context, for cores run by hand

X = normal(0, (2, 3, 4))  # two leading row axes


def _forward_backward(part, x, error=None):
    core = part.compile("")
    state = part.init_state(jax.random.key(0))
    y, cache = core.forward(state, x, CTX)
    error = normal(9, y.shape) if error is None else error
    input_error, new_state, metrics = core.backward(state, cache, error, CTX)
    return y, cache, error, input_error, new_state, metrics


def _twin(module, x, error):
    """The autodiff twin: the module on every row, and `jax.vjp` of that at `error`."""

    def rows(inp):
        return jax.vmap(module)(inp.reshape(-1, inp.shape[-1])).reshape(*inp.shape[:-1], -1)

    y, vjp = jax.vjp(rows, x)
    return y, vjp(error)[0]


def _cache_bytes(cache) -> int:
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(cache))


def _layer_norm() -> eqx.nn.LayerNorm:
    ln = eqx.nn.LayerNorm(4)
    return eqx.tree_at(
        lambda m: (m.weight, m.bias), ln, (1.0 + 0.3 * normal(3, (4,)), 0.2 * normal(4, (4,)))
    )


@pytest.mark.parametrize(
    ("module", "hand_derived"),
    [
        (eqx.nn.Linear(4, 3, key=jax.random.key(1)), frozen.linear),
        (_layer_norm(), frozen.layer_norm),
    ],
    ids=["linear", "layer_norm"],
)
@pytest.mark.slow
def test_from_module_equals_the_twin_and_the_hand_derived_part(module, hand_derived):
    y, cache, error, input_error, _, metrics = _forward_backward(from_module(module), X)
    want_y, want_input_error = _twin(module, X, error)
    assert isinstance(cache, AutodiffCache)
    # The part's vmapped call and the twin's are the same jaxpr: equal bits.
    np.testing.assert_array_equal(np.asarray(y), np.asarray(want_y))
    np.testing.assert_array_equal(np.asarray(input_error), np.asarray(want_input_error))
    assert bool(metrics.finite)
    # Against the hand-derived formulas: float32 rounding (different operation order).
    hand_y, _, _, hand_input_error, _, _ = _forward_backward(hand_derived(module), X, error)
    assert_tree_allclose(y, hand_y, rtol=1e-5, atol=1e-6)
    assert_tree_allclose(input_error, hand_input_error, rtol=1e-5, atol=1e-6)
    assert fusedpc.check_backward(from_module(module), X) == 0.0


def test_from_function_equals_its_twin_and_learns_nothing():
    part, x = _autodiff_cases.CASES["from_function"]()
    params = part.params
    y, _, error, input_error, new_state, _ = _forward_backward(part, x)
    want_y, vjp = jax.vjp(lambda inp: _autodiff_cases.sine_of_linear(params, inp), x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(want_y))
    np.testing.assert_array_equal(np.asarray(input_error), np.asarray(vjp(error)[0]))
    assert new_state.params is params  # carried unchanged: no gradient, no update

    pipeline = fusedpc.FusedPipeline(part)
    kept = host_leaves(pipeline.state)
    for _ in range(2):
        pipeline.step(x, jnp.zeros_like(y))
    assert all(
        np.array_equal(old, np.asarray(new))
        for old, new in zip(kept, jax.tree_util.tree_leaves(pipeline.state), strict=True)
    )
    assert bool(eqx.tree_equal(pipeline.merge().params, params))


def test_the_cache_holds_the_residuals_and_the_backward_does_not_rerun_the_forward():
    calls = []

    def counted(params, x):
        calls.append(x.shape)
        return jnp.tanh(x) * params

    part = from_function(counted, jnp.full((4,), 2.0, jnp.float32))
    _, cache, _, input_error, _, _ = _forward_backward(part, X)
    assert len(calls) == 1, calls  # the forward once, inside jax.vjp; the backward reads cache
    assert input_error.shape == X.shape
    assert len(jax.tree_util.tree_leaves(cache)) >= 1  # the residuals are the cache's leaves

    # A linear map's vjp keeps the weight as its residual; the hand-derived one keeps nothing
    # (it reads the weight from the state): the memory a hand-derived backward saves.
    layer = eqx.nn.Linear(4, 3, key=jax.random.key(1))
    assert _cache_bytes(_forward_backward(from_module(layer), X)[1]) == layer.weight.nbytes
    assert _cache_bytes(_forward_backward(frozen.linear(layer), X)[1]) == 0


def test_write_back_and_merge_give_the_module_back():
    layer = eqx.nn.Linear(4, 3, key=jax.random.key(1))
    part = from_module(layer)
    assert isinstance(part, AutodiffFrozen)
    assert bool(eqx.tree_equal(part.module, layer))
    params, _ = eqx.partition(layer, eqx.is_array)
    assert bool(eqx.tree_equal(part.init_state(jax.random.key(0)).params, params))
    pipeline = fusedpc.FusedPipeline(fusedpc.Sequential([part, frozen.tanh()]))
    pipeline.step(X, jnp.zeros((2, 3, 3), jnp.float32))
    merged = pipeline.merge().parts[0]
    assert isinstance(merged.module, eqx.nn.Linear)
    assert bool(eqx.tree_equal(merged.module, layer))
    assert merged.export_arrays("slot") == (LinearParams(layer.weight, layer.bias),)
    with pytest.raises(TypeError, match="built from a function"):
        _ = from_function(_autodiff_cases.sine_of_linear, part.params).module


def test_a_module_without_arrays_and_one_that_takes_whole_batches():
    gelu = from_module(eqx.nn.Lambda(jax.nn.gelu), per_row=False)
    assert jax.tree_util.tree_leaves(gelu.init_state(jax.random.key(0))) == []
    y, _, error, input_error, _, _ = _forward_backward(gelu, X)
    hand_y, _, _, hand_input_error, _, _ = _forward_backward(frozen.gelu(), X, error)
    # Closed-form derivative of the tanh GELU vs autodiff: float32 rounding.
    assert_tree_allclose(y, hand_y, rtol=1e-5, atol=1e-6)
    assert_tree_allclose(input_error, hand_input_error, rtol=1e-5, atol=1e-6)


def test_per_row_output_shapes_are_checked_and_name_the_part():
    layer = eqx.nn.Linear(4, 3, key=jax.random.key(1))
    state = from_module(layer).init_state(jax.random.key(0))
    # A single-example module given the whole batch: its matmul sees the rows.
    whole = from_module(eqx.nn.Linear(4, 3, key=jax.random.key(1)), per_row=False)
    with pytest.raises(ValueError, match=r"^blocks\[1\]: the forward of frozen part 'Linear'"):
        whole.compile("blocks[1]").forward(state, jnp.ones((2, 5, 3), jnp.float32), CTX)
    # A row that maps to a scalar, and a batch function that drops the rows.
    to_scalar = from_function(lambda p, x: jnp.sum(x), None, per_row=True, name="summed")
    with pytest.raises(ValueError, match=r"^ff: frozen part 'summed' must return one array"):
        to_scalar.compile("ff").forward(to_scalar.init_state(jax.random.key(0)), X, CTX)
    pooled = from_function(lambda p, x: x[:1], None, name="pooled")
    rows_kept = r"must keep the input's rows \(2, 3\), got an output of shape \(1, 3, 4\)"
    with pytest.raises(ValueError, match=rows_kept):
        pooled.compile("ff").forward(pooled.init_state(jax.random.key(0)), X, CTX)
    checked = from_module(layer, in_width=4)
    with pytest.raises(ValueError, match=r"^head: expected input of shape \(\.\.\., 4\)"):
        checked.compile("head").forward(state, jnp.ones((2, 5), jnp.float32), CTX)


def test_integer_ids_have_no_input_error():
    table = eqx.nn.Embedding(7, 3, key=jax.random.key(2))
    part = from_module(table)  # per row: every axis of the ids is a row
    ids = jnp.array([[0, 3, 6], [3, 3, 1]], jnp.int32)
    y, cache, _, input_error, _, metrics = _forward_backward(part, ids)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(table.weight[ids]))
    assert cache.pullback is None and input_error is None and bool(metrics.finite)
    tree = fusedpc.Sequential([part, from_module(eqx.nn.Linear(3, 2, key=jax.random.key(3)))])
    pipeline = fusedpc.FusedPipeline(tree)
    out, _ = pipeline.step(ids, jnp.zeros((2, 3, 2), jnp.float32))
    assert out.shape == (2, 3, 2) and bool(pipeline.last_metrics.committed)


def test_equal_parts_stack_in_a_repeat_and_match_the_twin():
    keys = jax.random.split(jax.random.key(4), 3)
    layers = [eqx.nn.MLP(4, 4, 5, depth=1, activation=jax.nn.tanh, key=k) for k in keys]
    repeat = fusedpc.Repeat([from_module(layer) for layer in layers])
    y, _, error, input_error, _, _ = _forward_backward(repeat, X)

    def twin(inp):
        for layer in layers:
            inp = jax.vmap(layer)(inp.reshape(-1, 4)).reshape(inp.shape)
        return inp

    want_y, vjp = jax.vjp(twin, X)
    # The scan and the unrolled twin fuse differently: float32 rounding.
    assert_tree_allclose(y, want_y, rtol=1e-5, atol=1e-6)
    assert_tree_allclose(input_error, vjp(error)[0], rtol=1e-5, atol=1e-6)

    params = {"a": jnp.ones((4,), jnp.float32), "w": jnp.eye(4, dtype=jnp.float32)}
    same = [from_function(_autodiff_cases.sine_of_linear, params) for _ in range(2)]
    assert len(fusedpc.Repeat(same).blocks) == 2
    different = [from_function(lambda p, x: p * x, jnp.ones(4, jnp.float32)) for _ in range(2)]
    different.append(from_function(lambda p, x: p + x, jnp.ones(4, jnp.float32)))
    with pytest.raises(ValueError, match=r"block 2 .* first difference at \.fn"):
        fusedpc.Repeat(different)


def test_construction_errors_name_the_argument():
    with pytest.raises(TypeError, match=r"from_module\(module\): expected an equinox module"):
        from_module(jnp.tanh)
    with pytest.raises(TypeError, match="already a part"):
        from_module(frozen.tanh())
    with pytest.raises(TypeError, match=r"per_row must be True or False, got 1"):
        from_module(eqx.nn.Lambda(jnp.tanh), per_row=1)
    with pytest.raises(TypeError, match=r"from_function\(fn, params\): fn must be a function"):
        from_function("tanh", None)
    with pytest.raises(TypeError, match=r"leaf params\['eps'\] is a float \(1e-05\)"):
        from_function(lambda p, x: x, {"eps": 1e-5})
    with pytest.raises(ValueError, match=r"in_width must be a positive int or None, got 0"):
        from_function(lambda p, x: x, None, in_width=0)
