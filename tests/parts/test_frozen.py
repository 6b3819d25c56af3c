"""Frozen parts: values against independent references (equinox layers, jax.nn), closed-form
activation derivatives against autodiff, params in the state, the public backward checker,
and every construction error. (Backward vs `jax.vjp` for every part: test_conformance.py.)"""

from __future__ import annotations

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_allclose, normal, scaled_sine

import fusedpc
from fusedpc import frozen
from fusedpc.parts._activations import ACTIVATIONS

CTX = fusedpc.core.StepContext()  # the plain step context, for cores run by hand

X = normal(0, (2, 3, 4))  # two leading row axes


def _forward(part, x):
    return part.compile("").forward(part.init_state(jax.random.key(0)), x, CTX)[0]


def _rows(fn, x):
    """Apply a per-vector equinox layer to every row of `x` (the independent reference)."""
    return jax.vmap(fn)(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)


@pytest.mark.parametrize("use_bias", [True, False])
def test_linear_matches_eqx_linear(use_bias):
    layer = eqx.nn.Linear(4, 3, use_bias=use_bias, key=jax.random.key(1))
    part = frozen.linear(layer)
    # Matmul order differs from the per-row reference by float32 rounding.
    assert_tree_allclose(_forward(part, X), _rows(layer, X), rtol=1e-5, atol=1e-6)
    from_arrays = frozen.linear(layer.weight, layer.bias)
    np.testing.assert_array_equal(
        np.asarray(_forward(from_arrays, X)), np.asarray(_forward(part, X))
    )
    assert part.in_width == 4


def test_activations_match_jax_nn():
    references = {
        frozen.gelu(): lambda x: jax.nn.gelu(x),  # the tanh form is jax's default
        frozen.relu(): jax.nn.relu,
        frozen.tanh(): jnp.tanh,
        frozen.softmax(): lambda x: jax.nn.softmax(x, axis=-1),
        frozen.activation("identity"): lambda x: x,
        frozen.activation("sigmoid"): jax.nn.sigmoid,
        frozen.activation("elu"): jax.nn.elu,
        frozen.activation("silu"): jax.nn.silu,
        frozen.activation("tanh"): jnp.tanh,
    }
    for part, reference in references.items():
        # Different but equivalent formulas: a few float32 ulps.
        assert_tree_allclose(_forward(part, X), reference(X), rtol=1e-6, atol=1e-6)
    softmax_rows = np.asarray(_forward(frozen.softmax(), X)).sum(axis=-1)
    np.testing.assert_allclose(softmax_rows, 1.0, rtol=1e-6)


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_activation_derivatives_match_autodiff(name):
    act = ACTIVATIONS[name]
    z = jnp.linspace(-3.0, 3.0, 61, dtype=jnp.float32) + 0.01  # avoid relu/elu's kink at 0

    @jax.jit
    def derivatives(z):
        first = jax.vmap(jax.grad(act.value))(z)
        second = jax.vmap(jax.grad(jax.grad(act.value)))(z)
        return (act.first(z), act.second(z)), (first, second)

    (first, second), (first_ad, second_ad) = derivatives(z)
    assert_tree_allclose(first, first_ad, rtol=1e-5, atol=1e-6)
    # Second derivatives of tanh-based forms lose a little more to cancellation.
    assert_tree_allclose(second, second_ad, rtol=1e-4, atol=1e-5)


def test_layer_norm_matches_eqx_layer_norm():
    ln = eqx.nn.LayerNorm(4, eps=1e-3)
    ln = eqx.tree_at(lambda m: (m.weight, m.bias), ln, (normal(1, (4,)), normal(2, (4,))))
    part = frozen.layer_norm(ln)
    # Mean/variance order of summation differs from equinox's: float32 rounding.
    assert_tree_allclose(_forward(part, X), _rows(ln, X), rtol=1e-5, atol=1e-5)
    plain = frozen.layer_norm(width=4)
    assert_tree_allclose(
        _forward(plain, X), _rows(eqx.nn.LayerNorm(4, eps=1e-5), X), rtol=1e-5, atol=1e-5
    )
    no_affine = eqx.nn.LayerNorm(4, use_weight=False, use_bias=False)
    assert_tree_allclose(
        _forward(frozen.layer_norm(no_affine), X), _rows(no_affine, X), rtol=1e-5, atol=1e-5
    )


