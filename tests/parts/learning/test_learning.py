"""Acceptance tests of the learning part (`LearningNetwork`): exact parity with backprop, the
three learning kinds, the knobs, padding, and two small learning tasks.

Oracles: `jax.grad` of the matched loss on a plain-JAX MLP (`x @ W.T + b`) followed by the
same optax optimiser, and, for the rules that are not backprop (`standard`, the precision
update, the synaptic rule), the formulas of the docstrings recomputed here in float64 numpy.

Every compiled pipeline costs about a second of CPU, so the tests share them where they can:
precisions are state, swapped in with `set_state` without recompiling.
"""

from __future__ import annotations

import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_tree_allclose, capture_gradients, norm_rel_error, normal

from fusedpc import FusedPipeline, LearningNetwork, PCNetwork

JAX_ACTIVATIONS = {
    "identity": lambda z: z,
    "tanh": jnp.tanh,
    "gelu": jax.nn.gelu,  # the tanh form, jax's default (approximate=True)
    "relu": jax.nn.relu,
    "sigmoid": jax.nn.sigmoid,
    "elu": jax.nn.elu,
    "silu": jax.nn.silu,
}
HEADS = {"gaussian": lambda z: z, "categorical": jax.nn.softmax, "binary": jax.nn.sigmoid}
HIDDEN_PRECISIONS = (1.0, 1e2, 1e4)
PARITY_TOLERANCE = 1e-5  # norm-relative, float32: the acceptance gate of DESIGN.md section 4


# --------------------------------------------------------------------------- references
def mlp_logits(params, x, hidden, input_activation="identity"):
    """The plain-JAX MLP: `a = g(z)`, `z = a @ W.T + b`; returns the pre-head output."""
    a = JAX_ACTIVATIONS[input_activation](x)
    n = len(params["weights"])
    for l, (w, b) in enumerate(zip(params["weights"], params["biases"])):
        z = a @ w.T
        if b is not None:
            z = z + b
        if l < n - 1:
            a = JAX_ACTIVATIONS[hidden[l]](z)
    return z


def row_losses(z, target, head, output_precision=1.0):
    """The per-row loss matched to each head, as a function of the pre-head output `z`."""
    if head == "gaussian":
        return 0.5 * jnp.sum(output_precision * (z - target) ** 2, axis=-1)
    if head == "categorical":
        logp = jax.nn.log_softmax(z, axis=-1)
        return -jnp.take_along_axis(logp, target[..., None], axis=-1)[..., 0]
    assert head == "binary"
    return -jnp.sum(target * jax.nn.log_sigmoid(z) + (1.0 - target) * jax.nn.log_sigmoid(-z), -1)


# Jitted: eager autodiff compiles every primitive for every new shape, several times slower.
@functools.partial(jax.jit, static_argnames=("hidden", "head", "input_activation"))
def gradients(params, x, target, hidden, head="gaussian", output_precision=1.0,
              input_activation="identity"):
    """`jax.grad` of the row mean of the matched per-row loss."""

    def mean_loss(p):
        z = mlp_logits(p, x, hidden, input_activation)
        return jnp.mean(row_losses(z, target, head, output_precision))

    return jax.grad(mean_loss)(params)


@functools.partial(jax.jit, static_argnames=("hidden", "head", "input_activation"))
def input_errors(params, x, target, hidden, head="gaussian", output_precision=1.0,
                 input_activation="identity"):
    """Per-row input errors d(loss_r)/dx_r (not divided by the batch size)."""

    def summed_loss(inputs):  # rows are independent: d(sum)/dx_r = d(loss_r)/dx_r
        z = mlp_logits(params, inputs, hidden, input_activation)
        return jnp.sum(row_losses(z, target, head, output_precision))

    return jax.grad(summed_loss)(x)


