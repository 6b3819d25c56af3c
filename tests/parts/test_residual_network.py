"""Deep residual PC networks and μPC (`fusedpc.residual_pc_network`): structure, multipliers,
the exact step against `jax.grad`, depth-stable activities, and learning at depth."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fusedpc
from fusedpc.parts import mupc_multipliers
from tests.helpers import norm_rel_error


def _weights(tree: fusedpc.Sequential) -> list[jax.Array]:
    """Input layer, every block's matrix, readout: the network's weights in order."""
    first, *rest = [p for p in tree.parts if isinstance(p, fusedpc.LearningNetwork)]
    repeat = next(p for p in tree.parts if isinstance(p, fusedpc.Repeat))
    blocks = [b.parts[0].branch.parts[0].network.weights[0] for b in repeat.blocks]
    return [first.network.weights[0], *blocks, rest[0].network.weights[0]]


def _reference(weights: list[jax.Array], x: jax.Array, depth: int, width: int) -> jax.Array:
    """The μPC network written out with plain jax: $h_0 = a_{in} W x$,
    $h_l = h_{l-1} + a_{hid} W_l \\mathrm{relu}(h_{l-1})$, $y = a_{out} W \\mathrm{relu}(h_L)$."""
    a_in, a_hid, a_out = mupc_multipliers(x.shape[-1], width, depth)
    h = a_in * x @ weights[0].T
    for w in weights[1:-1]:
        h = h + a_hid * jax.nn.relu(h) @ w.T
    return a_out * jax.nn.relu(h) @ weights[-1].T


def test_structure_multipliers_and_latents():
    tree = fusedpc.residual_pc_network(12, 16, 3, 5, optimiser=optax.sgd(0.1),
                                       key=jax.random.key(0))
    assert mupc_multipliers(12, 16, 5) == (1 / math.sqrt(12), 1 / math.sqrt(80), 1 / 16)
    repeat = next(p for p in tree.parts if isinstance(p, fusedpc.Repeat))
    assert len(repeat.blocks) == 5
    assert sum(isinstance(p, fusedpc.Latent) for p in tree.parts) == 1
    assert all(isinstance(b.parts[-1], fusedpc.Latent) for b in repeat.blocks)
    weights = _weights(tree)
    assert [w.shape for w in weights] == [(16, 12)] + [(16, 16)] * 5 + [(3, 16)]
    stacked = np.concatenate([np.asarray(w).ravel() for w in weights])
    assert abs(stacked.std() - 1.0) < 0.05  # μPC: N(0, 1) weights, the scale in the multipliers
    plain = fusedpc.residual_pc_network(12, 16, 3, 5, optimiser=None, key=jax.random.key(0),
                                        latents="none", parameterisation="standard")
    assert not any(isinstance(p, fusedpc.Latent) for p in plain.parts)
    he = np.asarray(_weights(plain)[1])
    assert abs(he.std() - math.sqrt(2 / 16)) < 0.1  # He initialisation, multipliers 1


@pytest.mark.parametrize("kwargs, message", [
    ({"depth": 0}, "depth must be an integer >= 1, got 0"),
    ({"width": 2.5}, "width must be an integer >= 1, got 2.5"),
    ({"parameterisation": "mup"}, "parameterisation must be one of ('mupc', 'standard'), "
                                  "got 'mup'"),
    ({"activation": "swish"}, "activation must be one of"),
    ({"latents": "all"}, "latents must be one of ('blocks', 'none'), got 'all'"),
])
def test_bad_settings_name_the_argument(kwargs, message):
    args = {"in_width": 4, "width": 8, "out_width": 2, "depth": 3} | kwargs
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        fusedpc.residual_pc_network(**args, optimiser=None, key=jax.random.key(0))


def test_scale_part_checks_its_multiplier_and_backward():
    with pytest.raises(ValueError, match="multiplier must be a finite, non-zero number, got 0"):
        fusedpc.frozen.scale(0)
    check = fusedpc.check_backward(fusedpc.frozen.scale(0.3), jnp.ones((4, 3)))
    assert check.overall < 1e-6


@pytest.mark.parametrize("depth", [1, 6])
def test_the_exact_step_is_jax_grad_of_the_written_out_network(depth):
    width, lr = 8, 0.05
    tree = fusedpc.residual_pc_network(5, width, 3, depth, optimiser=optax.sgd(lr),
                                       key=jax.random.key(depth), latents="none")
    x = jax.random.normal(jax.random.key(10), (16, 5))
    y = jax.random.normal(jax.random.key(11), (16, 3))
    program = fusedpc.make_step(tree)
    carry = program.init(jax.random.key(0))
    carry, out = jax.jit(program.step)(carry, x, y)
    weights = _weights(tree)

    def loss(ws):
        return 0.5 * jnp.mean(jnp.sum(jnp.square(_reference(ws, x, depth, width) - y), -1))

    assert norm_rel_error(out.output, _reference(weights, x, depth, width)) < 1e-6
    grads = jax.grad(loss)(weights)
    expected = [w - lr * g for w, g in zip(weights, grads)]
    learned = _weights(program.write_back(carry.state))
    assert norm_rel_error(learned, expected) < 1e-5


def test_mupc_keeps_the_stream_the_same_size_at_any_depth_and_standard_does_not():
    x = jax.random.normal(jax.random.key(3), (64, 16))

    def sizes(parameterisation):
        out = []
        for depth in (4, 64):
            tree = fusedpc.residual_pc_network(16, 32, 4, depth, optimiser=None,
                                               key=jax.random.key(depth), latents="none",
                                               parameterisation=parameterisation)
            program = fusedpc.make_step(tree)
            out.append(float(jnp.std(program.predict(program.init(jax.random.key(0)).state, x))))
        return out

    mupc, standard = sizes("mupc"), sizes("standard")
    assert 0.5 < mupc[1] / mupc[0] < 2.0, mupc
    assert standard[1] / standard[0] > 1e6, standard  # about 2^60 apart: He with no scaling


def _digits():
    datasets = pytest.importorskip("sklearn.datasets")
    data = datasets.load_digits()
    x = (data.data / 16.0).astype(np.float32)
    order = np.random.default_rng(0).permutation(len(x))
    test, train = order[:360], order[360:]
    return x[train], data.target[train], x[test], data.target[test]


def _train(tree, steps, seed=0, relaxation=None):
    x_train, y_train, x_test, y_test = _digits()
    onehot = np.eye(10, dtype=np.float32)
    program = fusedpc.make_step(tree, relaxation=relaxation)
    carry = program.init(jax.random.key(seed))
    step = jax.jit(program.step, donate_argnums=0)
    rows = np.random.default_rng(seed)
    for _ in range(steps):
        batch = rows.choice(len(x_train), 64, replace=False)
        carry, _ = step(carry, x_train[batch], onehot[y_train[batch]])
    predicted = np.argmax(np.asarray(program.predict(carry.state, x_test)), -1)
    return float(np.mean(predicted == y_test)), int(carry.counters.skipped)


@pytest.mark.slow
def test_mupc_learns_the_digits_at_depth_with_every_block_a_latent_and_standard_fails():
    relaxation = fusedpc.Relaxation(steps=8, rate=0.1)
    mupc = fusedpc.residual_pc_network(64, 32, 10, 48, optimiser=optax.adam(0.1),
                                       key=jax.random.key(0))
    accuracy, skipped = _train(mupc, 150, relaxation=relaxation)
    assert accuracy > 0.9 and skipped == 0, (accuracy, skipped)
    standard = fusedpc.residual_pc_network(64, 32, 10, 48, optimiser=optax.adam(0.1),
                                           key=jax.random.key(0), parameterisation="standard")
    accuracy, skipped = _train(standard, 30, relaxation=relaxation)
    assert accuracy < 0.5, accuracy  # the stream overflows or the relaxation diverges


@pytest.mark.slow
def test_the_example_in_docs_pc_depth_runs():
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "pc-depth.md").read_text()
    match = re.search(r"<!-- example: pc-depth -->\s*```python\n(.*?)```", text, re.DOTALL)
    assert match, "docs/pc-depth.md lost its `<!-- example: pc-depth -->` code block"
    namespace: dict = {}
    exec(compile(match.group(1), "docs/pc-depth.md", "exec"), namespace)  # noqa: S102
    assert int(namespace["carry"].counters.skipped) == 0
    assert np.isfinite(float(namespace["out"].metrics.loss))