def test_params_live_in_the_state_not_in_closures():
    part = scaled_sine(4)
    core = part.compile("")
    state = part.init_state(jax.random.key(0))
    assert isinstance(state, fusedpc.FrozenState) and state.params is part.params
    doubled = fusedpc.FrozenState({"a": 2.0 * state.params["a"], "c": state.params["c"]})
    y, _ = core.forward(state, X, CTX)
    y2, _ = core.forward(doubled, X, CTX)
    assert_tree_allclose(
        y2 - state.params["c"], 2.0 * (y - state.params["c"]), rtol=1e-5, atol=1e-6
    )
    written = core.write_back(doubled)
    assert isinstance(written, fusedpc.Frozen) and written.params is doubled.params
    assert written.forward_fn is part.forward_fn and written.in_width == 4
    assert part.params["a"] is state.params["a"]  # the original part is untouched


def test_equal_parts_have_equal_structure():
    # Static formula pairs are shared, so jit caches keyed on parts are shared as well.
    assert eqx.tree_equal(frozen.gelu(), frozen.gelu())
    assert eqx.tree_equal(frozen.activation("silu"), frozen.activation("silu"))
    assert not eqx.tree_equal(frozen.gelu(), frozen.relu())


def test_construction_errors():
    with pytest.raises(
        ValueError, match=re.escape("linear: weight must have shape (out, in), got (4,)")
    ):
        frozen.linear(jnp.zeros(4))
    with pytest.raises(ValueError, match=re.escape("linear: bias must have shape (3,), got (4,)")):
        frozen.linear(jnp.zeros((3, 4)), jnp.zeros(4))
    with pytest.raises(
        TypeError, match=re.escape("layer_norm: pass an eqx.nn.LayerNorm or width=...")
    ):
        frozen.layer_norm()
    with pytest.raises(
        ValueError,
        match=re.escape("layer_norm: only a LayerNorm over the last axis, got shape (2, 3)"),
    ):
        frozen.layer_norm(eqx.nn.LayerNorm((2, 3)))
    with pytest.raises(
        ValueError,
        match=r"frozen\.activation: unknown activation 'swish'; choose one of \[.*'gelu'",
    ):
        frozen.activation("swish")
    with pytest.raises(
        TypeError, match="forward and backward must be callables, got int and function"
    ):
        fusedpc.Frozen(3, lambda p, c, e: e)


def test_forward_errors_name_the_part():
    def broken(params, x):
        return x @ jnp.zeros((5, 2)), None

    tree = fusedpc.Sequential([frozen.relu(), fusedpc.Frozen(broken, lambda p, c, e: e)])
    with pytest.raises(
        ValueError,
        match=re.escape(
            "parts[1]: the forward of frozen part 'broken' failed on an input of shape (6, 4):"
        ),
    ):
        fusedpc.FusedPipeline(tree).step(normal(0, (6, 4)), normal(1, (6, 2)))
    with pytest.raises(
        ValueError, match=re.escape("parts[0]: expected input of shape (..., 3), got shape (6, 4)")
    ):
        fusedpc.FusedPipeline(fusedpc.Sequential([frozen.layer_norm(width=3)])).step(
            normal(0, (6, 4)), normal(1, (6, 4))
        )