@functools.partial(
    jax.jit, static_argnames=("optimiser", "hidden", "head", "input_activation")
)
def backprop_step(params, opt_state, optimiser, x, target, hidden, head="gaussian",
                  output_precision=1.0, input_activation="identity"):
    """`jax.grad` of the row-mean loss, then the optimiser. Returns the new parameters and
    optimiser state, the per-row input error and the output before the step."""
    grads = gradients(params, x, target, hidden, head, output_precision, input_activation)
    dx = input_errors(params, x, target, hidden, head, output_precision, input_activation)
    with jax.numpy_dtype_promotion("standard"):  # optax mixes Python floats and int counts
        updates, opt_state = optimiser.update(grads, opt_state, params)
    out = HEADS[head](mlp_logits(params, x, hidden, input_activation))
    return optax.apply_updates(params, updates), opt_state, dx, out


def params_of(network: PCNetwork) -> dict:
    return {"weights": list(network.weights), "biases": list(network.biases)}


def as_dict(params) -> dict:
    """`NetworkParams` as the reference's dict of lists."""
    return {"weights": list(params.weights), "biases": list(params.biases)}


def params_of_state(state) -> dict:
    return as_dict(state.params)


def assert_parity(fused_new, ref_new, old, fused_dx, ref_dx, context=""):
    """Every weight and bias change, and the input error, within the parity tolerance.

    Changes are compared, not new weights: both sides round `W + update` to float32 alike,
    so a tiny update on a large weight is still measured to its own relative precision.
    """
    for name in ("weights", "biases"):
        for l, (f, r, o) in enumerate(zip(fused_new[name], ref_new[name], old[name])):
            if r is None:
                assert f is None and o is None
                continue
            ref_change = r - o
            assert float(jnp.linalg.norm(ref_change)) > 0, f"{context} {name}[{l}]: no update"
            err = norm_rel_error(f - o, ref_change)
            assert err <= PARITY_TOLERANCE, f"{context} {name}[{l}] change: {err:.2e}"
    err = norm_rel_error(fused_dx, ref_dx)
    assert err <= PARITY_TOLERANCE, f"{context} input error: {err:.2e}"


def with_precisions(state, precisions):
    """The state with new precisions (same shapes, so the step does not retrace)."""
    precisions = tuple(
        jnp.broadcast_to(jnp.asarray(p, jnp.float32), old.shape)
        for p, old in zip(precisions, state.precisions)
    )
    return eqx.tree_at(lambda s: s.precisions, state, precisions)


def batch(seed, rows, in_width, out_width):
    return normal(seed, (rows, in_width)), normal(seed + 1, (rows, out_width))


def host(tree):
    """A host copy (numpy) of a pytree: safe from the donation of the next step."""
    return jax.tree_util.tree_map(np.array, tree)


def flat(tree) -> np.ndarray:
    return np.concatenate(
        [np.ravel(np.asarray(a, np.float64)) for a in jax.tree_util.tree_leaves(tree)]
    )


# --------------------------------------------------------------------------- parity
# Depth x activation, with the optimiser alternating so that every depth and every
# activation meets both SGD and Adam (one compiled pipeline per case).
PARITY_CASES = [
    (1, "tanh", "sgd"), (1, "gelu", "adam"),
    (2, "tanh", "adam"), (2, "gelu", "sgd"),
    (4, "tanh", "sgd"), (4, "gelu", "adam"),
]


def make_optimiser(name):
    return {"sgd": optax.sgd(0.1), "adam": optax.adam(1e-2)}[name]


@pytest.mark.parametrize(("depth", "activation", "optimiser_name"), PARITY_CASES)
def test_one_step_equals_backprop_gaussian(depth, activation, optimiser_name):
    """One fused step = jax.grad of the row mean of 1/2 pi_out |out - y|^2, then the same
    optimiser, at hidden precisions 1, 1e2 and 1e4 (per node) and output precisions 1 and 2;
    the fixed precisions come out bit-identical."""
    hidden = (activation,) * depth
    network = PCNetwork([3] + [7] * depth + [2], activation, key=jax.random.key(depth))
    optimiser = make_optimiser(optimiser_name)
    part = LearningNetwork(network, optimiser)
    pipeline = FusedPipeline(part)
    initial = part.init_state(jax.random.key(0))
    x, y = batch(10 + depth, 5, 3, 2)
    old = params_of(network)
    per_node = (1.0 + np.random.default_rng(depth).random(7)).astype(np.float32)
    for output_precision in (1.0, 2.0):
        ref_new, _, ref_dx, ref_out = backprop_step(
            old, optimiser.init(old), optimiser, x, y, hidden,
            output_precision=output_precision,
        )
        for pi in HIDDEN_PRECISIONS:
            precisions = [pi * per_node] * depth + [output_precision]
            pipeline.set_state(with_precisions(initial, precisions))
            set_precisions = host(pipeline.state.precisions)
            out, dx = pipeline.step(x, y)
            np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-6)
            assert_parity(params_of_state(pipeline.state), ref_new, old, dx, ref_dx,
                          f"pi={pi:g} pi_out={output_precision:g}")
            for got, want in zip(host(pipeline.state.precisions), set_precisions):
                np.testing.assert_array_equal(got, want)
    assert pipeline.trace_counts["step"] == 1


