"""Every part type works in a segment between latents: for each, the tree
`Sequential([part, Latent(), linear])` at the Z-IL rate (fixed prediction, rate 1/Pi, one
sweep per latent) takes exactly the exact step of `Sequential([part, linear])`, which the
conformance and parity suites check against autodiff, and a standard relaxation commits a
finite step."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import CONFORMANCE_CASES, assert_tree_allclose, normal

import fusedpc
from fusedpc import frozen

EXTRA_CASES = {
    "autodiff_mlp": lambda: (frozen.from_module(eqx.nn.MLP(4, 5, 8, 1, key=jax.random.key(3))),
                             normal(120, (6, 4))),
    "learning_conv": lambda: (fusedpc.LearningConv2d(2, 3, 3, optax.sgd(0.1),
                                                     key=jax.random.key(4)),
                              normal(121, (2, 5, 5, 2))),
    "iterative_network": lambda: (fusedpc.IterativeNetwork(
        fusedpc.PCNetwork([4, 6, 5], "tanh", key=jax.random.key(5)), optax.sgd(0.1),
        inference_steps=3), normal(122, (6, 4))),
}
CASES = {name: case for name, case in {**CONFORMANCE_CASES, **EXTRA_CASES}.items()
         if name not in ("gpt", "latent")}  # a GPT: test_gpt_latents.py; a latent: no segment
# three seconds or more each (the fast loop leaves them out)
SLOW = {"repeat_scanned", "repeat_unrolled", "hybrid_tree", "autodiff_mlp", "learning_conv",
        "iterative_network", "attention_frozen_slots", "attention_fused_learning_qkv"}
# the standard relaxation on a representative few: composites, a scan, autodiff, conv, and a
# part that relaxes on its own
RELAXED = ("hybrid_tree", "repeat_scanned", "learning_conv", "autodiff_mlp",
           "iterative_network")


def _params(names):
    return [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in names]


def _head(width: int) -> fusedpc.AbstractPart:
    weight = 0.5 * jax.random.normal(jax.random.key(7), (3, width))
    return frozen.linear(weight, 0.1 * jnp.ones(3))


def _trees(name):
    part, x = CASES[name]()
    width = int(jnp.shape(fusedpc.make_step(part).predict(
        fusedpc.make_step(part).init(jax.random.key(0)).state, x))[-1])
    head = _head(width)
    return (fusedpc.Sequential([part, fusedpc.Latent(), head]),
            fusedpc.Sequential([part, head]), x)


def _target(program, state, x):
    y = program.predict(state, x)
    return jax.random.normal(jax.random.key(9), jnp.shape(y))


@pytest.mark.parametrize("name", _params(sorted(CASES)))
def test_a_part_below_a_latent_learns_the_exact_step_at_the_z_il_rate(name):
    with_latent, plain, x = _trees(name)
    exact = fusedpc.make_step(plain)
    start = exact.init(jax.random.key(0))
    target = _target(exact, start.state, x)
    want, want_out = jax.jit(exact.step)(start, x, target)
    pc = fusedpc.make_step(with_latent, relaxation=fusedpc.Relaxation(
        steps=1, rate=1.0, fixed_prediction=True))
    got, got_out = jax.jit(pc.step)(pc.init(jax.random.key(0)), x, target)
    assert bool(got_out.metrics.committed)
    assert_tree_allclose(got.state.parts[0], want.state.parts[0], rtol=1e-5, atol=1e-7)
    if want_out.input_error is not None:
        assert_tree_allclose(got_out.input_error, want_out.input_error, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", _params(RELAXED))
def test_a_standard_relaxation_commits_a_finite_step_for_every_part(name):
    with_latent, _, x = _trees(name)
    pc = fusedpc.make_step(with_latent, relaxation=fusedpc.Relaxation(
        steps=3, rate=0.1, record_energy=True))
    start = pc.init(jax.random.key(0))
    new, out = jax.jit(pc.step)(start, x, _target(pc, start.state, x))
    assert bool(out.metrics.committed)
    trajectory = np.asarray(out.metrics.relaxation.energy_trajectory)
    assert np.all(np.isfinite(trajectory)) and trajectory[-1] <= trajectory[0] + 1e-6
