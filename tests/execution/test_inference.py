"""Inference without learning (`StepProgram.infer`) and generative latents: an unclamped
latent at the input, relaxed from part of an output (`"observed_squared"`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fusedpc
from fusedpc import frozen
from tests.helpers import assert_tree_allclose

R, CODE, HIDDEN, OUT = 5, 3, 6, 4


def _arrays(seed: int = 0):
    k = jax.random.split(jax.random.key(seed), 6)
    return {"W0": 0.6 * jax.random.normal(k[0], (HIDDEN, CODE)),
            "b0": 0.1 * jax.random.normal(k[1], (HIDDEN,)),
            "W1": 0.5 * jax.random.normal(k[2], (OUT, HIDDEN)),
            "prior": 0.3 * jax.random.normal(k[3], (R, CODE)),
            "t": jax.random.normal(k[4], (R, OUT))}


def _decoder(a, precision=0.5):
    """An unclamped input latent (its prior mean is the input), a frozen tanh layer, a latent,
    a learning linear read-out."""
    readout = fusedpc.PCNetwork([HIDDEN, OUT], bias=False, weights=[a["W1"]])
    return fusedpc.Sequential([
        fusedpc.Latent(precision),
        frozen.linear(a["W0"], a["b0"]), frozen.tanh(),
        fusedpc.Latent(2.0),
        fusedpc.LearningNetwork(readout, optax.sgd(0.1)),
    ])


def _reference(a, target, steps, rate, precision=0.5):
    """Float64 descent on $F = \\tfrac12 \\Pi_0 \\lVert z_0 - x \\rVert^2 + \\tfrac12 \\Pi_1
    \\lVert z_1 - \\tanh(W_0 z_0 + b_0) \\rVert^2 + \\tfrac12 \\sum_{observed} (W_1 z_1 -
    t)^2$ (rows averaged) with `jax.grad`, from the feed-forward latents."""
    with jax.enable_x64(True):
        p = {k: jnp.asarray(v, jnp.float64) for k, v in a.items()}
        t = jnp.asarray(target, jnp.float64)
        seen = ~jnp.isnan(t)

        def energy(z):
            z0, z1 = z
            e0 = 0.5 * precision * jnp.sum((z0 - p["prior"]) ** 2)
            e1 = jnp.sum((z1 - jnp.tanh(z0 @ p["W0"].T + p["b0"])) ** 2)  # 0.5 * 2.0
            y = z1 @ p["W1"].T
            return (e0 + e1 + 0.5 * jnp.sum(jnp.where(seen, y - t, 0.0) ** 2)) / R

        z = (p["prior"], jnp.tanh(p["prior"] @ p["W0"].T + p["b0"]))
        for _ in range(steps):
            z = jax.tree_util.tree_map(lambda v, g: v - rate * R * g, z, jax.grad(energy)(z))
        return ([np.asarray(v, np.float32) for v in z], float(energy(z)),
                np.asarray(z[1] @ p["W1"].T, np.float32))


def test_infer_relaxes_an_unclamped_input_as_jax_grad_of_the_energy_says():
    a = _arrays()
    target = np.asarray(a["t"]).copy()
    target[:, 2:] = np.nan  # two of four outputs observed
    program = fusedpc.make_step(_decoder(a), "observed_squared",
                                relaxation=fusedpc.Relaxation(steps=12, rate=0.2,
                                                              record_energy=True))
    state = program.init(jax.random.key(0)).state
    got = jax.jit(program.infer)(state, a["prior"], target)
    latents, energy, output = _reference(a, target, 12, 0.2)
    assert_tree_allclose(got.latents, latents, rtol=1e-5, atol=1e-6)
    assert_tree_allclose(got.output, output, rtol=1e-5, atol=1e-6)
    assert float(got.energy_after) == pytest.approx(energy, rel=1e-5)
    assert got.energy_trajectory.shape == (13,) and int(got.steps) == 12
    assert float(got.energy_trajectory[-1]) == pytest.approx(float(got.energy_after), rel=1e-6)
    assert float(got.energy_after) < 0.5 * float(got.energy_before)


def test_infer_is_the_steps_relaxation_and_learns_nothing():
    a = _arrays(1)
    program = fusedpc.make_step(_decoder(a), relaxation=fusedpc.Relaxation(steps=6, rate=0.3))
    carry = program.init(jax.random.key(0))
    kept = jax.tree_util.tree_map(np.asarray, carry.state)
    got = program.infer(carry.state, a["prior"], a["t"])
    assert_tree_allclose(carry.state, kept, rtol=0.0)
    _, out = program.step(carry, a["prior"], a["t"])
    assert float(got.energy_after) == pytest.approx(float(out.metrics.relaxation.energy_after),
                                                    rel=1e-6)
    assert float(got.energy_before) == pytest.approx(
        float(out.metrics.relaxation.energy_before), rel=1e-6)


def test_an_incremental_relaxation_infers_without_its_weight_steps():
    a = _arrays(2)
    plain = fusedpc.make_step(_decoder(a), relaxation=fusedpc.Relaxation(steps=5, rate=0.2))
    incremental = fusedpc.make_step(_decoder(a), relaxation=fusedpc.Relaxation(
        steps=5, rate=0.2, incremental=True))
    state = plain.init(jax.random.key(0)).state
    assert_tree_allclose(incremental.infer(state, a["prior"], a["t"]).latents,
                         plain.infer(state, a["prior"], a["t"]).latents, rtol=0.0)


def test_nothing_observed_leaves_the_latents_at_their_predictions():
    a = _arrays(3)
    program = fusedpc.make_step(_decoder(a), "observed_squared",
                                relaxation=fusedpc.Relaxation(steps=4, rate=0.3))
    state = program.init(jax.random.key(0)).state
    got = program.infer(state, a["prior"], jnp.full((R, OUT), jnp.nan))
    # not bit for bit: a sweep recomputes each prediction in its own compiled loop, whose
    # rounding may differ from the first forward's by an ulp, which then moves the latents
    assert_tree_allclose(got.latents[0], a["prior"], rtol=1e-6, atol=1e-7)
    assert_tree_allclose(got.output, program.predict(state, a["prior"]), rtol=1e-6, atol=1e-7)
    assert abs(float(got.energy_after)) < 1e-12


def test_observed_squared_counts_only_what_is_observed():
    fn = fusedpc.losses.observed_squared
    y = jnp.array([[1.0, 2.0, 3.0]])
    t = jnp.array([[0.0, jnp.nan, 1.0]])
    assert np.array_equal(np.asarray(fn.error(y, t)), [[1.0, 0.0, 2.0]])
    assert float(fn.loss(y, t)) == pytest.approx(2.5)
    assert fusedpc.losses.resolve("observed_squared") is fn


def test_infer_refuses_a_tree_without_latents():
    program = fusedpc.make_step(frozen.tanh())
    with pytest.raises(ValueError, match="infer: the tree has no fusedpc.Latent"):
        program.infer(program.init(jax.random.key(0)).state, jnp.ones((2, 3)), jnp.ones((2, 3)))


def _digits():
    datasets = pytest.importorskip("sklearn.datasets")
    data = datasets.load_digits()
    x = (data.data / 16.0).astype(np.float32)
    order = np.random.default_rng(0).permutation(len(x))
    return x[order[360:]], data.target[order[360:]], x[order[:360]]


@pytest.mark.slow
def test_a_generative_network_fills_in_hidden_halves_better_than_the_mean_image():
    """A code latent (10 class places + 4 free, prior 0 where the class is unknown) decodes
    to the 64 pixels; trained with the class known in half the rows, it infers the code of
    a held-out digit from its top half and fills in the bottom half."""
    x_train, y_train, x_test = _digits()
    width = 14
    tree = fusedpc.Sequential([
        fusedpc.Latent(1.0),
        fusedpc.LearningNetwork(fusedpc.PCNetwork([width, 128, 64], "tanh",
                                                  key=jax.random.key(0)), optax.adam(1e-3)),
    ])
    program = fusedpc.make_step(tree, "observed_squared",
                                relaxation=fusedpc.Relaxation(steps=20, rate=0.3))
    carry = program.init(jax.random.key(1))
    step = jax.jit(program.step, donate_argnums=0)
    rows = np.random.default_rng(0)
    for _ in range(1500):
        batch = rows.choice(len(x_train), 64, replace=False)
        prior = np.zeros((64, width), np.float32)
        known = rows.random(64) < 0.5
        prior[np.flatnonzero(known), y_train[batch][known]] = 1.0
        carry, _ = step(carry, prior, x_train[batch])
    observed = x_test.copy()
    observed[:, 32:] = np.nan
    got = program.infer(carry.state, np.zeros((len(x_test), width), np.float32), observed)
    filled = float(np.mean((np.asarray(got.output)[:, 32:] - x_test[:, 32:]) ** 2))
    mean_image = float(np.mean((x_train.mean(0)[32:] - x_test[:, 32:]) ** 2))
    assert filled < 0.95 * mean_image, (filled, mean_image)