@pytest.mark.parametrize(
    ("head", "error_fn", "optimiser_name"),
    [("categorical", "cross_entropy", "sgd"), ("binary", "sigmoid_cross_entropy", "adam")],
)
def test_one_step_equals_backprop_classification_heads(head, error_fn, optimiser_name):
    """Categorical head fed p - onehot: mean softmax cross-entropy on the logits; binary head
    fed p - t: mean sigmoid cross-entropy (summed over the outputs)."""
    hidden = ("gelu", "tanh")
    network = PCNetwork([4, 6, 5, 3], hidden, head=head, hidden_precision=1e2,
                        key=jax.random.key(3))
    optimiser = make_optimiser(optimiser_name)
    pipeline = FusedPipeline(LearningNetwork(network, optimiser), error_fn=error_fn)
    x = normal(20, (6, 4))
    if head == "categorical":
        target = jnp.array([0, 2, 1, 1, 0, 2], jnp.int32)
    else:
        target = (normal(21, (6, 3)) > 0).astype(jnp.float32)
    old = params_of(network)
    ref_new, _, ref_dx, ref_out = backprop_step(
        old, optimiser.init(old), optimiser, x, target, hidden, head=head
    )
    out, dx = pipeline.step(x, target)
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-7)
    assert_parity(params_of_state(pipeline.state), ref_new, old, dx, ref_dx, head)


def test_one_step_equals_backprop_input_activation_and_mixed_bias():
    """A non-identity input activation g_0 (its derivative enters the input error) and a
    matrix without a bias; the report row of the step."""
    network = PCNetwork([3, 6, 2], "tanh", input_activation="sigmoid", bias=(True, False),
                        hidden_precision=1e4, key=jax.random.key(5))
    optimiser = optax.sgd(0.1)
    pipeline = FusedPipeline(LearningNetwork(network, optimiser))
    x, y = batch(30, 5, 3, 2)
    old = params_of(network)
    assert old["biases"][1] is None
    ref_new, _, ref_dx, _ = backprop_step(
        old, optimiser.init(old), optimiser, x, y, ("tanh",), input_activation="sigmoid"
    )
    out, dx = pipeline.step(x, y)
    assert_parity(params_of_state(pipeline.state), ref_new, old, dx, ref_dx)

    (row,) = pipeline.report()
    assert row["part"] == "<root>" and row["layer_sizes"] == [3, 6, 2]
    assert row["finite"] is True
    update = flat(params_of_state(pipeline.state)) - flat(old)
    assert row["update_norm"] == pytest.approx(float(np.linalg.norm(update)), rel=1e-4)
    assert row["error_norm"] == pytest.approx(float(jnp.linalg.norm(out - y)), rel=1e-5)
    weights = float(np.linalg.norm(flat(params_of_state(pipeline.state))))
    assert row["weight_norm"] == pytest.approx(weights, rel=1e-5)