# --------------------------------------------------------------------------- check_backward
def test_check_backward_finds_a_wrong_backward():
    def square_forward(params, x):
        return x * x, x

    def right(params, x, error):
        return 2.0 * x * error

    def wrong(params, x, error):  # forgot the factor 2
        return x * error

    x = normal(3, (5, 4))
    assert fusedpc.check_backward(fusedpc.Frozen(square_forward, right), x) <= 1e-6
    assert fusedpc.check_backward(fusedpc.Frozen(square_forward, wrong), x) == pytest.approx(
        0.5, rel=1e-6
    )
    # An explicit error and a key are honoured; a zero error gives exactly 0.
    zero = jnp.zeros((5, 4), jnp.float32)
    assert fusedpc.check_backward(fusedpc.Frozen(square_forward, wrong), x, error=zero) == 0.0
    assert fusedpc.check_backward(frozen.tanh(), x, key=jax.random.key(3)) <= 1e-6


def test_check_backward_errors():
    with pytest.raises(TypeError, match=re.escape("check_backward(part): expected a part")):
        fusedpc.check_backward(jnp.tanh, jnp.zeros((2, 2)))
    with pytest.raises(TypeError, match="check_backward: x must be floating point .* got int32"):
        fusedpc.check_backward(frozen.relu(), jnp.zeros((2, 2), jnp.int32))

    def bad_shape(params, cache, error):
        return error[:, :1]

    part = fusedpc.Frozen(lambda p, x: (x, None), bad_shape)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "check_backward: the backward returned an input error of shape (2, 1), "
            "expected (2, 3) (the input's shape)."
        ),
    ):
        fusedpc.check_backward(part, jnp.ones((2, 3), jnp.float32))


def test_check_backward_catches_a_backward_wrong_on_one_small_row():
    # Row 2's true input error is 1e-4 of the others': a backward that gets that row entirely
    # wrong (zero) moves the overall figure by only ~1e-4, but not its own row's.
    def square_forward(params, x):
        return x * x, x

    def wrong_on_row_two(params, x, error):
        return (2.0 * x * error).at[2].set(0.0)

    x = normal(3, (5, 4)).at[2].multiply(1e-4)
    error = jnp.ones((5, 4), jnp.float32)
    check = fusedpc.check_backward(fusedpc.Frozen(square_forward, wrong_on_row_two), x, error=error)
    assert check.overall < 1e-3  # the blind spot of the overall figure alone
    assert check.worst_row == 2 and check.row_error > 0.05
    assert check > 1e-2  # the answer itself flags it
    assert "worst row 2" in repr(check)
    right = fusedpc.check_backward(
        fusedpc.Frozen(square_forward, lambda p, x, e: 2.0 * x * e), x, error=error
    )
    assert right <= 1e-6 and right.row_error <= 1e-6


@pytest.mark.parametrize("name, width", [("gelu", 1), ("softmax", 2), ("tanh", 1)])
def test_check_backward_raises_no_false_alarm_where_float32_cannot_resolve_a_row(name, width):
    # Reliability III: rows whose true input error is small from cancellation (GELU far in its
    # tail, a saturated softmax) were reported at 1e-5..1e-4 against float32 jax.vjp, which
    # was itself that far off. Against the float64 reference, beyond float32 vjp's own
    # resolution, the correct backwards read as float32 rounding, and a wrong row still shows.
    part = getattr(frozen, name)()
    vjp_rows = []
    for seed in range(12):
        x = 3.0 * normal(seed, (64, width))
        check = fusedpc.check_backward(part, x, key=jax.random.key(100 + seed))
        assert check.reference == "float64"
        assert check.row_error == 0.0 and check.overall <= 1e-5, (seed, check)
        vjp_rows.append(check.vjp_row_error)
    assert max(vjp_rows) > 1e-5  # float32 vjp as the reference raised the false alarms

    core = part.compile("")

    def off_by_one_percent_on_row_5(params, cache, error):
        right = core.backward(params, cache, error, CTX)[0]
        return right.at[5].multiply(1.01)

    wrong = fusedpc.Frozen(lambda params, x: core.forward(params, x, CTX),
                           off_by_one_percent_on_row_5,
                           part.init_state(jax.random.key(0)))
    x = normal(1, (64, width))
    check = fusedpc.check_backward(wrong, x, error=normal(2, (64, width)))
    assert check.worst_row == 5 and check.row_error > 1e-3, check
