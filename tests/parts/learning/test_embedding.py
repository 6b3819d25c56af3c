"""Tests of `LearningEmbedding` (gather / scatter-add) and `LearningLayerNorm`.

The embedding must learn exactly like a one-matrix learning network (no bias, identity,
unit-precision gaussian head) fed one-hot rows, without ever forming a V-wide product.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_tree_allclose, capture_gradients, norm_rel_error, normal

from fusedpc import (
    FusedPipeline,
    LearningEmbedding,
    LearningLayerNorm,
    LearningNetwork,
    PCNetwork,
    Sequential,
    frozen,
)
from fusedpc.core import StepContext, check_ids

CTX = StepContext()  # the plain step context, for cores run by hand

V, D = 37, 6  # vocabulary and width, distinct from every other size below
B, T = 2, 5
IDS = jnp.array([[3, 0, 3, 36, 7], [7, 3, 11, 0, 20]], jnp.int32)  # repeats: scatter-adds
TABLE = normal(0, (V, D))


def host(tree):
    return jax.tree_util.tree_map(np.array, tree)


# --------------------------------------------------------------------------- embedding
LEARNING = {
    "sgd": dict(optimiser=optax.sgd(0.5)),
    "adam": dict(optimiser=optax.adam(1e-2)),
    "synaptic": dict(learning_kind="synaptic_uncertainty",
                     learning_kwargs={"window": 4, "prior_variance": 0.5, "prior_mean": 0.1}),
}


@pytest.mark.parametrize("name", sorted(LEARNING))
def test_embedding_equals_a_network_fed_one_hot_rows(name):
    """Two steps (optimiser state and synaptic precision carried): the same table, rtol 1e-6,
    as a [V, D] network without bias whose W is the table transposed."""
    learning = LEARNING[name]
    embedding = FusedPipeline(LearningEmbedding(TABLE, **learning))
    network = PCNetwork([V, D], (), bias=False, weights=[TABLE.T])
    dense = FusedPipeline(LearningNetwork(network, **learning))
    one_hot = jax.nn.one_hot(IDS, V, dtype=jnp.float32)
    for seed in (1, 2):
        target = normal(seed, (B, T, D))
        out_e, input_error = embedding.step(IDS, target)
        out_d, _ = dense.step(one_hot, target)
        assert input_error is None  # ids carry no error
        np.testing.assert_allclose(out_e, out_d, rtol=1e-6, atol=1e-7)
    table = embedding.state.table
    assert_tree_allclose(table, dense.state.params.weights[0].T, rtol=1e-6, atol=1e-7)
    assert norm_rel_error(table, TABLE) > 1e-3, "the table did not learn"
    untouched = np.setdiff1d(np.arange(V), np.asarray(IDS))
    if name != "synaptic":  # the synaptic rule also pulls every weight toward the prior mean
        np.testing.assert_array_equal(np.asarray(table)[untouched], np.asarray(TABLE)[untouched])
    if name == "synaptic":
        assert_tree_allclose(embedding.state.weight_precision,
                             dense.state.weight_precision.weights[0].T, rtol=1e-6, atol=1e-7)
        counts = np.bincount(np.asarray(IDS).ravel(), minlength=V)
        assert np.all(np.asarray(embedding.state.weight_precision)[counts > 0] > 0)
    (report_e,), (report_d,) = embedding.report(), dense.report()
    assert report_e["update_norm"] == pytest.approx(report_d["update_norm"], rel=1e-5)


def _dot_generals(jaxpr):
    """Every dot_general equation of a jaxpr, sub-jaxprs (jit, custom_jvp, scan...) included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(eqn)
        for value in eqn.params.values():
            for sub in value if isinstance(value, list | tuple) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found.extend(_dot_generals(inner))
    return found


def _largest_intermediate(jaxpr):
    sizes = [int(np.prod(v.aval.shape)) for e in jaxpr.eqns for v in e.outvars
             if hasattr(v.aval, "shape")]
    for eqn in jaxpr.eqns:
        for value in eqn.params.values():
            for sub in value if isinstance(value, list | tuple) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    sizes.append(_largest_intermediate(inner))
    return max(sizes)