def test_fifty_steps_follow_backprop():
    """50 Adam steps in one `run` call: the outputs at every step (they see that step's
    weights) and the final weights stay within 1e-4 (norm-relative) of 50 backprop steps."""
    steps, hidden = 50, ("tanh", "gelu")
    network = PCNetwork([3, 8, 8, 2], hidden, hidden_precision=1e4, key=jax.random.key(7))
    optimiser = optax.adam(1e-2)
    pipeline = FusedPipeline(LearningNetwork(network, optimiser))
    xs = normal(40, (steps, 6, 3))
    targets = jnp.sin(xs[..., :2]) + 0.1 * normal(41, (steps, 6, 2))
    outputs, _, metrics = pipeline.run(xs, targets)
    assert bool(jnp.all(metrics.committed))

    params = params_of(network)
    opt_state = optimiser.init(params)
    for k in range(steps):
        params, opt_state, _, out = backprop_step(
            params, opt_state, optimiser, xs[k], targets[k], hidden
        )
        err = norm_rel_error(outputs[k], out)
        assert err <= 1e-4, f"step {k}: outputs differ by {err:.2e}"
    fused = params_of_state(pipeline.state)
    for name in ("weights", "biases"):
        for l, (f, r) in enumerate(zip(fused[name], params[name])):
            err = norm_rel_error(f, r)
            assert err <= 1e-4, f"{name}[{l}] after {steps} steps: {err:.2e}"
    assert norm_rel_error(fused, params_of(network)) > 1e-2, "the weights barely moved"


# --------------------------------------------------------------------------- belief sweep
def tanh_derivatives(z):
    t = np.tanh(z)
    return 1.0 - t * t, -2.0 * t * (1.0 - t * t)


def belief_sweep(params, precisions, x, target):
    """The learning step of `_learning.py`'s docstring in float64 (tanh hidden layers,
    gaussian head, E = output - target). Returns the activations a_l, the output error E,
    and per hidden layer l the routed error R, the evidence xi, the posterior precision pi+
    and the belief shift delta."""
    w = [np.asarray(a, np.float64) for a in params["weights"]]
    b = [0.0 if a is None else np.asarray(a, np.float64) for a in params["biases"]]
    pis = [np.asarray(p, np.float64) for p in precisions]
    n = len(w)
    a = np.asarray(x, np.float64)
    activations, pre = [a], []
    for l in range(n):
        z = a @ w[l].T + b[l]
        if l < n - 1:
            pre.append(z)
            a = np.tanh(z)
            activations.append(a)
    error = z - np.asarray(target, np.float64)
    message = pis[-1] * error
    kappa = np.broadcast_to(pis[-1], error.shape)
    layers = {}
    for l in range(n - 1, 0, -1):
        first, second = tanh_derivatives(pre[l - 1])
        back = message @ w[l]
        routed = first * back
        evidence = first**2 * (kappa @ (w[l] ** 2))
        pi = pis[l - 1]
        posterior = np.maximum(pi + evidence + second * back, pi)
        layers[l] = {"R": routed, "xi": evidence, "posterior": posterior,
                     "delta": routed / posterior, "first": first}
        kappa = pi * evidence / (pi + evidence)
        message = routed
    return activations, error, layers


def row_mean_gradients(activations, factors):
    """G_l = mean_r u_{l+1} (x) a_l and g_l = mean_r u_{l+1}, for child factors u."""
    rows = activations[0].shape[0]
    weights = [factors[l + 1].T @ activations[l] / rows for l in range(len(activations))]
    biases = [factors[l + 1].mean(axis=0) for l in range(len(activations))]
    return {"weights": weights, "biases": biases}


def mixed_precision_network(seed):
    """[3, 5, 4, 2] tanh with distinct per-node precisions everywhere (output too)."""
    rng = np.random.default_rng(seed)
    network = PCNetwork([3, 5, 4, 2], "tanh", output_precision=np.array([2.0, 0.5], np.float32),
                        key=jax.random.key(seed))
    hidden = tuple(jnp.asarray(rng.uniform(0.5, 3.0, w), jnp.float32) for w in (5, 4))
    return eqx.tree_at(lambda n: n.precisions, network, (*hidden, network.precisions[-1]))


