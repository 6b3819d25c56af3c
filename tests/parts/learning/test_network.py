"""Tests of `PCNetwork`: layout against `eqx.nn.Linear`, initialisation, given arrays, the
closed-form activation derivatives, and construction errors."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import normal

from fusedpc import FusedPipeline, LearningNetwork, PCNetwork, Sequential, frozen
from fusedpc.parts._activations import ACTIVATIONS
from fusedpc.parts.learning._network import initialise_matrix


# --------------------------------------------------------------------------- layout
def test_layout_is_that_of_eqx_linear():
    """`weights[l]` is `Linear.weight` `(out, in)` and the sweep is `g(z) @ W.T + b`."""
    keys = jax.random.split(jax.random.key(0), 3)
    linears = [eqx.nn.Linear(4, 6, key=keys[0]), eqx.nn.Linear(6, 5, key=keys[1]),
               eqx.nn.Linear(5, 3, use_bias=False, key=keys[2])]
    network = PCNetwork(
        [4, 6, 5, 3], ("tanh", "silu"), bias=(True, True, False),
        weights=[lin.weight for lin in linears], biases=[lin.bias for lin in linears],
    )
    x = normal(1, (7, 4))

    def reference(row):
        h = jnp.tanh(linears[0](row))
        return linears[2](jax.nn.silu(linears[1](h)))

    got, want = jax.jit(lambda v: (network.predict(v), jax.vmap(reference)(v)))(x)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------- initialisation
def test_xavier_is_uniform_with_the_glorot_bound():
    w = np.asarray(initialise_matrix(jax.random.key(1), 200, 300, "xavier"))
    bound = np.sqrt(6.0 / 500.0)
    assert w.shape == (200, 300)
    assert np.all(np.abs(w) <= bound)
    assert np.max(np.abs(w)) > 0.99 * bound  # it fills the interval
    assert np.std(w) == pytest.approx(bound / np.sqrt(3.0), rel=0.02)
    assert abs(np.mean(w)) < 0.01 * bound


def test_he_is_normal_with_variance_two_over_fan_in():
    w = np.asarray(initialise_matrix(jax.random.key(2), 200, 300, "he"))
    assert w.shape == (200, 300)
    assert np.std(w) == pytest.approx(np.sqrt(2.0 / 300.0), rel=0.02)
    assert abs(np.mean(w)) < 0.01 * np.sqrt(2.0 / 300.0)


@pytest.mark.parametrize(("out_width", "in_width"), [(20, 30), (30, 20)])
def test_orthogonal_has_orthonormal_rows_or_columns(out_width, in_width):
    w = np.asarray(initialise_matrix(jax.random.key(3), out_width, in_width, "orthogonal"),
                   np.float64)
    assert w.shape == (out_width, in_width)
    gram = w @ w.T if out_width <= in_width else w.T @ w
    np.testing.assert_allclose(gram, np.eye(min(out_width, in_width)), atol=1e-5)


@pytest.mark.parametrize("init", ["xavier", "he", "orthogonal"])
def test_every_matrix_gets_its_own_draw(init):
    """Same-shaped layers must not get identical weights; the key decides everything."""
    network = PCNetwork([5, 5, 5, 5, 5], "tanh", init=init, key=jax.random.key(4))
    weights = [np.asarray(w) for w in network.weights]
    assert all(w.shape == (5, 5) for w in weights)
    for i in range(4):
        for j in range(i + 1, 4):
            assert not np.allclose(weights[i], weights[j]), f"weights[{i}] == weights[{j}]"
    again = PCNetwork([5, 5, 5, 5, 5], "tanh", init=init, key=jax.random.key(4))
    other = PCNetwork([5, 5, 5, 5, 5], "tanh", init=init, key=jax.random.key(5))
    for w, a, o in zip(weights, again.weights, other.weights):
        np.testing.assert_array_equal(w, np.asarray(a))
        assert not np.allclose(w, np.asarray(o))
    for b in network.biases:
        np.testing.assert_array_equal(np.asarray(b), 0.0)


def test_without_a_key_the_pipeline_key_draws_the_weights():
    network = PCNetwork([4, 4, 4], "tanh")
    assert network.weights is None and network.biases is None
    part = LearningNetwork(network, optax.sgd(0.1))
    first = part.init_state(jax.random.key(6)).params
    again = part.init_state(jax.random.key(6)).params
    other = part.init_state(jax.random.key(7)).params
    assert [w.shape for w in first.weights] == [(4, 4), (4, 4)]
    assert not np.allclose(first.weights[0], first.weights[1])
    np.testing.assert_array_equal(first.weights[1], again.weights[1])
    assert not np.allclose(first.weights[0], other.weights[0])
    with pytest.raises(ValueError, match="no weights yet"):
        network.predict(jnp.ones((2, 4)))


def test_given_arrays_are_used_as_is():
    w0, w1 = normal(8, (6, 4)), normal(9, (3, 6))
    b0 = normal(10, (6,))
    network = PCNetwork([4, 6, 3], "relu", bias=(True, False), weights=[w0, w1],
                        biases=[b0, None], key=jax.random.key(11))
    np.testing.assert_array_equal(np.asarray(network.weights[0]), np.asarray(w0))
    np.testing.assert_array_equal(np.asarray(network.weights[1]), np.asarray(w1))
    np.testing.assert_array_equal(np.asarray(network.biases[0]), np.asarray(b0))
    assert network.biases[1] is None
    state = LearningNetwork(network, optax.sgd(0.1)).init_state(jax.random.key(12))
    np.testing.assert_array_equal(np.asarray(state.params.weights[0]), np.asarray(w0))
    # Biases left out: zeros where the matrix has one.
    defaulted = PCNetwork([4, 6, 3], "relu", weights=[w0, w1])
    np.testing.assert_array_equal(np.asarray(defaulted.biases[1]), 0.0)
    assert defaulted.biases[1].shape == (3,)


def test_precisions_scalar_or_per_node():
    with pytest.raises(ValueError, match=r"hidden_precision \(layer 2\) must be a scalar or "
                                         r"have shape \(4,\), got \(3,\)"):
        PCNetwork([2, 3, 4, 2], "tanh", hidden_precision=[1.0, 2.0, 3.0])
    network = PCNetwork([2, 3, 3, 2], "tanh", hidden_precision=[1.0, 2.0, 3.0],
                        output_precision=5.0)
    assert [p.shape for p in network.precisions] == [(3,), (3,), (2,)]
    np.testing.assert_array_equal(np.asarray(network.precisions[1]), [1.0, 2.0, 3.0])
    np.testing.assert_array_equal(np.asarray(network.precisions[-1]), [5.0, 5.0])


# --------------------------------------------------------------------------- activations
JAX_ACTIVATIONS = {"gelu": jax.nn.gelu, "silu": jax.nn.silu, "elu": jax.nn.elu,
                   "relu": jax.nn.relu, "sigmoid": jax.nn.sigmoid, "tanh": jnp.tanh,
                   "identity": lambda v: v}


@jax.jit  # one program for every activation: eager autodiff would compile op by op
def _derivatives(z):
    """(closed form, reference) triples of g, g' and g'' for every activation."""
    out = {}
    for name, act in ACTIVATIONS.items():
        grad = jax.vmap(jax.grad(act.value))
        second = jax.vmap(jax.grad(jax.grad(act.value)))
        out[name] = ((act.value(z), JAX_ACTIVATIONS[name](z)), (act.first(z), grad(z)),
                     (act.second(z), second(z)))
    return out