def _step_jaxpr(tree, x, target):
    """The jaxpr of one training step of `tree` (forward, error, backward), as the pipeline
    runs it: the parts' compiled Cores with an Adam optimiser inside."""
    core = tree.compile("")
    state = tree.init_state(jax.random.key(0))

    def step(state, x, target):
        y, cache = core.forward(state, x, CTX)
        return core.backward(state, cache, y - target, CTX)

    return jax.make_jaxpr(step)(state, x, target).jaxpr


def test_embedding_step_has_no_vocabulary_wide_matmul():
    """Gather forward, scatter-add backward: no dot_general touches a V-sized axis and no
    intermediate is as large as rows x V (a one-hot batch); the dense twin has both."""
    head = LearningNetwork(PCNetwork([D, 4], (), key=jax.random.key(1)), optax.adam(1e-2))
    target = jnp.zeros((B, T, 4))
    tree = Sequential([LearningEmbedding(TABLE, optax.adam(1e-2)), head])
    jaxpr = _step_jaxpr(tree, IDS, target)
    dots = _dot_generals(jaxpr)
    assert dots, "the head's matmuls should be there: the inspection would be vacuous"
    for eqn in dots:
        shapes = [v.aval.shape for v in (*eqn.invars, *eqn.outvars)]
        assert all(V not in shape for shape in shapes), f"V-wide matmul: {shapes}"
    assert _largest_intermediate(jaxpr) < B * T * V

    dense_net = PCNetwork([V, D], (), bias=False, weights=[TABLE.T])
    dense = Sequential([LearningNetwork(dense_net, optax.adam(1e-2)), head])
    one_hot = jax.nn.one_hot(IDS, V, dtype=jnp.float32)
    dense_jaxpr = _step_jaxpr(dense, one_hot, target)
    assert any(V in v.aval.shape for e in _dot_generals(dense_jaxpr) for v in e.invars)


def test_embedding_input_errors():
    pipeline = FusedPipeline(LearningEmbedding(TABLE, optax.sgd(0.1)))
    target = jnp.zeros((1, 2, D))
    with pytest.raises(TypeError, match=r"^<root>: expected integer token ids, got dtype "
                                        r"float32"):
        pipeline.step(np.ones((1, 2), np.float32), target)
    with pytest.raises(ValueError, match=r"^<root>: token ids must lie in \[0, 37\), got 37"):
        pipeline.step(np.array([[1, V]]), target)
    with pytest.raises(ValueError, match=r"^<root>: token ids must lie in \[0, 37\), got -1"):
        pipeline.step(np.array([[-1, 2]], np.int32), target)
    assert pipeline.trace_counts["step"] == 0  # refused before anything was compiled
    checked = FusedPipeline(LearningEmbedding(TABLE, optax.sgd(0.1)), check_device_ids=True)
    with pytest.raises(ValueError, match=r"must lie in \[0, 37\), got 40"):
        checked.step(jnp.array([[1, 40]], jnp.int32), target)
    with pytest.raises(ValueError, match=r"^tok: token ids must lie in \[0, 37\), got 99"):
        check_ids([[1, 2], [3, 99]], V, "tok")
    check_ids([[1, 2], [3, 36]], V, "tok")
    with pytest.raises(ValueError, match=r"table must have shape \(vocab, width\)"):
        LearningEmbedding(jnp.ones(5))
    with pytest.raises(ValueError, match="^LearningEmbedding: .*takes no optimiser"):
        LearningEmbedding(TABLE, optax.sgd(0.1), "synaptic_uncertainty", {"window": 2})
    with pytest.raises(ValueError, match="^LearningEmbedding: unknown learning_kind"):
        LearningEmbedding(TABLE, None, "hebbian")


# --------------------------------------------------------------------------- layer norm
WEIGHT = 1.0 + 0.3 * normal(5, (D,))
BIAS = 0.2 * normal(6, (D,))


def _layer_norm(params, x):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.var(x, axis=-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + 1e-5) * params["weight"] + params["bias"]