def test_standard_scales_hidden_updates_by_posterior_precision():
    """`standard`: u = delta = R / pi+ at the hidden layers and u = E (without pi_out) at the
    output, checked against the docstring's formula in float64; fixed precisions stay
    bit-identical (the posterior is computed, not kept)."""
    network = mixed_precision_network(9)
    pipeline = FusedPipeline(LearningNetwork(network, capture_gradients(), "standard"))
    x, y = batch(50, 6, 3, 2)
    pipeline.step(x, y)
    fed = pipeline.state.opt_state  # the gradient the optimiser was fed
    acts, error, layers = belief_sweep(params_of(network), network.precisions, x, y)
    want = row_mean_gradients(acts, {3: error, 2: layers[2]["delta"], 1: layers[1]["delta"]})
    backprop = row_mean_gradients(
        acts, {3: np.asarray(network.precisions[-1]) * error, 2: layers[2]["R"],
               1: layers[1]["R"]}
    )
    for l in range(3):
        assert norm_rel_error(fed.weights[l], want["weights"][l]) <= 1e-5, f"weights[{l}]"
        assert norm_rel_error(fed.biases[l], want["biases"][l]) <= 1e-5, f"biases[{l}]"
        # Not backprop: the output matrix misses pi_out, the hidden ones are divided by pi+.
        assert norm_rel_error(fed.weights[l], backprop["weights"][l]) > 0.1, f"weights[{l}]"
    for got, want_pi in zip(host(pipeline.state.precisions), network.precisions):
        np.testing.assert_array_equal(got, np.asarray(want_pi))


def test_update_precisions_accumulate_evidence_leak_and_carry():
    """update_precisions=True: pi <- 1/(1/(pi + mean_r(pi+ - pi)) + dt e^omega) per hidden
    layer, carried into the next step. The output precision stays; with optimiser=None the
    weights stay bit-identical while the error still flows."""
    network = mixed_precision_network(11)
    time_step, omega = 2.0, -3.0
    part = LearningNetwork(network, None, update_precisions=True, time_step=time_step,
                           tonic_volatility=omega)
    pipeline = FusedPipeline(part)
    assert pipeline.state.opt_state is None
    old = params_of(network)
    leak = time_step * math.exp(omega)

    def expected(precisions, x, y):
        _, _, layers = belief_sweep(old, precisions, x, y)
        new = []
        for l in (1, 2):
            pi = np.asarray(precisions[l - 1], np.float64)
            gained = pi + np.mean(layers[l]["posterior"] - pi, axis=0)
            new.append(1.0 / (1.0 / gained + leak))
        return new

    p0 = host(pipeline.state.precisions)
    x1, y1 = batch(60, 6, 3, 2)
    x2, y2 = batch(62, 6, 3, 2)
    pipeline.step(x1, y1)
    p1 = host(pipeline.state.precisions)
    for l, want in enumerate(expected(p0, x1, y1)):
        assert_tree_allclose(p1[l].astype(np.float64), want, rtol=1e-5)
        assert not np.array_equal(p1[l], p0[l])
    _, dx = pipeline.step(x2, y2)
    p2 = host(pipeline.state.precisions)
    from_p1, from_p0 = expected(p1, x2, y2), expected(p0, x2, y2)
    for l in range(2):
        assert_tree_allclose(p2[l].astype(np.float64), from_p1[l], rtol=1e-5)
        assert norm_rel_error(p2[l], from_p0[l]) > 1e-3, "the second step ignored step one"
    np.testing.assert_array_equal(p2[-1], p0[-1])  # the output precision never adapts
    for name in ("weights", "biases"):
        for f, o in zip(params_of_state(pipeline.state)[name], old[name]):
            np.testing.assert_array_equal(np.asarray(f), np.asarray(o))
    assert float(jnp.linalg.norm(dx)) > 0
    assert pipeline.report()[0]["update_norm"] == 0.0


def test_weight_reuse_multiplies_the_gradient():
    """weight_reuse = k: the optimiser is fed k times the row-mean gradient; the input error
    is unchanged."""
    network = PCNetwork([3, 5, 2], "tanh", key=jax.random.key(19))
    x, y = batch(140, 6, 3, 2)
    pipeline = FusedPipeline(LearningNetwork(network, capture_gradients(), weight_reuse=3.0))
    _, dx = pipeline.step(x, y)
    old = params_of(network)
    grads = gradients(old, x, y, ("tanh",))
    fed = as_dict(pipeline.state.opt_state)
    assert_tree_allclose(fed, jax.tree_util.tree_map(lambda g: 3.0 * g, grads), rtol=1e-5,
                         atol=1e-7)
    assert norm_rel_error(dx, input_errors(old, x, y, ("tanh",))) <= PARITY_TOLERANCE


