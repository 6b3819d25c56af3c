"""Tests of `fusedpc.transplant`: every converter reproduces its equinox module's forward
(rtol 1e-6) and hands the learning keywords on; mismatches are clear errors."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import norm_rel_error, normal

from fusedpc import FusedPipeline, LearningEmbedding, LearningLayerNorm, LearningNetwork
from fusedpc import transplant as tp
from fusedpc.core import StepContext

CTX = StepContext()  # the plain step context, for cores run by hand

KEYS = jax.random.split(jax.random.key(0), 6)
X = normal(1, (2, 3, 4))  # leading axes are rows


def part_forward(part, x):
    """The part's compiled forward, jitted as the pipeline runs it."""
    core = part.compile("")
    return jax.jit(lambda s, v: core.forward(s, v, CTX)[0])(part.init_state(jax.random.key(0)), x)


def rows(module, x):
    """An equinox module applied to every row of `x` (all leading axes)."""
    flat = x.reshape(-1, x.shape[-1]) if x.ndim > 1 else x
    out = jax.vmap(module)(flat)
    return out.reshape(*x.shape[:-1], out.shape[-1])


@pytest.mark.parametrize("use_bias", [True, False])
def test_from_linear(use_bias):
    linear = eqx.nn.Linear(4, 3, use_bias=use_bias, key=KEYS[0])
    part = tp.from_linear(linear, optimiser=optax.sgd(0.1))
    assert isinstance(part, LearningNetwork) and part.network.sizes == (4, 3)
    np.testing.assert_allclose(part_forward(part, X), rows(linear, X), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(part.network.weights[0]), np.asarray(linear.weight))