def test_layer_norm_backward_and_updates_equal_autodiff():
    """Input error = vjp in x; the gradient fed to the optimiser = the row mean of the vjp in
    (gamma, beta); an Adam step through a pipeline = optax on those gradients."""
    x, error = normal(7, (2, 3, D)), normal(8, (2, 3, D))
    part = LearningLayerNorm(WEIGHT, BIAS, capture_gradients())
    core, state = part.compile(""), part.init_state(jax.random.key(0))
    params = {"weight": WEIGHT, "bias": BIAS}

    @jax.jit  # one program instead of an eager compile per primitive
    def both(state, params, x, error):
        y, cache = core.forward(state, x, CTX)
        input_error, new_state, _ = core.backward(state, cache, error, CTX)
        y_ref, vjp = jax.vjp(_layer_norm, params, x)
        return y, input_error, new_state, y_ref, vjp(error)

    y, input_error, new_state, y_ref, (grads, dx) = both(state, params, x, error)
    mean_grads = jax.tree_util.tree_map(lambda g: g / 6.0, grads)  # 6 rows
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-6)
    # atol: entries that cancel to ~0 carry the rounding of the O(1) ones.
    np.testing.assert_allclose(input_error, dx, rtol=1e-5, atol=1e-6)
    fed = new_state.opt_state
    np.testing.assert_allclose(fed.weight, mean_grads["weight"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(fed.bias, mean_grads["bias"], rtol=1e-5, atol=1e-7)

    adam = optax.adam(1e-2)
    pipeline = FusedPipeline(LearningLayerNorm(WEIGHT, BIAS, adam))
    target = y_ref - error  # so that the pipeline's error is exactly `error`
    pipeline.step(x, target)
    with jax.numpy_dtype_promotion("standard"):  # optax mixes Python floats and int counts
        updates, _ = adam.update(mean_grads, adam.init(params), params)
    want = optax.apply_updates(params, updates)
    got = pipeline.state.params
    # Changes, norm-relative: each side rounds W + update to float32 (1 ulp of W = 1e-5 of
    # an Adam step of 1e-2).
    assert norm_rel_error(got.weight - WEIGHT, want["weight"] - WEIGHT) <= 1e-5
    assert norm_rel_error(got.bias - BIAS, want["bias"] - BIAS) <= 1e-5


def test_layer_norm_without_optimiser_is_the_frozen_layer_norm():
    x, error = normal(9, (4, D)), normal(10, (4, D))
    part = LearningLayerNorm(WEIGHT, BIAS, None)
    module = eqx.tree_at(lambda m: (m.weight, m.bias), eqx.nn.LayerNorm(D), (WEIGHT, BIAS))
    twin = frozen.layer_norm(module)
    cores = [p.compile("") for p in (part, twin)]
    states = [p.init_state(jax.random.key(0)) for p in (part, twin)]

    @jax.jit
    def both(states, x, error):
        results = []
        for core, state in zip(cores, states):
            y, cache = core.forward(state, x, CTX)
            results.append((y, *core.backward(state, cache, error, CTX)))
        return results

    (y, input_error, new_state, metrics), (y_frozen, frozen_error, _, _) = both(states, x, error)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_frozen))
    np.testing.assert_array_equal(np.asarray(input_error), np.asarray(frozen_error))
    np.testing.assert_array_equal(np.asarray(new_state.params.weight), np.asarray(WEIGHT))
    np.testing.assert_array_equal(np.asarray(new_state.params.bias), np.asarray(BIAS))
    assert new_state.opt_state is None and float(metrics.update_norm) == 0.0


def test_layer_norm_errors():
    with pytest.raises(ValueError, match=r"weight and bias must both have shape \(D,\)"):
        LearningLayerNorm(jnp.ones(4), jnp.ones(5))
    with pytest.raises(TypeError, match="optimiser must be an optax.GradientTransformation"):
        LearningLayerNorm(jnp.ones(4), jnp.zeros(4), "adam")
    pipeline = FusedPipeline(Sequential([LearningLayerNorm(WEIGHT, BIAS, optax.sgd(0.1))]))
    with pytest.raises(ValueError, match=r"^parts\[0\]: expected input of shape \(\.\.\., 6\), "
                                         r"got shape \(3, 5\)"):
        pipeline.step(jnp.ones((3, 5)), jnp.ones((3, 6)))