# --------------------------------------------------------------------------- synaptic
def synaptic_part(network, weight_reuse=1.0, **settings):
    return LearningNetwork(network, None, "synaptic_uncertainty", settings,
                           weight_reuse=weight_reuse)


def test_synaptic_at_zero_precision_is_sgd_plus_reversion():
    """With no accumulated precision: W <- W - alpha sigma_p^2 k G + (mu_p - W)/N (SGD at rate
    prior_variance plus the reversion), learning without any optimiser; the accumulated
    precision becomes c k H (H: batch-mean importance x batch-mean squared activation)."""
    window, prior_variance, prior_mean, scale, k = 8.0, 0.5, 0.2, 0.7, 2.0
    pi_out = np.array([1.0, 3.0], np.float32)
    network = PCNetwork([3, 5, 2], "tanh", output_precision=pi_out, key=jax.random.key(14))
    pipeline = FusedPipeline(synaptic_part(
        network, weight_reuse=k, window=window, prior_variance=prior_variance,
        prior_mean=prior_mean, increment_scale=scale,
    ))
    assert pipeline.state.opt_state is None
    x, y = batch(90, 6, 3, 2)
    pipeline.step(x, y)
    old = params_of(network)
    grads = gradients(old, x, y, ("tanh",), output_precision=pi_out)
    expected = jax.tree_util.tree_map(
        lambda w, g: w - prior_variance * k * g + (prior_mean - w) / window, old, grads
    )
    assert_tree_allclose(params_of_state(pipeline.state), expected, rtol=1e-5, atol=1e-7)

    acts, _, layers = belief_sweep(old, network.precisions, x, y)
    importance_out = pi_out.astype(np.float64)
    w_out = np.asarray(old["weights"][1], np.float64)
    importance_hidden = np.mean(layers[1]["first"] ** 2 * (importance_out @ w_out**2), axis=0)
    gained = pipeline.state.weight_precision
    for l, importance in enumerate((importance_hidden, importance_out)):
        want_w = scale * k * np.outer(importance, np.mean(acts[l] ** 2, axis=0))
        assert_tree_allclose(np.asarray(gained.weights[l], np.float64), want_w, rtol=1e-5)
        assert_tree_allclose(np.asarray(gained.biases[l], np.float64), scale * k * importance,
                             rtol=1e-5)


def test_synaptic_precision_reaches_fixed_point():
    """Under a constant increment H (one matrix, a fixed input) the weight precision
    approaches 1/sigma_p^2 + N c H: rtol 1e-3 after 2000 steps (one `run` call)."""
    window, prior_variance, scale, steps = 200.0, 2.0, 0.5, 2000
    pi_out = np.array([1.0, 2.5], np.float32)
    network = PCNetwork([3, 2], (), output_precision=pi_out, key=jax.random.key(15))
    pipeline = FusedPipeline(synaptic_part(
        network, window=window, prior_variance=prior_variance, increment_scale=scale,
        learning_rate=0.1,
    ))
    x, y = batch(100, 4, 3, 2)
    xs = jnp.broadcast_to(x, (steps, *x.shape))
    ys = jnp.broadcast_to(y, (steps, *y.shape))
    _, _, metrics = pipeline.run(xs, ys, keep_outputs=False)
    assert bool(jnp.all(metrics.committed))
    h_w = np.outer(pi_out, np.mean(np.asarray(x, np.float64) ** 2, axis=0))
    h_b = pi_out.astype(np.float64)
    gained = pipeline.state.weight_precision
    for got, h in ((gained.weights[0], h_w), (gained.biases[0], h_b)):
        total = np.asarray(got, np.float64) + 1.0 / prior_variance
        assert_tree_allclose(total, 1.0 / prior_variance + window * scale * h, rtol=1e-3)