def test_from_linears_stacks_q_k_v():
    linears = [eqx.nn.Linear(4, n, key=k) for n, k in zip((3, 2, 5), KEYS[:3])]
    part = tp.from_linears(linears)
    assert part.network.sizes == (4, 10)
    out = part_forward(part, X)
    want = jnp.concatenate([rows(lin, X) for lin in linears], axis=-1)
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-7)
    q, k, v = jnp.split(out, [3, 5], axis=-1)
    np.testing.assert_allclose(k, rows(linears[1], X), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("activation", ["gelu", "relu"])
def test_from_feedforward(activation):
    fc1, fc2 = eqx.nn.Linear(4, 7, key=KEYS[0]), eqx.nn.Linear(7, 3, key=KEYS[1])
    act = {"gelu": jax.nn.gelu, "relu": jax.nn.relu}[activation]  # gelu: the tanh form
    part = tp.from_feedforward(fc1, fc2, activation, optimiser=optax.adam(1e-3))
    assert part.network.sizes == (4, 7, 3) and part.network.activations == (activation,)
    want = rows(lambda v: fc2(act(fc1(v))), X)
    np.testing.assert_allclose(part_forward(part, X), want, rtol=1e-6, atol=1e-7)


def test_from_embedding():
    embedding = eqx.nn.Embedding(11, 4, key=KEYS[2])
    part = tp.from_embedding(embedding, optimiser=optax.sgd(0.1))
    assert isinstance(part, LearningEmbedding) and part.vocab_size == 11
    ids = jnp.array([[0, 3, 10], [3, 3, 7]], jnp.int32)
    want = jax.vmap(jax.vmap(embedding))(ids)
    np.testing.assert_allclose(part_forward(part, ids), want, rtol=1e-6)


@pytest.mark.parametrize("affine", [True, False])
def test_from_layer_norm(affine):
    ln = eqx.nn.LayerNorm(4, eps=1e-3, use_weight=affine, use_bias=affine)
    if affine:
        ln = eqx.tree_at(lambda m: (m.weight, m.bias), ln,
                         (1.0 + 0.3 * normal(2, (4,)), 0.2 * normal(3, (4,))))
    part = tp.from_layer_norm(ln, optimiser=optax.sgd(0.1))
    assert isinstance(part, LearningLayerNorm) and part.eps == 1e-3
    # atol: entries of a normalised row that cancel to ~0.
    np.testing.assert_allclose(part_forward(part, X), rows(ln, X), rtol=1e-6, atol=1e-6)


def test_learning_keywords_are_handed_on():
    fc1, fc2 = eqx.nn.Linear(4, 7, key=KEYS[0]), eqx.nn.Linear(7, 3, key=KEYS[1])
    adam = optax.adam(1e-3)
    part = tp.from_feedforward(
        fc1, fc2, "relu", optimiser=adam, head="binary", hidden_precision=1e3,
        update_precisions=True, time_step=0.5, weight_reuse=2.0,
    )
    assert part.optimiser is adam and part.network.head == "binary"
    np.testing.assert_array_equal(np.asarray(part.network.precisions[0]), 1e3)
    assert part.update_precisions and part.time_step == 0.5 and part.weight_reuse == 2.0
    synaptic = tp.from_linear(fc1, learning_kind="synaptic_uncertainty",
                              learning_kwargs={"window": 3})
    assert synaptic.learning_kind == "synaptic_uncertainty" and synaptic.optimiser is None
    categorical = tp.from_linears([fc2], head="categorical")
    assert categorical.network.head == "categorical"
    embedding = tp.from_embedding(eqx.nn.Embedding(5, 2, key=KEYS[3]), weight_reuse=3.0)
    assert embedding.weight_reuse == 3.0


def test_a_transplanted_feedforward_learns_like_its_module():
    """One SGD step of the part equals the same step on the equinox modules themselves
    (jax.grad through `fc2(gelu(fc1(x)))`): the layout matches in learning too."""
    fc1, fc2 = eqx.nn.Linear(4, 7, key=KEYS[0]), eqx.nn.Linear(7, 3, key=KEYS[1])
    pipeline = FusedPipeline(tp.from_feedforward(fc1, fc2, optimiser=optax.sgd(0.5)))
    target = normal(4, (2, 3, 3))
    pipeline.step(X, target)

    @eqx.filter_jit
    def reference(modules):
        def loss(m):
            out = rows(lambda v: m[1](jax.nn.gelu(m[0](v))), X)
            return 0.5 * jnp.mean(jnp.sum((out - target) ** 2, axis=-1))

        grads = eqx.filter_grad(loss)(modules)
        return jax.tree_util.tree_map(lambda p, g: p - 0.5 * g, modules, grads)

    new1, new2 = reference((fc1, fc2))
    params = pipeline.state.params
    for got, new, old in ((params.weights[0], new1.weight, fc1.weight),
                          (params.biases[0], new1.bias, fc1.bias),
                          (params.weights[1], new2.weight, fc2.weight),
                          (params.biases[1], new2.bias, fc2.bias)):
        assert norm_rel_error(got - old, new - old) <= 1e-5


def test_converter_errors():
    a = eqx.nn.Linear(4, 3, key=KEYS[0])
    b = eqx.nn.Linear(5, 3, key=KEYS[1])
    no_bias = eqx.nn.Linear(4, 3, use_bias=False, key=KEYS[2])
    with pytest.raises(ValueError, match=r"^from_linears: every linear must share its "
                                         r"in_features; got \[4, 5\]"):
        tp.from_linears([a, b])
    with pytest.raises(ValueError, match=r"^from_linears: either all linears have a bias or "
                                         r"none does; got use_bias \[True, False\]"):
        tp.from_linears([a, no_bias])
    with pytest.raises(ValueError, match="^from_linears: needs at least one eqx.nn.Linear"):
        tp.from_linears([])
    with pytest.raises(TypeError, match=r"^from_linears: linears\[1\]: expected an "
                                        r"eqx.nn.Linear, got Embedding"):
        tp.from_linears([a, eqx.nn.Embedding(3, 4, key=KEYS[3])])
    with pytest.raises(ValueError, match="^from_feedforward: fc1 has 3 out_features but fc2 "
                                         "has 5 in_features"):
        tp.from_feedforward(a, eqx.nn.Linear(5, 2, key=KEYS[4]))
    with pytest.raises(ValueError, match="unknown activation 'swish'"):
        tp.from_feedforward(a, eqx.nn.Linear(3, 2, key=KEYS[4]), "swish")
    with pytest.raises(TypeError, match=r"^from_linear: unknown keywords \['hidden_precision'\]"):
        tp.from_linear(a, hidden_precision=2.0)
    with pytest.raises(TypeError, match=r"^from_feedforward: unknown keywords \['lr'\]"):
        tp.from_feedforward(a, eqx.nn.Linear(3, 2, key=KEYS[4]), lr=0.1)
    with pytest.raises(TypeError, match="^from_embedding: expected an eqx.nn.Embedding"):
        tp.from_embedding(a)
    with pytest.raises(TypeError, match=r"^from_embedding: unknown keywords \['head'\]"):
        tp.from_embedding(eqx.nn.Embedding(3, 4, key=KEYS[3]), head="categorical")
    with pytest.raises(TypeError, match="^from_layer_norm: expected an eqx.nn.LayerNorm"):
        tp.from_layer_norm(a)
    with pytest.raises(TypeError, match=r"^from_layer_norm: unknown keywords \['eps'\]"):
        tp.from_layer_norm(eqx.nn.LayerNorm(4), eps=1e-3)