@pytest.mark.gpu_parity
def test_closed_form_derivatives_equal_autodiff():
    """g' and g'' (used by the belief sweep and the posterior precision) against jax.grad,
    and g against jax.nn, away from the kinks of relu and elu."""
    z = jnp.concatenate([jnp.linspace(-4.0, -0.05, 40), jnp.linspace(0.05, 4.0, 40)])
    assert set(JAX_ACTIVATIONS) == set(ACTIVATIONS)
    for name, (value, first, second) in _derivatives(z).items():
        np.testing.assert_allclose(*value, rtol=1e-6, atol=1e-7, err_msg=name)
        # atol: tails where the derivatives underflow towards 0 in float32.
        np.testing.assert_allclose(*first, rtol=1e-5, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(*second, rtol=1e-4, atol=1e-5, err_msg=name)


# --------------------------------------------------------------------------- errors
CONSTRUCTION_ERRORS = [
    (dict(sizes=[3]), "sizes must be \\[in, hidden..., out\\] with at least two positive"),
    (dict(sizes=[3, 0, 2]), "at least two positive entries, got \\[3, 0, 2\\]"),
    (dict(activations="swish"), "hidden layer 1: unknown activation 'swish'; choose one of"),
    (dict(activations=["tanh", "relu"]), "expected 1 hidden activations .* got 2"),
    (dict(activations="categorical"),
     "hidden layer 1 asks for 'categorical', which is a head kind: categorical and binary "
     "layers are allowed only as the last layer"),
    (dict(activations="binary"), "hidden layer 1 asks for 'binary'"),
    (dict(activations="softmax"), "hidden layer 1 asks for 'softmax'"),
    (dict(input_activation="softmax"), "input_activation: unknown activation 'softmax'"),
    (dict(head="poisson"), "unknown head 'poisson'; choose one of"),
    (dict(init="glorot"), "unknown init 'glorot'; choose one of"),
    (dict(hidden_precision=0.0), "hidden_precision \\(layer 1\\) must be > 0, got 0.0"),
    (dict(hidden_precision=-1.0), "hidden_precision \\(layer 1\\) must be > 0"),
    (dict(hidden_precision=[1.0] * 7 + [0.0]), "hidden_precision \\(layer 1\\) must be > 0"),
    (dict(output_precision=0.0), "output_precision must be > 0, got 0.0"),
    (dict(head="categorical", output_precision=2.0),
     "output_precision applies to a gaussian head only"),
    (dict(head="binary", output_precision=np.full(2, 2.0, np.float32)),
     "output_precision applies to a gaussian head only"),
    (dict(bias=(True,)), "expected 2 bias flags, got 1"),
    (dict(weights=[jnp.ones((8, 4))]), "expected 2 weight matrices, got 1"),
    (dict(weights=[jnp.ones((4, 8)), jnp.ones((2, 8))]),
     "weights\\[0\\] must have shape \\(8, 4\\) \\(out, in\\), got \\(4, 8\\)"),
    (dict(weights=[jnp.ones((8, 4)), jnp.ones((2, 8))], biases=[None, jnp.ones(2)]),
     "biases\\[0\\] is missing but bias=True"),
    (dict(bias=(True, False), weights=[jnp.ones((8, 4)), jnp.ones((2, 8))],
          biases=[jnp.ones(8), jnp.ones(2)]), "biases\\[1\\] is given but bias=False"),
    (dict(weights=[jnp.ones((8, 4)), jnp.ones((2, 8))], biases=[jnp.ones(8), jnp.ones(3)]),
     "biases\\[1\\] must have shape \\(2,\\), got \\(3,\\)"),
    (dict(biases=[jnp.ones(8), jnp.ones(2)]), "biases given without weights"),
]


@pytest.mark.parametrize(("overrides", "message"), CONSTRUCTION_ERRORS)
def test_construction_errors(overrides, message):
    kwargs = dict(sizes=[4, 8, 2], activations="tanh")
    kwargs.update(overrides)
    with pytest.raises(ValueError, match=f"^PCNetwork: .*{message}"):
        PCNetwork(**kwargs)


def test_wrong_input_width_inside_a_pipeline_names_the_part():
    network = PCNetwork([3, 5, 2], "tanh", key=jax.random.key(13))
    pipeline = FusedPipeline(Sequential([frozen.tanh(), LearningNetwork(network)]))
    with pytest.raises(ValueError, match=r"^parts\[1\]: expected input of shape \(\.\.\., 3\), "
                                         r"got shape \(4, 4\)"):
        pipeline.step(jnp.ones((4, 4)), jnp.ones((4, 2)))
    root = FusedPipeline(LearningNetwork(network))
    with pytest.raises(TypeError, match="^<root>: expected a floating-point input, got dtype "
                                        "int32"):
        root.step(jnp.ones((4, 3), jnp.int32), jnp.ones((4, 2)))
    assert root.trace_counts["step"] == 0  # caught before anything was compiled