SETTING_ERRORS = [
    (None, "needs learning_kwargs\\['window'\\]"),
    ({}, "needs learning_kwargs\\['window'\\]"),
    ({"window": 0}, "'window'\\] must be >= 1, got 0"),
    ({"window": 0.5}, "'window'\\] must be >= 1, got 0.5"),
    ({"window": 3, "kind": "x"}, "unknown learning_kwargs \\['kind'\\]"),
    ({"window": 3, "prior_variance": 0.0}, "'prior_variance'\\] must be > 0"),
    ({"window": 3, "prior_variance": -1.0}, "'prior_variance'\\] must be > 0"),
    ({"window": 3, "learning_rate": 0.0}, "'learning_rate'\\] must be > 0"),
    ({"window": 3, "increment_scale": -2.0}, "'increment_scale'\\] must be > 0"),
]


@pytest.mark.parametrize(("kwargs", "message"), SETTING_ERRORS)
def test_synaptic_setting_errors(kwargs, message):
    network = PCNetwork([3, 2], ())
    with pytest.raises(ValueError, match=f"LearningNetwork: .*{message}"):
        LearningNetwork(network, None, "synaptic_uncertainty", kwargs)


def test_learning_setting_errors():
    network = PCNetwork([3, 2], ())
    with pytest.raises(ValueError, match="takes no optimiser; pass optimiser=None"):
        LearningNetwork(network, optax.sgd(0.1), "synaptic_uncertainty", {"window": 4})
    with pytest.raises(ValueError, match="apply only to learning_kind='synaptic_uncertainty'"):
        LearningNetwork(network, optax.sgd(0.1), "precision_weighted", {"window": 3})
    with pytest.raises(ValueError, match="apply only to learning_kind='synaptic_uncertainty'"):
        LearningNetwork(network, optax.sgd(0.1), "standard", {"prior_mean": 0.0})
    with pytest.raises(ValueError, match="unknown learning_kind 'hebbian'; choose one of"):
        LearningNetwork(network, optax.sgd(0.1), "hebbian")
    with pytest.raises(TypeError, match="optimiser must be an optax.GradientTransformation"):
        LearningNetwork(network, "adam")
    with pytest.raises(ValueError, match="weight_reuse must be > 0, got 0"):
        LearningNetwork(network, None, weight_reuse=0)
    with pytest.raises(ValueError, match="time_step must be > 0, got -1"):
        LearningNetwork(network, None, time_step=-1.0)
    with pytest.raises(TypeError, match="network must be a PCNetwork"):
        LearningNetwork(eqx.nn.Linear(3, 2, key=jax.random.key(0)))


# --------------------------------------------------------------------------- batches
@pytest.mark.parametrize(
    "optimiser",
    [optax.chain(optax.adam(1e-3), optax.contrib.reduce_on_plateau()), optax.lbfgs()],
    ids=["reduce_on_plateau", "lbfgs"],
)
def test_optimisers_that_need_the_loss_value_are_refused_clearly(optimiser):
    network = PCNetwork([3, 4, 2], "tanh", key=jax.random.key(0))
    pipeline = FusedPipeline(LearningNetwork(network, optimiser))
    x, y = batch(0, 5, 3, 2)
    with pytest.raises(TypeError, match=r"optimiser: this optax optimiser needs the loss value"):
        pipeline.step(x, y)
    assert pipeline.steps == 0  # refused at trace time, before anything was donated


def test_padding_rows_of_zero_error_change_nothing():
    """Rows whose target is the model's own prediction carry zero error; under "active"
    normalisation appending them leaves the update unchanged. (The real rows' input errors
    scale by rows / active rows: the documented rescaling of the error itself.)"""
    network = mixed_precision_network(17)
    x, y = batch(120, 5, 3, 2)
    x_all = jnp.concatenate([x, normal(122, (3, 3))])
    results = []
    for xs, padded in ((x, False), (x_all, True)):
        pipeline = FusedPipeline(LearningNetwork(network, capture_gradients()), None, "active")
        if padded:
            # The step's own forward on the same 8 rows, so that their error is exactly 0.
            ys = jnp.concatenate([y, pipeline.predict(xs)[5:]])
        else:
            ys = y
        _, dx = pipeline.step(xs, ys)
        results.append((host(pipeline.state.opt_state), np.asarray(dx)))
    (plain, dx_plain), (padded, dx_padded) = results
    # 8/5 then 1/8 instead of 1/5: a rounding apart.
    assert_tree_allclose(padded, plain, rtol=1e-6, atol=1e-8)
    np.testing.assert_array_equal(dx_padded[5:], 0.0)
    # atol: entries that cancel to ~0 carry the rounding of the O(1) ones.
    np.testing.assert_allclose(dx_padded[:5], dx_plain * (8 / 5), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["standard", "synaptic_uncertainty"])
def test_repeating_the_batch_gives_the_same_step(kind):
    """A batch repeated twice in one step is the same step as the batch once: weights,
    adapted precisions and the synaptic precision are all row means."""
    network = mixed_precision_network(18)
    x, y = batch(130, 5, 3, 2)
    if kind == "synaptic_uncertainty":
        part = LearningNetwork(network, None, kind, {"window": 5}, update_precisions=True)
    else:
        part = LearningNetwork(network, optax.adam(1e-2), kind, update_precisions=True)
    pipeline = FusedPipeline(part)
    initial = part.init_state(jax.random.key(0))
    states = []
    for xs, ys in ((x, y), (jnp.concatenate([x, x]), jnp.concatenate([y, y]))):
        pipeline.set_state(initial)
        pipeline.step(xs, ys)
        states.append(host(pipeline.state))
    assert_tree_allclose(states[1], states[0], rtol=1e-6, atol=1e-8)
    assert norm_rel_error(params_of_state(states[0]), params_of(network)) > 1e-4


# --------------------------------------------------------------------------- learning tasks
def test_learns_a_nonlinear_regression():
    """y = sin(x) on [-pi, pi] with a 1-32-1 tanh network and Adam: MSE < 0.005 (about
    0.0015 reached)."""
    rng = np.random.default_rng(0)
    steps, rows = 1500, 32
    xs = rng.uniform(-np.pi, np.pi, (steps, rows, 1)).astype(np.float32)
    network = PCNetwork([1, 32, 1], "tanh", key=jax.random.key(21))
    pipeline = FusedPipeline(LearningNetwork(network, optax.adam(1e-2)))
    pipeline.run(xs, np.sin(xs), keep_outputs=False)
    grid = np.linspace(-np.pi, np.pi, 201, dtype=np.float32)[:, None]
    mse = float(np.mean((np.asarray(pipeline.predict(grid)) - np.sin(grid)) ** 2))
    assert mse < 5e-3, f"MSE {mse:.4f}"


def two_moons(rng, n):
    labels = rng.integers(0, 2, n)
    angle = rng.uniform(0.0, np.pi, n)
    x = np.where(labels == 0, np.cos(angle), 1.0 - np.cos(angle))
    y = np.where(labels == 0, np.sin(angle), 0.5 - np.sin(angle))
    points = np.stack([x, y], axis=-1) + 0.1 * rng.normal(size=(n, 2))
    return points.astype(np.float32), labels.astype(np.int32)


@pytest.mark.slow
def test_learns_two_moons_classification():
    """Two interleaved half-moons, categorical head, cross-entropy, Adam: held-out accuracy
    >= 0.95 (a linear classifier of the same data gets about 0.90; this net about 0.999)."""
    rng = np.random.default_rng(1)
    steps, rows = 600, 64
    points, labels = two_moons(rng, steps * rows)
    network = PCNetwork([2, 16, 16, 2], "tanh", head="categorical", key=jax.random.key(22))
    pipeline = FusedPipeline(LearningNetwork(network, optax.adam(2e-2)),
                             error_fn="cross_entropy")
    _, _, metrics = pipeline.run(points.reshape(steps, rows, 2), labels.reshape(steps, rows),
                                 keep_outputs=False)
    assert float(np.mean(metrics.loss[-50:])) < float(np.mean(metrics.loss[:50]))
    test_points, test_labels = two_moons(np.random.default_rng(2), 1000)
    probs = np.asarray(pipeline.predict(test_points))
    accuracy = float(np.mean(np.argmax(probs, axis=-1) == test_labels))
    assert accuracy >= 0.95, f"accuracy {accuracy:.3f}"
